"""skip_all_reduce_unused_params against torch DDP (skip_unused_scenarios.py), on 2 and 3
gloo ranks: the same grads and parameters, with and without gradient_as_bucket_view and
comm hooks (torch's PowerSGD included), under static_graph; the same num_buckets_reduced and
the same buckets handed to a hook; gradient allreduces counted on the wire; where torch
would mismatch its collectives (ranks that disagree, join()), the result of torch DDP
without skipping; with the overlapped optimizer and lazy buckets, torch's plain step; and a
pipelined hook drained when the last bucket is skipped (hierarchical, 4 ranks)."""

import pytest

from tests.python.ddp import skip_unused_scenarios as s

# Branches with CAP_MB: one bucket per parameter, 8 in all (trunk, sometimes, never, head:
# weight and bias each). never's two are skipped every step, sometimes' two on even steps.
BUCKETS = 8
SKIPPED = {0: 4, 1: 2}  # by step parity


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
@pytest.mark.parametrize("hook", [None, "allreduce", "fp16", "python"])
def test_trains_as_torch(world, hook, gradient_as_bucket_view):
    for out in world.check(s.trains_as_torch, hook=hook,
                           gradient_as_bucket_view=gradient_as_bucket_view):
        assert out["buckets"] == BUCKETS, out
        assert [len(b) for b in out["skipped"]] == [SKIPPED[i % 2] for i in range(6)], out
        # Logged at the next forward, as torch: the previous backward's count.
        assert out["logged"] == [None] + [BUCKETS - SKIPPED[i % 2] for i in range(5)], out
        assert out["never_grad"], out


@pytest.mark.parametrize("hook", [None, "fp16", "python"])
def test_last_bucket_skipped(world, hook):
    """The skipped bucket is the last one: no hook sees is_last() (torch's GradBucket says
    so of the real last bucket only), and fp16's pipelined hook is drained instead."""
    for out in world.check(s.trains_as_torch, hook=hook, gradient_as_bucket_view=False,
                           unused_last=True):
        assert all(BUCKETS - 1 in b for b in out["skipped"]), out


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
def test_static_graph(world, gradient_as_bucket_view):
    for out in world.check(s.trains_as_torch, hook="python", static_graph=True,
                           gradient_as_bucket_view=gradient_as_bucket_view):
        # Iteration 1 reduces everything (and torch counts it as 0), iteration 2 the one
        # bucket before the rebuild; then never's and sometimes' four buckets are skipped.
        assert [len(b) for b in out["skipped"]] == [0, 0, 4, 4, 4, 4], out
        assert out["logged"] == [None, 0, 1, BUCKETS - 4, BUCKETS - 4, BUCKETS - 4], out


def test_gradient_allreduces_on_the_wire(world):
    for counts in world.check(s.wire_collectives):
        assert counts["fastddp"] == counts["torch"] == [BUCKETS - SKIPPED[i % 2]
                                                         for i in range(4)], counts


def test_without_unused_search_nothing_is_skipped(world):
    for out in world.check(s.without_unused_search):
        # The first backward reduces the one initial bucket; the rebuilt buckets follow.
        assert out["logged"] == [None, 1, out["buckets"]] and out["buckets"] > 1, out


@pytest.mark.parametrize("hook", [None, "fp16", "python"])
def test_ranks_that_disagree_reduce_the_disputed_buckets(world, hook):
    for out in world.check(s.ranks_disagree, hook=hook):
        assert out["buckets"] == BUCKETS + 2, out  # rank0's weight and bias
        assert [len(b) for b in out["skipped"]] == [SKIPPED[i % 2] for i in range(4)], out


@pytest.mark.parametrize("overlap,lazy,view,static", [
    (True, False, False, False), (True, False, True, False), (False, True, True, False),
    (True, True, True, False), (True, True, True, True)],
    ids=["overlap", "overlap-view", "lazy-view", "overlap-lazy-view", "overlap-lazy-static"])
def test_overlapped_optimizer_and_lazy_buckets(world, overlap, lazy, view, static):
    world.check(s.with_overlap_and_lazy, overlap=overlap, lazy=lazy,
                gradient_as_bucket_view=view, static_graph=static)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static-unused", "dynamic-unused"])
def test_join_uneven_inputs(world, dynamic):
    world.check(s.join_uneven_inputs, dynamic=dynamic)


@pytest.mark.parametrize("unused_last", [False, True], ids=["last-used", "last-skipped"])
def test_powersgd_state_as_torch(world, unused_last):
    for iters in world.check(s.powersgd_as_torch, unused_last=unused_last):
        # Counted on the last bucket only: never, when that one is skipped (torch's hook).
        assert iters == ([0, 0] if unused_last else [5, 5]), iters


def test_hierarchical_hook_is_drained(world4):
    world4.check(s.hierarchical_drains)
