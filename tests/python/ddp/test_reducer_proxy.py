"""``DistributedDataParallel.reducer``: the calls Lightning's manual optimization and
Accelerate's trigger_sync_in_backward make on torch's reducer, on real gloo ranks, against
torch DDP (scenarios in reducer_proxy_scenarios.py)."""

import pytest

from tests.python.ddp import reducer_proxy_scenarios as scenarios


@pytest.mark.parametrize("find_unused_parameters", [False, True], ids=["all_used", "find_unused"])
def test_lightning_manual_optimization(world, find_unused_parameters):
    world.check(scenarios.manual_step_in_forward, find_unused_parameters=find_unused_parameters)


def test_lightning_manual_optimization_static_graph(world):
    world.check(scenarios.manual_step_in_forward, find_unused_parameters=False,
                static_graph=True)


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
def test_accelerate_trigger_sync_in_backward(world, gradient_as_bucket_view):
    world.check(scenarios.trigger_sync_in_backward, gradient_as_bucket_view=gradient_as_bucket_view)


def test_rebuild_buckets_returns_as_torch(world):
    world.check(scenarios.rebuild_buckets_call)


def test_unsupported_calls_raise(world):
    world.check(scenarios.unsupported_calls)


def test_copies_answer_for_themselves(world):
    world.check(scenarios.copies_answer_for_themselves)


def test_world_size_one(world1):
    world1.check(scenarios.world_size_one)
