"""How benchmarks/quality.py trains one configuration: the per-step ones (a DDP wrapper with
a comm hook) and those that synchronize every few steps instead (issue 47): torch's
post-local SGD, fastddp.DiLoCo and streaming DiLoCo, torchft's DiLoCo.

``Setup`` is what the benchmark's loops need of any of them: the module the loss runs, the
one scored, the optimizer, what to call after each step, the bytes one rank sent per step,
and the sync period (the timing loop times whole periods: DiLoCo's sync step is the
expensive one, a median of a few steps would miss it).

Bytes per step: fastddp's wrappers count them (``comm_stats()``, ``DiLoCo.stats()``). torch's
post-local SGD and torchft's DiLoCo count nothing, so they are counted here from the tensor
sizes and the schedule, as the payload the others count (the collective's input buffer):
post-local SGD allreduces the float32 gradients (4n bytes, n parameters) at each of its first
``start`` steps, then the float32 parameters (4n) every ``period`` steps; torchft's DiLoCo
allreduces the float32 pseudo-gradient (4n) every H steps.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp.tuning import diloco_advice

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer Nesterov SGD: the paper's values
POST_LOCAL_PERIOD = 10  # PeriodicModelAverager's period; torch's docs' example uses 4


@dataclass
class Setup:
    model: nn.Module      # what the loss runs
    module: nn.Module     # what evaluate() scores (rank 0's local weights)
    opt: torch.optim.Optimizer
    sent: Callable[[int], int | None]  # bytes one rank sent per step, after `steps` steps
    period: int = 1       # steps of one sync period: the timing loop times whole ones
    warmup: int = 0       # steps before the first timed period (0: the per-step rule)
    emulated: bool = True  # False: its collectives cannot go through an EmulatedLinkGroup
    after_step: Callable[[], None] = field(default=lambda: None)
    close: Callable[[], None] = field(default=lambda: None)
    keep: tuple = ()      # what must live as long as the run (torchft's Manager's TCPStore)


def _float32_bytes(model: nn.Module) -> int:
    return sum(4 * p.numel() for p in model.parameters() if p.requires_grad)


def diloco(sync_every: int, wire: str = "fp32", fragments: int = 1, overlap: int = 0,
           quantized_sum: str = "gather", outer_lr: float = OUTER_LR,
           outer_momentum: float = OUTER_MOMENTUM) -> Callable:
    """fastddp.DiLoCo around the task's optimizer (the inner one), outer Nesterov SGD (plain
    SGD at momentum 0)."""
    def make(t, group, start: int) -> Setup:
        model = t.make_model()
        opt = t.optimizer(model.parameters())
        d = fastddp.DiLoCo(model, opt, sync_every=sync_every, outer_lr=outer_lr,
                           outer_momentum=outer_momentum, wire=wire, fragments=fragments,
                           overlap=overlap, quantized_sum=quantized_sum, process_group=group)
        return Setup(model, model, opt, lambda steps: round(d.stats()["payload_bytes"] / steps),
                     period=sync_every, warmup=sync_every, close=d.close)
    return make


def alone(t, group, start: int) -> Setup:
    """No communication at all: every rank trains its own copy on its own batches (what
    DiLoCo with H = infinity would do); rank 0's copy is scored."""
    model = t.make_model()
    return Setup(model, model, t.optimizer(model.parameters()), lambda steps: 0)


def post_local_sgd(period: int = POST_LOCAL_PERIOD) -> Callable:
    """torch's post_localSGD_hook (gradient allreduce for the first `start` steps, then none:
    post_local_gradient_allreduce=False, the paper's local SGD) with a PeriodicModelAverager
    averaging the parameters every `period` steps from then on."""
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    def make(t, group, start: int) -> Setup:
        ddp = TorchDDP(t.make_model(), process_group=group)
        ddp.register_comm_hook(post_local.PostLocalSGDState(
            process_group=group, subgroup=None, start_localSGD_iter=start,
            post_local_gradient_allreduce=False), post_local.post_localSGD_hook)
        averager = PeriodicModelAverager(period=period, warmup_steps=start,
                                         process_group=group)
        n = _float32_bytes(ddp.module)

        def sent(steps: int) -> int:
            averages = math.ceil(max(0, steps - start) / period)  # at start, start + period..
            return round((min(steps, start) + averages) * n / steps)

        return Setup(ddp, ddp.module, t.optimizer(ddp.parameters()), sent, period=period,
                     warmup=start, after_step=lambda: averager.average_parameters(
                         ddp.parameters()))
    return make


def torchft_diloco(sync_every: int) -> Callable:
    """torchft.local_sgd.DiLoCo (fp32 allreduce of the pseudo-gradient, outer Nesterov SGD):
    each rank one replica group of one rank, with its own TCPStore and Manager on torchft's
    ProcessGroupGloo, joined through a Lighthouse rank 0 runs, as
    tests/python/diloco/torchft_scenarios.py builds them. Its group is torchft's own (the
    Manager reconfigures it at each quorum), so no EmulatedLinkGroup can wrap it."""
    def make(t, group, start: int) -> Setup:
        from datetime import timedelta

        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        timeout = timedelta(seconds=120)  # the ranks share 2 loaded cores
        rank, world = dist.get_rank(), dist.get_world_size()
        server = LighthouseServer(bind="[::]:0", min_replicas=world) if rank == 0 else None
        address = [server.address() if server else None]
        dist.broadcast_object_list(address, src=0)
        model = t.make_model()  # the same seed on every rank: no initial sync needed
        opt = t.optimizer(model.parameters())
        outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                                nesterov=True)
        store = dist.TCPStore(host_name="localhost", port=0, is_master=True,
                              wait_for_workers=False)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=world,
            load_state_dict=lambda state: model.load_state_dict(state["model"]),
            state_dict=lambda: {"model": model.state_dict()},
            replica_id=f"quality_{rank}", store_addr="localhost", store_port=store.port,
            rank=0, world_size=1, lighthouse_addr=address[0], port=0, timeout=timeout,
            quorum_timeout=timeout, connect_timeout=timeout,
            use_async_quorum=False,  # torchft's DiLoCo requires it
            init_sync=False)
        context = DiLoCo(manager, [model], opt, outer, sync_every=sync_every)
        context.__enter__()
        n = _float32_bytes(model)

        def close() -> None:
            context.__exit__(None, None, None)
            manager.shutdown(wait=False)
            dist.barrier()  # every replica done before the Lighthouse goes
            if server is not None:
                server.shutdown()

        return Setup(model, model, opt, lambda steps: round(steps // sync_every * n / steps),
                     period=sync_every, warmup=sync_every, emulated=False, close=close,
                     keep=(store,))
    return make


def per_step(side: str, make_hook: Callable) -> Callable:
    """A per-step configuration: torch's or fastddp's DDP with `make_hook`'s (state, hook)
    registered (None: plain allreduce). One bucket (the models are small): torch's PowerSGD
    needs that on gloo."""
    def make(t, group, start: int) -> Setup:
        ddp = (TorchDDP if side == "torch" else fastddp.DistributedDataParallel)(
            t.make_model(), process_group=group)
        hook = make_hook()
        if hook is not None:
            ddp.register_comm_hook(*hook)
        sent = ((lambda steps: ddp.comm_stats()["bytes_sent"])
                if isinstance(ddp, fastddp.DistributedDataParallel) else (lambda steps: None))
        return Setup(ddp, ddp.module, t.optimizer(ddp.parameters()), sent)
    return make


# The configurations of issue 47, by the names the quality table keeps; fastddp's DiLoCo rows
# with the settings --advise predicts and recommends for them (one table:
# fastddp.tuning.diloco_advice.CONFIGS, which says why the streaming rows take H = 48 and
# overlap 2).
CONFIGS = {
    "torch post-local SGD": post_local_sgd(),
    **{name: diloco(**settings) for name, settings in diloco_advice.CONFIGS.items()},
    **{f"torchft diloco h{h}": torchft_diloco(h) for h in (10, 50, 100)},
}
