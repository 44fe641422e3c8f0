"""fastddp trains to torch DDP's numbers, step by step, on real gloo ranks.

The comparisons themselves run inside the ranks (scenarios.py); a failure names the
rank, the step and the tensor.
"""

import pytest

from tests.python import scenarios


@pytest.mark.parametrize("ddp_kwargs", [{}, {"broadcast_buffers": False}],
                         ids=["default", "nobcast"])
def test_mlp(world, ddp_kwargs):
    world.check(scenarios.train_mlp, **ddp_kwargs)


def test_tiny_buckets(world):
    plans = world.check(scenarios.tiny_buckets)
    assert len(plans[0]) > 3 and all(plan == plans[0] for plan in plans)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads_to_none", "grads_zeroed"])
def test_gradient_as_bucket_view(world, set_to_none):
    world.check(scenarios.bucket_view, set_to_none=set_to_none)


@pytest.mark.parametrize(("gradient_as_bucket_view", "set_to_none"),
                         [(False, True), (True, True), (True, False)],
                         ids=["copy", "view", "view_zeroed"])
def test_no_sync_accumulation(world, gradient_as_bucket_view, set_to_none):
    world.check(scenarios.no_sync_accumulation, micro_batches=3, set_to_none=set_to_none,
                bucket_cap_mb=0.001, gradient_as_bucket_view=gradient_as_bucket_view)


def test_tied_weights(world):
    world.check(scenarios.tied_weights)


@pytest.mark.parametrize("broadcast_buffers", [True, False], ids=["bcast", "nobcast"])
def test_batchnorm_buffers(world, broadcast_buffers):
    world.check(scenarios.batchnorm_buffers, broadcast_buffers=broadcast_buffers)


def test_frozen_parameters(world):
    world.check(scenarios.frozen_parameters)


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
def test_channels_last(world, gradient_as_bucket_view):
    world.check(scenarios.channels_last, gradient_as_bucket_view=gradient_as_bucket_view)


@pytest.mark.parametrize("bucket_cap_mb", [None, 0.0001], ids=["default", "tiny"])
def test_mixed_dtypes(world, bucket_cap_mb):
    world.check(scenarios.mixed_dtypes, bucket_cap_mb=bucket_cap_mb)


@pytest.mark.parametrize("model", ["out_of_order", "rank_dependent"])
def test_bucket_rebuild(world, model):
    plans = world.check(scenarios.bucket_rebuild, model=model)
    assert all(plan == plans[0] for plan in plans), plans


def test_identity(world):
    keys = world.check(scenarios.identity)
    assert "module.0.mix.weight" in keys[0] and "module.1.running_mean" in keys[0]


def test_world_size_one(world1):
    world1.check(scenarios.world_size_one)
