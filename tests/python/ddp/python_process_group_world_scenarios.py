"""A process group written in Python over 2 or 3 ranks, under torch DDP and under fastddp
(test_python_process_group.py runs these on every rank of a harness world, see harness.py).

``StrictGroup`` is what such a group may be and still be accepted by torch DDP: never
registered with c10d (``dist.get_rank(group)``, ``dist.all_gather(group=...)`` refuse it),
collectives that take their options as a required argument, and Works whose ``wait`` takes
the ``timeout`` torch's C++ passes as a required argument (torch declares
``Work.wait(timeout)``; torch's own test_c10d_pypg writes its Works so). Every collective
fastddp issues, construction checks and skip votes included, must reach it that way.

torch's Join cannot use such a group: it asks ``dist.get_rank(group)`` and calls
``work.wait()`` with no timeout itself. The join scenario therefore uses ``registered()``:
the same group made by ``dist.new_group`` over a backend registered in Python (as torchft
registers its groups), with Works whose timeout is optional.

Two ranks compare bit for bit (fastddp halves before the sum, torch after: exact), three
within scenarios.rounding_ulps() (1/3 before the sum, or after it: one rounding apart).
"""

import copy
import sys
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import AllreduceOptions
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp import _group_ops
from fastddp.hooks import node_groups
from tests.python.ddp.skip_unused_scenarios import CAP_MB, Branches
# Branches: 8 in, 32 out
from tests.python.ddp.skip_unused_scenarios import _batch as branches_batch
from tests.python.scenarios import agree, compare_grads, compare_state, mlp, unwrap, vector_batch

WRAPPERS = {"torch": TorchDDP, "fastddp": fastddp.DistributedDataParallel}
_BACKEND = "fastddp_test_python"  # the backend name registered() registers, once a process


class StrictWork(dist._Work):
    """The world's gloo Work behind a Python Work: ``wait(timeout)`` as torch declares it,
    a future completed from Python with the collective's tensors once gloo is done."""

    def __init__(self, inner: dist.Work, tensors: list, group: "StrictGroup") -> None:
        super().__init__()
        self.inner, self.tensors, self.group = inner, tensors, group

    def wait(self, timeout):
        self.group.timeouts.append(timeout)
        self.inner.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        self.group.futures += 1
        self.inner.wait()
        future = torch.futures.Future()
        future.set_result(self.tensors)
        return future


class LenientWork(StrictWork):
    """torch's Join calls ``work.wait()`` from Python without a timeout; such a wait is
    counted as fastddp's when a fastddp function is on the stack (fastddp must pass one)."""

    def wait(self, timeout=None):
        if timeout is None:
            frame = sys._getframe(1)
            while frame is not None and not frame.f_globals.get("__name__", "").startswith(
                    "fastddp."):
                frame = frame.f_back
            self.group.untimed_in_fastddp += frame is not None
        return super().wait(timeout)


class StrictGroup(dist.ProcessGroup):
    """The world's gloo group behind a Python ProcessGroup; counts each collective by kind
    and reduce op, the timeouts its Works were waited with and the futures read."""

    work_type = StrictWork

    def __init__(self, rank: int | None = None, size: int | None = None) -> None:
        super().__init__(dist.get_rank() if rank is None else rank,
                         dist.get_world_size() if size is None else size)
        self.inner = dist.group.WORLD
        self.calls: Counter = Counter()
        self.timeouts: list = []
        self.futures = self.untimed_in_fastddp = 0

    def _work(self, inner: dist.Work, tensors: list) -> StrictWork:
        return self.work_type(inner, tensors, self)

    # The options are required, as in c10d's signatures: a caller must pass them.
    def allreduce(self, tensors, opts):
        op = str(opts.reduceOp.op).rsplit(".", 1)[-1]  # RedOpType.SUM -> SUM
        self.calls[f"allreduce {op} {tensors[0].dtype}"] += 1
        return self._work(self.inner.allreduce(tensors, opts), tensors)

    def broadcast(self, tensors, opts):
        self.calls["broadcast"] += 1
        return self._work(self.inner.broadcast(tensors, opts), tensors)

    def allgather(self, outputs, inputs, opts):
        self.calls["allgather"] += 1
        return self._work(self.inner.allgather(outputs, inputs, opts), outputs)

    def getBackendName(self) -> str:
        return "strict-python"


class LenientGroup(StrictGroup):
    """torch DDP's join calls ``process_group.allreduce(tensor)``: one tensor, no options
    (its _match_unused_params_allreduce); torch's Join waits without a timeout."""

    work_type = LenientWork

    def allreduce(self, tensors, opts=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        return super().allreduce(tensors, AllreduceOptions() if opts is None else opts)


def registered() -> LenientGroup:
    """A LenientGroup over the whole world made by dist.new_group, so that c10d's group map
    (and with it torch's Join) knows it. A collective call, as new_group is."""
    if not hasattr(dist.Backend, _BACKEND.upper()):
        dist.Backend.register_backend(
            _BACKEND, lambda store, rank, size, timeout: LenientGroup(rank, size),
            devices=["cpu"])
    group = dist.new_group(backend=_BACKEND)
    assert isinstance(group, LenientGroup), type(group)
    return group


def _pair(build, group_of, **kwargs) -> dict:
    """torch DDP and fastddp around copies of one module, each over its own group."""
    torch.manual_seed(0)
    base = build()
    return {name: wrap(copy.deepcopy(base), process_group=group_of(name), **kwargs)
            for name, wrap in WRAPPERS.items()}


def _train(models: dict, steps: int, batch=vector_batch, before=None) -> None:
    """SGD with momentum side by side; grads and state compared after every step."""
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for n, m in models.items()}
    for step in range(steps):
        inputs, target = batch(step)
        for name, model in models.items():
            if before is not None:
                before(model, step)
            opts[name].zero_grad()
            F.mse_loss(model(inputs), target).backward()
        agree(lambda: compare_grads(unwrap(models["torch"]), unwrap(models["fastddp"]),
                                    f"step {step}"))
        for opt in opts.values():
            opt.step()
        agree(lambda: compare_state(unwrap(models["torch"]), unwrap(models["fastddp"]),
                                    f"after step {step}"))


def _waited(group: StrictGroup) -> dict:
    return {"calls": dict(group.calls), "futures": group.futures,
            "untimed_in_fastddp": group.untimed_in_fastddp,
            "timeouts": sorted({str(t) for t in group.timeouts}),
            "timedelta": all(isinstance(t, timedelta) for t in group.timeouts)}


def construction_and_training(steps: int = 3, **ddp_kwargs) -> dict:
    """Each rank starts from different weights: construction's checks and broadcast run
    through the strict group, after which every rank holds rank 0's weights; then both
    wrappers train alike. Also reads the logging data and comm_stats() (fastddp's
    timeline). Returns what each wrapper's group saw."""
    groups = {name: StrictGroup() for name in WRAPPERS}
    torch.manual_seed(0)
    base = mlp()
    with torch.no_grad():
        for p in base.parameters():
            p.add_(dist.get_rank())  # rank 0's weights are the ones to train from
    models = {name: wrap(copy.deepcopy(base), process_group=groups[name], bucket_cap_mb=CAP_MB,
                         **ddp_kwargs)
              for name, wrap in WRAPPERS.items()}
    agree(lambda: compare_state(unwrap(models["torch"]), unwrap(models["fastddp"]),
                                "after construction"))
    agree(lambda: _same_on_all_ranks(unwrap(models["fastddp"]).parameters()))
    agree(lambda: dist.get_rank() != 0 or compare_state(  # and they are rank 0's
        base, unwrap(models["fastddp"]), "rank 0 after construction"))
    _train(models, steps)
    fast = models["fastddp"]
    assert fast._get_ddp_logging_data()["world_size"] == dist.get_world_size()
    assert fast.comm_stats()["steps"] == steps, fast.comm_stats()
    return {name: _waited(g) for name, g in groups.items()}


def _same_on_all_ranks(params) -> None:
    for i, p in enumerate(params):
        gathered = [torch.empty_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, p.detach().contiguous())
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"parameter {i} differs"


def shapes_differ() -> None:
    """Rank 1's model is wider: the construction check, through the strict group, raises
    fastddp's ValueError on every rank."""
    width = 16 if dist.get_rank() == 1 else 8
    fastddp.DistributedDataParallel(nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2)),
                                    process_group=StrictGroup())


def skip_votes(steps: int = 4, **ddp_kwargs) -> dict:
    """find_unused_parameters with skip_all_reduce_unused_params: the used-parameter map,
    fastddp's vote on the skips and the gradients all go through the strict group; both
    wrappers give the same gradients (None where a bucket was skipped). Returns what each
    group saw."""
    groups = {name: StrictGroup() for name in WRAPPERS}
    models = _pair(Branches, groups.get, find_unused_parameters=True,
                   skip_all_reduce_unused_params=True, bucket_cap_mb=CAP_MB, **ddp_kwargs)

    def set_step(model, step):
        unwrap(model).step = step

    _train(models, steps, batch=branches_batch, before=set_step)
    return {name: _waited(g) for name, g in groups.items()}


def join_uneven(find_unused_parameters: bool = False) -> dict:
    """Rank r has 2 + 2r batches, under torch's Join over a Python group registered with
    c10d: joined ranks shadow the others' collectives through the group (the "will this
    backward sync" vote, the buffers' source, the final model's source: a MAX allreduce),
    and fastddp ends with torch DDP's parameters."""
    groups = {name: registered() for name in WRAPPERS}
    models = _pair(mlp, groups.get, find_unused_parameters=find_unused_parameters)
    for name, model in models.items():
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with Join([model]):
            for step in range(2 + 2 * dist.get_rank()):
                inputs, target = vector_batch(step)
                opt.zero_grad()
                F.mse_loss(model(inputs), target).backward()
                opt.step()
    agree(lambda: compare_state(unwrap(models["torch"]), unwrap(models["fastddp"]),
                                "after join"))
    return {name: _waited(g) for name, g in groups.items()}


def global_ranks() -> dict:
    """The world ranks of an unregistered group's ranks (what a hierarchical hook splits
    into node groups), gathered through the group itself; and of a registered group, from
    c10d's record."""
    strict, known = StrictGroup(), registered()
    return {"strict": _group_ops.global_ranks(strict),
            "hierarchical": node_groups._model_group_ranks(strict),
            "registered": _group_ops.global_ranks(known),
            "strict_calls": dict(strict.calls), "registered_calls": dict(known.calls)}


def bare_module_backward_after_ddp(**ddp_kwargs) -> None:
    """torch's test_ddp_invoke_work_object on 2 or 3 ranks: after the model's backward, a
    backward through the bare module (model.module) adds local gradients to the reduced
    ones, untouched by the reducer, as under torch (Note [a backward after the reduction])."""
    groups = {name: StrictGroup() for name in WRAPPERS}
    models = _pair(mlp, groups.get, **ddp_kwargs)
    inputs, target = vector_batch(0)
    for model in models.values():
        F.mse_loss(model(inputs), target).backward()
        F.mse_loss(model.module(inputs), target).backward()
    agree(lambda: compare_grads(models["torch"].module, models["fastddp"].module,
                                "after the bare module's backward"))
