"""The optimizer overlapped with backward (``model.overlap_optimizer(opt)``, torch's
``_register_fused_optim``) against references fastddp did not write: torch DDP followed by
the same optimizer's ``step()``, and torch DDP's own ``_register_fused_optim`` (which runs on
gloo: an allreduce hook, then torch's functional optimizer per parameter).

Scenarios for a harness world (2 and 3 gloo ranks, and 1)."""

import copy
import pickle

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.parallel.distributed import _MixedPrecision

import fastddp
from tests.python.scenarios import assert_close_ulps, mlp, rounding_ulps, vector_batch
from tests.python.sleep_model import BUCKET_CAP_MB, WIDTH, SleepInBackward, batch

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adamw_foreach": (torch.optim.AdamW, {"lr": 0.01, "foreach": True}),
    "adamw_fused": (torch.optim.AdamW, {"lr": 0.01, "fused": True}),
    "adam_fused_amsgrad": (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True,
                                              "fused": True}),
    "sgd_fused": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.1,
                                    "weight_decay": 0.01, "fused": True}),
    "sgd_fused_plain": (torch.optim.SGD, {"lr": 0.05, "fused": True}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
}

# Tiny buckets: mlp()'s six parameters in several buckets, so the steps really go bucket by
# bucket. Both models get the same cap, hence the same bucket layout and sums.
CAP_MB = 0.002


class TwoGroupsWithUnused(nn.Module):
    """mlp() plus a layer no forward uses (for find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _hook(model, name: str | None) -> None:
    fast = isinstance(model, fastddp.DistributedDataParallel)
    if name == "bf16":  # fastddp's native hook; torch's bf16_compress_hook rounds the same
        model.register_comm_hook(None, fastddp.hooks.bf16() if fast else dh.bf16_compress_hook)
    elif name == "python":  # torch's allreduce_hook, on both models
        model.register_comm_hook(None, dh.allreduce_hook)


def train(optimizer: str = "sgd", steps: int = 4, gradient_as_bucket_view: bool = False,
          hook: str | None = None, no_sync_every: int = 0, model: str = "mlp",
          groups: bool = False, schedule: bool = False, reload_at: int = -1,
          device: str = "cpu", **ddp_kwargs) -> dict:
    """fastddp with ``overlap_optimizer`` against torch DDP + the same optimizer's step()
    after backward, from one set of weights on the same batches. no_sync_every=k: every
    k-th backward runs under no_sync() (accumulated, stepped with the next one). groups: two
    param groups with different learning rates. schedule: a StepLR halving them after each
    step. reload_at=k: both optimizers reload their own state_dict before step k (a
    resume). device="cuda": both models on cuda:0 (ranks sharing one GPU over gloo).
    Returns whether parameters, averaged grads and optimizer state agree bit for
    bit, whether the replicas agree, and whether fastddp stepped natively (torch's fused
    kernels from C++) or through the optimizer's step()."""
    cls, kwargs = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    base = (TwoGroupsWithUnused() if model == "unused" else mlp()).to(device)
    if device != "cpu":
        ddp_kwargs["device_ids"] = [0]
    common = dict(gradient_as_bucket_view=gradient_as_bucket_view, bucket_cap_mb=CAP_MB,
                  **ddp_kwargs)
    # fastddp's own argument, and torch 2.15's (the local torch has neither): the reference
    # runs without them (lazy buckets give torch 2.15 the same numbers as eager ones).
    own = {name: common.pop(name, False)
           for name in ("check_for_nan_in_grad", "lazy_bucket_allocation")}
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), **common, **own)
    ref = TorchDDP(copy.deepcopy(base), **common)
    _hook(fast, hook)
    _hook(ref, hook)

    def make(m):
        params = list(m.module.parameters())
        if groups:
            return cls([{"params": params[:2], "lr": kwargs["lr"] / 3}, {"params": params[2:]}],
                       **kwargs)
        return cls(params, **kwargs)

    fast_opt, ref_opt = make(fast), make(ref)
    fast.overlap_optimizer(fast_opt)
    schedulers = ([torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
                   for o in (fast_opt, ref_opt)] if schedule else [])
    # Bit for bit, but with torch's allreduce_hook on 3 ranks: fastddp runs it as its own
    # reduction (x 1/world), torch divides (docs/arguments.md), and the last bit of a sum may
    # differ (also without an overlapped optimizer); rounding_ulps() bounds that.
    ulps = rounding_ulps() if hook == "python" else 0
    grads_equal = True
    for step in range(steps):
        if step == reload_at:
            for o in (fast_opt, ref_opt):
                o.load_state_dict(copy.deepcopy(o.state_dict()))
        inputs, target = vector_batch(step, device=device)
        accumulate = no_sync_every and step % no_sync_every == no_sync_every - 1
        for m in (fast, ref):
            with m.no_sync() if accumulate else _null():
                F.mse_loss(m(inputs), target).backward()
        if accumulate:
            continue
        ref_opt.step()
        grads_equal &= all(_close(a.grad, b.grad, ulps) for a, b in
                           zip(fast.module.parameters(), ref.module.parameters()))
        fast_opt.zero_grad()
        ref_opt.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
    fast_params, ref_params = list(fast.module.parameters()), list(ref.module.parameters())
    equal = all(_close(a, b, ulps) for a, b in zip(fast_params, ref_params))
    state_equal = _same_state(fast_opt, ref_opt, ulps)
    gathered = [None] * dist.get_world_size()
    mine = torch.cat([p.detach().reshape(-1) for p in fast_params]).cpu()
    dist.all_gather_object(gathered, mine)
    start = torch.cat([p.detach().reshape(-1) for p in base.parameters()]).cpu()
    moved = not torch.equal(mine, start)
    result = {"equal": equal, "grads_equal": grads_equal, "state_equal": state_equal,
              "replicas_agree": all(torch.equal(g, mine) for g in gathered), "moved": moved,
              "native": type(fast._overlap.native).__name__ == "FusedStep"}
    if own["lazy_bucket_allocation"]:  # nothing held once the last step has run
        result["held_bucket_bytes"] = fast._reducer.held_bucket_bytes()
    return result


def registered_fused(optimizer: str = "sgd", steps: int = 4) -> dict:
    """fastddp's ``_register_fused_optim`` against torch DDP's, both with the same optimizer
    class and arguments over all parameters; neither script calls step()."""
    cls, kwargs = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    base = mlp()
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    for m in (fast, ref):
        m._register_fused_optim(cls, **kwargs)
    for step in range(steps):
        inputs, target = vector_batch(step)
        for m in (fast, ref):
            F.mse_loss(m(inputs), target).backward()
            for p in m.parameters():
                p.grad = None
    # torch's runs its allreduce_hook (a division by the world size), fastddp its own
    # reduction (x 1/world): on 3 ranks the last bit may differ (see train()).
    ulps = rounding_ulps()
    return {"equal": all(_close(a, b, ulps) for a, b in
                         zip(fast.module.parameters(), ref.module.parameters())),
            "moved": not all(torch.equal(a, b) for a, b in
                             zip(fast.module.parameters(), base.parameters()))}


class TwoSleeps(nn.Module):
    """``body`` -> a sleep in backward -> ``mid`` -> another sleep -> ``last``. With
    buckets of BUCKET_CAP_MB, each 1 MiB layer is a bucket of its own: backward launches
    body's two buckets, sleeps, launches mid's, sleeps, then last's."""

    def __init__(self, sleep_s: float):
        super().__init__()
        self.sleep_s = sleep_s
        self.last = nn.Parameter(torch.ones(()))  # registered first: its gradient comes last
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mid(SleepInBackward.apply(x * self.last, self.sleep_s))
        return self.body(SleepInBackward.apply(x, self.sleep_s))


def steps_during_backward() -> dict:
    """TwoSleeps: body's two buckets are reduced while backward sleeps (a sleep takes no
    CPU: it lasts as long on a loaded machine), so when mid's bucket is launched they are
    finished and stepped, before last's gradient exists: inside backward. Each step of the
    second and third backward records whether it stepped body's parameters and whether
    last's gradient was there yet (the first backward has one bucket for everything, as in
    torch, until the buckets are rebuilt in gradient order). The numbers still equal torch
    DDP + step()."""
    torch.manual_seed(0)
    base = TwoSleeps(sleep_s=1.0)  # against the reduction of two 1 MiB buckets on loopback
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB)
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB)
    fast_opt = torch.optim.SGD(fast.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    fast.overlap_optimizer(fast_opt)
    last, body = fast.module.last, set(map(id, fast.module.body.parameters()))
    seen = []  # per step: whether it stepped body's parameters, whether last's grad was in

    def record(opt, *_):
        stepped = {id(p) for g in opt.param_groups for p in g["params"]}
        if step > 0:
            seen.append((bool(stepped & body), last.grad is not None))

    fast_opt.register_step_post_hook(record)
    for step in range(3):
        inputs = batch(torch.Generator().manual_seed(step))
        for m in (fast, ref):
            m(inputs).square().mean().backward()
        ref_opt.step()
        fast_opt.zero_grad()
        ref_opt.zero_grad()
    return {"body_steps_inside_backward": sum(b and not g for b, g in seen),
            "body_steps": sum(b for b, _ in seen), "buckets": len(fast.bucket_plan()),
            "equal": all(torch.equal(a, b) for a, b in
                         zip(fast.parameters(), ref.parameters()))}


def refusals() -> dict:
    """What overlap_optimizer refuses, and the user's own step() call."""
    model = fastddp.DistributedDataParallel(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.overlap_optimizer(opt)
    errors = {}
    for name, call in {
        "user_step": opt.step,
        "twice": lambda: model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)),
        "pickle": lambda: pickle.dumps(model),
        "lbfgs": lambda: fastddp.DistributedDataParallel(mlp()).overlap_optimizer(
            torch.optim.LBFGS(mlp().parameters())),
        "not_an_optimizer": lambda: fastddp.DistributedDataParallel(mlp()).overlap_optimizer(
            [torch.zeros(1)]),
        "delayed": lambda: _delayed_model().overlap_optimizer(
            torch.optim.SGD(mlp().parameters(), lr=0.1)),
        "mixed_precision": lambda: fastddp.DistributedDataParallel(
            mlp(), mixed_precision=_bf16()).overlap_optimizer(
                torch.optim.SGD(mlp().parameters(), lr=0.1)),
    }.items():
        try:
            call()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - the type is what the test checks
            errors[name] = f"{type(e).__name__}: {e}"
    return errors


def _delayed_model() -> fastddp.DistributedDataParallel:
    module = mlp()
    named = dict(module.named_parameters())
    return fastddp.DistributedDataParallel(
        module, delay_all_reduce_named_params=[("2.weight", named["2.weight"])],
        param_to_hook_all_reduce=named["0.weight"])


def _bf16() -> _MixedPrecision:
    return _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _close(a: torch.Tensor | None, b: torch.Tensor | None, ulps: int) -> bool:
    """Both None, or within ``ulps`` ulps of b's largest element (0: bit for bit)."""
    if a is None or b is None:
        return a is None and b is None
    try:
        assert_close_ulps(a, b, ulps)
    except AssertionError:
        return False
    return True


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer, ulps: int) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa["param_groups"] != sb["param_groups"] or sa["state"].keys() != sb["state"].keys():
        return False
    return all(_close(x, y, ulps) if isinstance(y, torch.Tensor) else x == y
               for k in sa["state"] for x, y in
               ((sa["state"][k][n], sb["state"][k][n]) for n in sb["state"][k]))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
