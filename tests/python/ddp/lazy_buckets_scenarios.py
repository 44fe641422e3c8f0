"""torch DDP 2.15's lazy_bucket_allocation=True, fastddp against torch DDP on the same
data. Run on every rank of a harness world (see harness.py).

The local torch (2.14) has no such argument: torch DDP runs with its buckets allocated at
construction. torch 2.15 documents (and, run on these models, gives) the same numbers with
lazy buckets, so fastddp's lazy grads and parameters must equal torch's eager ones, bit
for bit where the same operations run in the same order. What lazy changes is memory: the
reducer holds no bucket storage between backward passes (``held_bucket_bytes()``), and
nothing else keeps a released buffer alive: under gradient_as_bucket_view the grads do,
until they are set to None, as in torch 2.15.
"""

import copy
import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.ddp.contract_scenarios import Branchy
from tests.python.ddp.mixed_precision_scenarios import DTYPES, config
from tests.python.scenarios import (agree, compare_grads, compare_state, mlp, rounding_ulps, train,
                                    unwrap, vector_batch, with_batchnorm)

CAP_MB = 0.001  # about 1 KiB: mlp() gets several buckets after the rebuild


def pair(build, **ddp_kwargs) -> tuple[TorchDDP, fastddp.DistributedDataParallel]:
    """torch DDP (eager buckets) and fastddp with lazy buckets, from one seed."""
    torch.manual_seed(0)
    base = build()
    return (TorchDDP(copy.deepcopy(base), **ddp_kwargs),
            fastddp.DistributedDataParallel(copy.deepcopy(base), lazy_bucket_allocation=True,
                                            **ddp_kwargs))


def held(fast: fastddp.DistributedDataParallel) -> int:
    return fast._reducer.held_bucket_bytes()


def expect_nothing_held(fast: fastddp.DistributedDataParallel, where: str) -> None:
    assert held(fast) == 0, f"{where}: the reducer holds {held(fast)} bytes of bucket storage"


def _storages(model) -> set[int]:
    return {p.grad.untyped_storage().data_ptr() for p in unwrap(model).parameters()
            if p.grad is not None}


def training(gradient_as_bucket_view: bool, set_to_none: bool, hook: str = "none") -> None:
    """mlp() on ~1 KiB buckets: grads after every backward and parameters after every
    step against torch DDP's; no bucket bytes held after any backward; under
    gradient_as_bucket_view all grads in one buffer (Note [aligned flat buffer]), a new one
    each backward while the old one is still alive (set_to_none=False), as torch 2.15."""
    ref, fast = pair(mlp, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=gradient_as_bucket_view)
    # bf16: torch's bf16_compress_hook rounds and sums the same halves in the same order
    # on any number of ranks (hooks/test_hooks.py EXACT_PAIRS), so bit for bit; without a
    # hook rounding_ulps(): 0 on 2 ranks, gloo's summation order on 3 (scenarios.ULPS).
    ulps = rounding_ulps()
    if hook == "bf16":
        ref.register_comm_hook(None, dh.bf16_compress_hook)
        fast.register_comm_hook(None, fastddp.hooks.bf16())
        ulps = 0
    expect_nothing_held(fast, "after construction")
    last: list[set[int]] = []

    def check(step: int) -> None:
        expect_nothing_held(fast, f"after backward {step}")
        if not gradient_as_bucket_view:
            return
        storages = _storages(fast)
        assert len(storages) == 1, f"step {step}: grads in {len(storages)} storages"
        if last and not set_to_none:
            assert storages != last[-1], f"step {step}: the old buffer was written again"
        last.append(storages)

    train(ref, fast, set_to_none=set_to_none, after_backward=check, ulps=ulps)
    agree(lambda: _expect(len(fast.bucket_plan()) > 1, f"buckets {fast.bucket_plan()}"))


def low_rank_as_eager(hook: str) -> None:
    """PowerSGD and ACP-SGD on lazy buckets against the same hook on eager ones, bit for
    bit (the same ops in the same order, other addresses): the views a low-rank hook keeps
    across steps (PowerSGDWorkCache) must follow the bucket's buffer, new every backward."""
    make = {"powersgd": lambda: fastddp.hooks.powersgd(start_powerSGD_iter=2),
            "acpsgd": lambda: fastddp.hooks.acpsgd(start_iter=2)}[hook]
    torch.manual_seed(0)
    base = mlp()
    eager, lazy = (fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB,
                                                   lazy_bucket_allocation=is_lazy)
                   for is_lazy in (False, True))
    for model in (eager, lazy):
        model.register_comm_hook(None, make())
    train(eager, lazy, ulps=0, after_backward=lambda step: expect_nothing_held(lazy, str(step)))


def no_sync(gradient_as_bucket_view: bool, set_to_none: bool) -> None:
    """Accumulation under no_sync() (local grads, compared before any synchronized
    backward; no bucket allocated for them), then a synchronized one. mlp(), not a model
    with a bias before BatchNorm, whose gradient is rounding noise: under
    gradient_as_bucket_view with grads kept (set_to_none=False) the lazy reducer copies
    them into a new buffer, scaled by fl(1/w) as torch's copy path (torch 2.15's lazy
    buckets too), where torch 2.14 divides its bucket in place: one rounding apart on 3
    ranks, within rounding_ulps() of each gradient's largest element, not of noise."""
    ref, fast = pair(mlp, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=gradient_as_bucket_view)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fast)]
    for step in range(4):
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad(set_to_none=set_to_none)
            with model.no_sync():
                for k in range(2):
                    F.mse_loss(*_forward(model, vector_batch(10 * step + k))).backward()
        # Local sums so far, from parameters within rounding_ulps() of torch's.
        agree(lambda: compare_grads(ref.module, fast.module, f"step {step} no_sync"))
        agree(lambda: expect_nothing_held(fast, f"step {step} after no_sync"))
        for model in (ref, fast):
            F.mse_loss(*_forward(model, vector_batch(10 * step + 2))).backward()
        agree(lambda: compare_grads(ref.module, fast.module, f"step {step} synced"))
        agree(lambda: expect_nothing_held(fast, f"step {step} synced"))
        for opt in opts:
            opt.step()
        agree(lambda: compare_state(ref.module, fast.module, f"after step {step}"))


def unused_parameters(gradient_as_bucket_view: bool) -> None:
    """find_unused_parameters: unused slots of the fresh buffer are zeros; a parameter
    unused on every rank keeps grad None, one used on rank 0 only gets the average."""
    ref, fast = pair(Branchy, find_unused_parameters=True, bucket_cap_mb=CAP_MB,
                     gradient_as_bucket_view=gradient_as_bucket_view)
    modules = (ref.module, fast.module)
    for m in modules:
        m.step = 0

    def advance(step: int) -> None:
        expect_nothing_held(fast, f"after backward {step}")
        for m in modules:
            m.step = step + 1

    train(ref, fast, steps=5, set_to_none=False, after_backward=advance)
    assert fast.module.never.weight.grad is None
    assert fast.module.one_rank.weight.grad is not None


def static_graph() -> None:
    """static_graph=True: the first iteration's delayed reduction allocates too."""
    ref, fast = pair(mlp, bucket_cap_mb=CAP_MB, static_graph=True)
    train(ref, fast, steps=4, after_backward=lambda s: expect_nothing_held(fast, f"step {s}"))


def uneven_inputs() -> None:
    """join(): a rank out of data shadows the collectives with zero buckets of its own,
    which it releases too. Rank r has 2 + 2r batches."""
    torch.manual_seed(0)
    base = with_batchnorm()
    results = []
    for lazy in (None, True):
        kwargs = {"lazy_bucket_allocation": True} if lazy else {}
        wrap = fastddp.DistributedDataParallel if lazy else TorchDDP
        model = wrap(copy.deepcopy(base), bucket_cap_mb=CAP_MB, **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with model.join():
            for step in range(2 + 2 * dist.get_rank()):
                opt.zero_grad()
                F.mse_loss(*_forward(model, vector_batch(step))).backward()
                opt.step()
        results.append(model)
    agree(lambda: compare_state(results[0].module, results[1].module, "after join"))
    agree(lambda: expect_nothing_held(results[1], "after join"))


def _average_hook(refs: list):
    """A Python hook that keeps a weak reference to each bucket's storage. It reduces a
    copy, synchronously: gloo's worker threads drop a collective's tensors some time after
    completing its future, so a buffer handed to gloo may outlive the step for a moment
    (which is why the default allreduce, and the hierarchical hook that hands gloo the flat
    buffer itself, are not followed here)."""

    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        assert buffer.device.type != "meta", "GradBucket.buffer() has no memory"
        refs.append(StorageWeakRef(buffer.untyped_storage()))
        total = buffer / dist.get_world_size()
        dist.all_reduce(total)
        buffer.copy_(total)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    return hook


def released(gradient_as_bucket_view: bool, hook: str) -> None:
    """Nothing keeps a released bucket buffer alive (the reducer, the hook's state, its
    futures, GradBucket.buffer()): without gradient_as_bucket_view it goes when backward
    returns, with it once the grads are set to None (the next step's zero_grad; each
    step's buffers are checked after the next backward). Hooks whose collectives never see
    the bucket's buffer (see _average_hook). Not the low-rank hooks either: they hand gloo
    the buffer before their start, and after it decompress into the bucket in a completion
    callback on gloo's thread, whose captures go a moment after the future completes
    (low_rank_as_eager checks their numbers on lazy buckets)."""
    torch.manual_seed(0)
    fast = fastddp.DistributedDataParallel(mlp(), bucket_cap_mb=CAP_MB, lazy_bucket_allocation=True,
                                           gradient_as_bucket_view=gradient_as_bucket_view)
    refs: list[StorageWeakRef] = []
    if hook == "python":
        fast.register_comm_hook(None, _average_hook(refs))
    else:
        fast.register_comm_hook(None, getattr(fastddp.hooks, hook)())
    previous: list[StorageWeakRef] = []
    for step in range(4):
        fast.zero_grad(set_to_none=True)
        F.mse_loss(*_forward(fast, vector_batch(step))).backward()
        alive = sum(not r.expired() for r in previous)
        assert alive == 0, f"step {step - 1}: {alive} of {len(previous)} bucket buffers alive"
        expect_nothing_held(fast, f"step {step}")
        if gradient_as_bucket_view:
            grads = [StorageWeakRef(p.grad.untyped_storage()) for p in fast.parameters()]
            assert not any(r.expired() for r in grads), "the grads lost their buffer"
            refs.extend(grads)
        assert refs, "no buffer to follow"
        previous, refs[:] = list(refs), []


def layout_and_reports() -> dict:
    """The eager reducer holds the whole layout, the lazy one nothing; both report the
    same bucket sizes (bucket_bytes, comm_stats, torch's logging data), and a deep copy
    (pickling) stays lazy."""
    torch.manual_seed(0)
    base = mlp()
    models = [fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB,
                                              lazy_bucket_allocation=lazy) for lazy in (False, True)]
    out = {}
    for step in range(2):  # the second step runs on the rebuilt buckets
        for model in models:
            model.zero_grad()
            F.mse_loss(*_forward(model, vector_batch(step))).backward()
        eager, lazy = models
        assert eager._reducer.bucket_bytes() == lazy._reducer.bucket_bytes()
        assert held(eager) == sum(eager._reducer.bucket_bytes()) > 0, held(eager)
        expect_nothing_held(lazy, f"step {step}")
    stats = [m.comm_stats() for m in models]
    sizes = [[b["bytes"] for b in st["buckets"]] for st in stats]
    assert sizes[0] == sizes[1] and len(sizes[0]) > 1, stats
    logs = [m._get_ddp_logging_data() for m in models]
    assert logs[0]["bucket_sizes"] == logs[1]["bucket_sizes"], logs
    clone = copy.deepcopy(models[1])
    assert clone.lazy_bucket_allocation and held(clone) == 0
    out["sizes"] = logs[1]["bucket_sizes"]
    return out


class _HeldProbe(torch.autograd.Function):
    """Identity on the input; its backward, after every parameter's gradient reached the
    reducer and before the end of backward releases the buffers, reads what it holds."""

    @staticmethod
    def forward(ctx, x, model, seen):
        ctx.model, ctx.seen = model, seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(held(ctx.model))
        return grad, None, None


def mixed_precision(param: str, reduce: str | None) -> None:
    """mixed_precision's buckets are in reduce_dtype (Note [mixed precision]): the lazy
    buffers too, allocated during backward as many bytes as the eager reducer holds
    throughout (twice bf16's for an fp32 reduction), none between backward passes, and
    the same grads and parameters as eager buckets, bit for bit (the same ops)."""
    mp = config(param, reduce, None)
    reduce_dtype = DTYPES[reduce] or DTYPES[param]
    torch.manual_seed(0)
    base = mlp()
    eager, lazy = (fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_MB,
                                                   mixed_precision=mp,
                                                   lazy_bucket_allocation=is_lazy)
                   for is_lazy in (False, True))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, lazy)]
    layout = sum(p.numel() for p in base.parameters()) * reduce_dtype.itemsize
    for step in range(3):
        seen: list[int] = []
        for model, opt in zip((eager, lazy), opts):
            opt.zero_grad(set_to_none=step % 2 == 0)
            inputs, target = vector_batch(step)
            out = model(_HeldProbe.apply(inputs.requires_grad_(), model, seen))
            F.mse_loss(out.float(), target).backward()
        assert seen[0] == seen[1] == held(eager) >= layout, (seen, held(eager), layout)
        expect_nothing_held(lazy, f"step {step}")
        agree(lambda: compare_grads(eager.module, lazy.module, f"step {step}", ulps=0))
        for opt in opts:
            opt.step()
        agree(lambda: compare_state(eager.module, lazy.module, f"after step {step}", ulps=0))


def _forward(model, batch):
    inputs, target = batch
    return model(inputs), target


def _expect(condition: bool, message: str) -> None:
    assert condition, message


# --- GPU: torch.cuda.memory_allocated against torch DDP ------------------------------

def cuda_memory(gradient_as_bucket_view: bool) -> dict:
    """Steady (between steps, grads set to None) and peak memory of torch DDP (eager
    buckets), fastddp eager and fastddp lazy on the current GPU, 4 x Linear(1024, 1024)."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    out = {}
    for name in ("torch", "eager", "lazy"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        start = torch.cuda.memory_allocated()
        kwargs = {"device_ids": [torch.cuda.current_device()],
                  "gradient_as_bucket_view": gradient_as_bucket_view}
        if name == "torch":
            model = TorchDDP(copy.deepcopy(base), **kwargs)
        else:
            model = fastddp.DistributedDataParallel(
                copy.deepcopy(base), lazy_bucket_allocation=name == "lazy", **kwargs)
        x = torch.randn(64, 1024, device="cuda")
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats()
            model(x).square().mean().backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - start
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        out[name] = {"steady": torch.cuda.memory_allocated() - start, "peak": peak}
        if name != "torch":
            out[name]["held"] = model._reducer.held_bucket_bytes()
        del model, x
        gc.collect()  # the next model's baseline must not include this one
    return out
