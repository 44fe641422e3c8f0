"""torch 2.15's lazy_bucket_allocation=True against torch DDP (lazy_buckets_scenarios.py):
the same grads and parameters on 2 and 3 gloo ranks, for both gradient_as_bucket_view
values, both zero_grad modes, with and without a comm hook, under no_sync, unused
parameters, static_graph, join() and mixed_precision; no bucket storage held by the reducer (or kept alive
by anything else) between backward passes; the full layout held without it."""

import pytest

from tests.python.ddp import lazy_buckets_scenarios as s
from tests.python.harness import World


@pytest.mark.parametrize("hook", ["none", "bf16"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zeros"])
@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
def test_lazy_training_matches_torch(world, gradient_as_bucket_view, set_to_none, hook):
    world.check(s.training, gradient_as_bucket_view=gradient_as_bucket_view,
                set_to_none=set_to_none, hook=hook)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zeros"])
@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
def test_lazy_no_sync_accumulation(world, gradient_as_bucket_view, set_to_none):
    world.check(s.no_sync, gradient_as_bucket_view=gradient_as_bucket_view,
                set_to_none=set_to_none)


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
def test_lazy_unused_parameters(world, gradient_as_bucket_view):
    world.check(s.unused_parameters, gradient_as_bucket_view=gradient_as_bucket_view)


def test_lazy_static_graph(world):
    world.check(s.static_graph)


def test_lazy_join_uneven_inputs(world):
    world.check(s.uneven_inputs)


@pytest.mark.parametrize(("gradient_as_bucket_view", "hook"), [
    (False, "python"), (True, "python"), (True, "bf16"), (True, "int8")])
def test_released_buffers_are_freed(world, gradient_as_bucket_view, hook):
    world.check(s.released, gradient_as_bucket_view=gradient_as_bucket_view, hook=hook)


@pytest.mark.parametrize("hook", ["powersgd", "acpsgd"])
def test_low_rank_hooks_as_on_eager_buckets(world, hook):
    world.check(s.low_rank_as_eager, hook=hook)


@pytest.mark.parametrize(("param", "reduce"), [("bf16", "fp32"), ("fp16", None)])
def test_lazy_mixed_precision_buckets_in_reduce_dtype(world, param, reduce):
    world.check(s.mixed_precision, param=param, reduce=reduce)


def test_lazy_holds_nothing_eager_holds_layout(world):
    sizes = [out["sizes"] for out in world.check(s.layout_and_reports)]
    assert len(set(sizes)) == 1, sizes


@pytest.mark.gpu
@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
def test_lazy_cuda_memory_against_torch(gradient_as_bucket_view):
    # gloo reduces CUDA tensors through host memory: two ranks on one GPU, each process
    # with its own caching allocator, so memory_allocated() is that rank's alone.
    world = World(2, backend="gloo")
    try:
        results = world.check(s.cuda_memory, gradient_as_bucket_view=gradient_as_bucket_view)
    finally:
        world.close()
    layout = 4 * (1024 * 1024 + 1024) * 4  # the parameters' bytes: one bucket layout
    for out in results:
        torch_, eager, lazy = out["torch"], out["eager"], out["lazy"]
        assert lazy["held"] == 0 and eager["held"] >= layout, out
        # Between steps torch DDP holds its buckets (the layout) and lazy fastddp nothing:
        # exact sizes, the allocator only rounds torch's side up.
        assert torch_["steady"] - lazy["steady"] >= layout, out
        assert eager["steady"] - lazy["steady"] >= layout, out
        # Lazy allocates during backward what the others hold throughout; 1 MiB (6% of the
        # layout) covers the write-back paths' transient allocations, which differ.
        assert lazy["peak"] <= min(torch_["peak"], eager["peak"]) + 2**20, out
