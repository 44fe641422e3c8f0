"""torch DDP's skip_all_reduce_unused_params, fastddp against torch DDP on the same data.
Run on every rank of a harness world (see harness.py); test_skip_unused.py runs them.

What torch 2.14.1 does, measured on 2 and 3 gloo ranks (and what these check): a bucket
whose parameters the forward does not reach is not reduced (a registered hook never sees
its index); its grads are not written back (None stays None); under
gradient_as_bucket_view a defined grad still goes through the copy-in, so it becomes the
bucket view, divided by the world size when no hook is registered; the logging data's
num_buckets_reduced counts the buckets reduced by the last backward. The C++ reducer's
Note [skipping unused buckets] (csrc/reducer/reducer.h) has the rest.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.ddp.python_process_group_scenarios import WrappedGroup
from tests.python.scenarios import (agree, compare_grads, compare_state, mlp, rounding_ulps, unwrap,
                                    vector_batch)

# 0.0001 MiB = 104 bytes: every parameter of Branches (none under 32 floats) fills a bucket
# of its own, so the unused layers are buckets of their own (torch's layout, never rebuilt
# under find_unused_parameters: buckets in reverse registration order).
CAP_MB = 0.0001
SKIP = {"skip_all_reduce_unused_params": True, "bucket_cap_mb": CAP_MB}
# How each step clears the grads: set to None, zeroed in place, or kept (accumulating),
# so that the skipped buckets' copy-in meets undefined, zero and live grads (step 2 skips
# `sometimes` with the grads step 1 gave it: under gradient_as_bucket_view torch divides
# them by the world size in place, without a hook).
ZERO = ["none", "zeros", "keep", "keep", "none", "keep"]


class Branches(nn.Module):
    """`never` is used on no rank, `sometimes` by every rank on odd steps, `trunk` and
    `head` always; `rank0` (with `disagree`) on rank 0 only. `unused_last` registers
    `never` first, which makes it the last bucket (GradBucket.is_last(), and pipelined
    hooks that hold work back for the last bucket). `dynamic=False` keeps `sometimes`
    unused too, for static_graph."""

    def __init__(self, unused_last: bool = False, dynamic: bool = True, disagree: bool = False):
        super().__init__()
        if unused_last:
            self.never = nn.Linear(32, 32)
        self.trunk = nn.Linear(8, 32)
        self.sometimes = nn.Linear(32, 32)
        if not unused_last:
            self.never = nn.Linear(32, 32)
        self.rank0 = nn.Linear(32, 32) if disagree else None
        self.head = nn.Linear(32, 32)
        self.dynamic = dynamic
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if self.dynamic and self.step % 2 == 1:
            h = torch.tanh(self.sometimes(h))
        if self.rank0 is not None and dist.get_rank() == 0:
            h = torch.tanh(self.rank0(h))
        return self.head(h)

    def unused(self) -> set[str]:
        names = {"never.weight", "never.bias"}
        if not (self.dynamic and self.step % 2 == 1):
            names |= {"sometimes.weight", "sometimes.bias"}
        return names


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(6, 8, generator=g), torch.randn(6, 32, generator=g)


def _recording_hook(calls: list):
    """A Python hook (the same function on both models): torch's allreduce_hook, but it
    records which buckets it is handed. Both divide before the allreduce: the same ops."""
    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append((bucket.index(), bucket.is_last()))
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])
    return hook


HOOKS = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}


def _pair(build, hook: str | None, **kwargs) -> tuple[TorchDDP, fastddp.DistributedDataParallel,
                                                      list[list]]:
    torch.manual_seed(0)
    base = build()
    models = (TorchDDP(copy.deepcopy(base), **kwargs),
              fastddp.DistributedDataParallel(copy.deepcopy(base), **kwargs))
    return models[0], models[1], _hooked(models, hook)


def _hooked(models, hook: str | None) -> list[list]:
    """Registers `hook` on each model; what each one's recording Python hook sees."""
    calls: list[list] = [[] for _ in models]
    for model, seen in zip(models, calls):
        if hook == "python":
            model.register_comm_hook(None, _recording_hook(seen))
        elif hook is not None:
            model.register_comm_hook(None, HOOKS[hook])
    return calls


def _skipped_now(fast: fastddp.DistributedDataParallel) -> list[int]:
    return [b["index"] for b in fast.comm_stats()["buckets"] if b["skipped"]]


def _unused_buckets(fast: fastddp.DistributedDataParallel) -> list[int]:
    """The buckets of this step's unused parameters, from the model's own account."""
    unused = unwrap(fast).unused()
    return [i for i, bucket in enumerate(fast.bucket_plan()) if set(bucket) <= unused]


def trains_as_torch(hook: str | None, gradient_as_bucket_view: bool, unused_last: bool = False,
                    static_graph: bool = False, steps: int = 6) -> dict:
    """Both models, with the same arguments and hook: grads after every backward, the
    parameters after every step, the logging data's num_buckets_reduced, and the buckets
    a Python hook is handed; and that the buckets of unused layers were skipped."""
    kwargs = dict(SKIP, gradient_as_bucket_view=gradient_as_bucket_view)
    if static_graph:
        kwargs["static_graph"] = True
    else:
        kwargs["find_unused_parameters"] = True
    ref, fast, calls = _pair(lambda: Branches(unused_last, dynamic=not static_graph), hook,
                             **kwargs)
    # torch's allreduce_hook and fp16_compress_hook divide by 3 (div_) where fastddp's
    # native hooks multiply by 1/3: one rounding apart on 3 ranks (scenarios.ULPS); the
    # rest is the same ops in the same order, bit for bit.
    ulps = rounding_ulps() if hook in HOOKS else 0
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fast)]
    logged, skipped = [], []
    for step in range(steps):
        inputs, target = _batch(step)
        for model, opt, seen in zip((ref, fast), opts, calls):
            unwrap(model).step = step
            seen.clear()
            if ZERO[step % len(ZERO)] != "keep":
                opt.zero_grad(set_to_none=ZERO[step % len(ZERO)] == "none")
            F.mse_loss(model(inputs), target).backward()
        agree(lambda: compare_grads(unwrap(ref), unwrap(fast), f"step {step}", ulps=ulps))
        agree(lambda: _same("num_buckets_reduced", *_logged(fast, ref)))
        agree(lambda: _same("hook calls", calls[1], calls[0]))
        logged.append(fast._get_ddp_logging_data().get("num_buckets_reduced"))
        skipped.append(_skipped_now(fast))
        # The first static-graph iteration reduces everything (torch's delay_all_reduce).
        expected = [] if static_graph and step == 0 else _unused_buckets(fast)
        agree(lambda: _same("skipped buckets", skipped[-1], expected))
        for opt in opts:
            opt.step()
        agree(lambda: compare_state(unwrap(ref), unwrap(fast), f"after step {step}", ulps))
    return {"logged": logged, "skipped": skipped, "buckets": len(fast.bucket_plan()),
            "never_grad": unwrap(fast).never.weight.grad is None}


def _same(what: str, ours: object, theirs: object) -> None:
    assert ours == theirs, f"{what}: fastddp {ours!r} != torch DDP {theirs!r}"


def _logged(*models: nn.Module) -> list:
    return [m._get_ddp_logging_data().get("num_buckets_reduced") for m in models]


def wire_collectives(steps: int = 4) -> dict:
    """torch DDP and fastddp, each over its own WrappedGroup (a Python ProcessGroup over
    the world's gloo): the gradient allreduces each issues per backward. The int32 ones
    (the used-parameter map, and fastddp's vote on the skips) are not gradients."""
    counts = {}
    for name, wrap in (("torch", TorchDDP), ("fastddp", fastddp.DistributedDataParallel)):
        group = _CountingGroup()
        torch.manual_seed(0)
        model = wrap(Branches(), process_group=group, find_unused_parameters=True, **SKIP)
        counts[name] = []
        for step in range(steps):
            model.module.step = step
            model.zero_grad()
            before = group.gradient_allreduces
            F.mse_loss(model(_batch(step)[0]), _batch(step)[1]).backward()
            counts[name].append(group.gradient_allreduces - before)
    return counts


class _CountingGroup(WrappedGroup):
    def __init__(self) -> None:
        super().__init__()
        self.gradient_allreduces = 0

    def allreduce(self, tensor_list, opts=None):
        if tensor_list[0].is_floating_point():
            self.gradient_allreduces += 1
        return super().allreduce(tensor_list, opts)


def without_unused_search() -> list:
    """find_unused_parameters=False: there is no unused set, so nothing is skipped (torch's
    is_unused_bucket finds none); a model that uses every parameter trains as torch."""
    ref, fast, _ = _pair(mlp, None, **SKIP)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, fast)]
    logged = []
    for step in range(3):
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad()
            inputs, target = vector_batch(step)
            F.mse_loss(model(inputs), target).backward()
        agree(lambda: compare_grads(ref.module, fast.module, f"step {step}"))
        agree(lambda: _same("num_buckets_reduced", *_logged(fast, ref)))
        agree(lambda: _same("skipped", _skipped_now(fast), []))
        logged.append(fast._get_ddp_logging_data().get("num_buckets_reduced"))
        for opt in opts:
            opt.step()
    return {"logged": logged, "buckets": len(fast.bucket_plan())}


def ranks_disagree(hook: str | None, steps: int = 4) -> dict:
    """`rank0` is used on rank 0 only: its buckets are unused on the other ranks. torch
    skips them there and not on rank 0, so the ranks' collectives mismatch (gloo aborts
    the process). fastddp skips only what the vote finds unused on every rank: the
    disputed buckets are reduced everywhere, with zeros from the ranks that did not use
    them, so grads and parameters are those of torch DDP without skipping."""
    torch.manual_seed(0)
    base = Branches(disagree=True)
    kwargs = dict(find_unused_parameters=True, bucket_cap_mb=CAP_MB)
    models = (TorchDDP(copy.deepcopy(base), **kwargs),
              fastddp.DistributedDataParallel(copy.deepcopy(base),
                                              skip_all_reduce_unused_params=True, **kwargs))
    ref, fast = models
    calls = _hooked(models, hook)
    ulps = rounding_ulps() if hook in HOOKS else 0  # as trains_as_torch
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    skipped = []
    for step in range(steps):
        inputs, target = _batch(step)
        for model, opt in zip(models, opts):
            unwrap(model).step = step
            opt.zero_grad()
            F.mse_loss(model(inputs), target).backward()
        agree(lambda: compare_grads(unwrap(ref), unwrap(fast), f"step {step}", ulps=ulps))
        skipped.append(_skipped_now(fast))
        # Branches.unused() names what no rank uses: rank0's buckets are not among them.
        agree(lambda: _same("skipped buckets", skipped[-1], _unused_buckets(fast)))
        if hook == "python":
            hooked = {index for index, _ in calls[1]}
            assert not hooked & set(skipped[-1]), (calls[1], skipped[-1])
            assert len(calls[1]) == len(fast.bucket_plan()) - len(skipped[-1]), calls[1]
            for seen in calls:
                seen.clear()
        for opt in opts:
            opt.step()
        agree(lambda: compare_state(unwrap(ref), unwrap(fast), f"after step {step}", ulps))
    check = torch.ones(1)
    dist.all_reduce(check)
    assert check.item() == dist.get_world_size()
    return {"skipped": skipped, "buckets": len(fast.bucket_plan())}


def with_overlap_and_lazy(overlap: bool, lazy: bool, gradient_as_bucket_view: bool,
                          static_graph: bool = False, steps: int = 6) -> None:
    """torch DDP with the same skips and a plain optimizer.step(), against fastddp's
    overlapped optimizer (a skipped bucket's parameters are stepped with the .grad torch's
    step sees: None is passed by, a kept or viewed grad is stepped) and lazy buckets (a
    skipped bucket's buffer comes and goes with the others'; none held after backward)."""
    kwargs = dict(SKIP, gradient_as_bucket_view=gradient_as_bucket_view)
    kwargs["static_graph" if static_graph else "find_unused_parameters"] = True
    torch.manual_seed(0)
    base = Branches(dynamic=not static_graph)
    ref = TorchDDP(copy.deepcopy(base), **kwargs)
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), lazy_bucket_allocation=lazy,
                                           **kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fast)]
    if overlap:
        fast.overlap_optimizer(opts[1])
    # A kept view grad is scaled into a lazy bucket's new buffer by a multiply (one
    # rounding apart from torch's in-place divide on 3 ranks: docs/arguments.md).
    ulps = rounding_ulps() if lazy else 0
    for step in range(steps):
        inputs, target = _batch(step)
        for model, opt in zip((ref, fast), opts):
            unwrap(model).step = step
            if ZERO[step % len(ZERO)] != "keep":
                opt.zero_grad(set_to_none=ZERO[step % len(ZERO)] == "none")
            F.mse_loss(model(inputs), target).backward()
        for opt in opts[:1] if overlap else opts:
            opt.step()
        expected = [] if static_graph and step == 0 else _unused_buckets(fast)
        agree(lambda: _same("skipped buckets", _skipped_now(fast), expected))
        agree(lambda: compare_grads(unwrap(ref), unwrap(fast), f"step {step}", ulps=ulps))
        agree(lambda: compare_state(unwrap(ref), unwrap(fast), f"after step {step}", ulps))
        if lazy:
            assert fast._reducer.held_bucket_bytes() == 0, fast._reducer.held_bucket_bytes()


def join_uneven_inputs(dynamic: bool) -> None:
    """Rank r has 3 + 2r batches, under join(). torch's joined ranks shadow every bucket, so
    with buckets skipped torch mismatches its collectives; fastddp's joined ranks take part
    in the vote and skip what the others skip. The result must be that of the same run
    without skipping: the skipped buckets' grads are those of parameters no rank used.
    With `sometimes` unused throughout, that run is torch's. With it used on odd steps it is
    fastddp's: torch's joined rank allreduces the used-parameter map it kept from its last
    step, which marks `sometimes` used in step 4 where no rank uses it (its grad becomes
    zeros instead of None, and SGD's momentum moves it; measured on 2 ranks)."""
    torch.manual_seed(0)
    base = Branches(dynamic=dynamic)
    reference = TorchDDP if not dynamic else fastddp.DistributedDataParallel
    results = []
    for wrap, skip in ((reference, False), (fastddp.DistributedDataParallel, True)):
        model = wrap(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=CAP_MB,
                     skip_all_reduce_unused_params=skip)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with model.join():
            for step in range(3 + 2 * dist.get_rank()):
                model.module.step = step
                opt.zero_grad()
                F.mse_loss(model(_batch(step)[0]), _batch(step)[1]).backward()
                opt.step()
        results.append(model.module)
    # On 3 ranks gloo's ring may add in another order than a lone run would (scenarios.ULPS,
    # the harness-wide bound); on 2 it is bit for bit.
    agree(lambda: compare_state(results[0], results[1], "after join"))


def powersgd_as_torch(unused_last: bool, steps: int = 5) -> list[int]:
    """torch's powerSGD_hook with a PowerSGDState (fastddp runs it natively; torch's side
    waits per bucket, see serialized_powerSGD_hook). It counts iterations on the last bucket
    only (GradBucket.is_last()): with that bucket skipped torch never leaves the warm-up's
    plain allreduce, and neither does fastddp. Returns both states' iteration counts."""
    from tests.python.hooks.powersgd_scenarios import serialized_powerSGD_hook
    from tests.python.hooks.powersgd_torch_state_scenarios import STATE, TOL
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    torch.manual_seed(0)
    base = Branches(unused_last)
    kwargs = dict(SKIP, find_unused_parameters=True)
    ref, fast = TorchDDP(copy.deepcopy(base), **kwargs), fastddp.DistributedDataParallel(
        copy.deepcopy(base), **kwargs)
    states = [psgd.PowerSGDState(None, **STATE) for _ in range(2)]
    ref.register_comm_hook(states[0], serialized_powerSGD_hook)
    fast.register_comm_hook(states[1], psgd.powerSGD_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, fast)]
    for step in range(steps):
        inputs, target = _batch(step)
        for model, opt in zip((ref, fast), opts):
            model.module.step = step
            opt.zero_grad()
            F.mse_loss(model(inputs), target).backward()

        def close(where: str, grads: bool) -> None:
            for (name, a), b in zip(ref.module.named_parameters(), fast.module.parameters()):
                a, b = (a.grad, b.grad) if grads else (a.detach(), b.detach())
                if a is None or b is None:
                    assert a is None and b is None, f"{where}: {name}: one grad is None"
                    continue
                # fastddp fuses the orthogonalization and the low-rank products, which
                # round differently in float32 from torch's separate ops (the bound and its
                # measurement: powersgd_torch_state_scenarios.TOL); the warm-up is exact.
                torch.testing.assert_close(b, a, rtol=TOL["rtol"],
                                           atol=TOL["atol"] * a.abs().max().item(),
                                           msg=f"{where}: {name}")
        agree(lambda: close(f"step {step}", grads=True))
        for opt in opts:
            opt.step()
        agree(lambda: close(f"after step {step}", grads=False))
    return [state.iter for state in states]


def hierarchical_drains(steps: int = 4) -> None:
    """fastddp.hooks.hierarchical(bf16) on 2 nodes x 2 local ranks (no torch counterpart)
    with the last bucket skipped: its pipeline, and its inner bf16 hook's, is drained rather
    than left waiting for is_last. The numbers are those of the same run without skipping:
    the used buckets are reduced by the same ops in the same order, and the skipped ones
    hold parameters no rank used, whose grads stay None either way."""
    torch.manual_seed(0)
    base = Branches(unused_last=True)
    models = []
    for skip in (False, True):
        model = fastddp.DistributedDataParallel(
            copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=CAP_MB,
            skip_all_reduce_unused_params=skip)
        model.register_comm_hook(None, fastddp.hooks.hierarchical(inter=fastddp.hooks.bf16(),
                                                                   local_size=2))
        models.append(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    for step in range(steps):
        inputs, target = _batch(step)
        for model, opt in zip(models, opts):
            model.module.step = step
            opt.zero_grad()
            F.mse_loss(model(inputs), target).backward()
        agree(lambda: compare_grads(models[0].module, models[1].module, f"step {step}", ulps=0))
        agree(lambda: _same("skipped", [b["index"] for b in models[1].comm_stats()["buckets"]
                                        if b["skipped"]], _unused_buckets(models[1])))
        for opt in opts:
            opt.step()
    agree(lambda: compare_state(models[0].module, models[1].module, "after training", ulps=0))
