"""The reduced gradients as .grad hands them out (issue 55), fastddp against torch DDP bit for
bit: values, None-ness, and what else a user can observe of .grad (strides, view-ness,
storage, identity across steps), under both values of gradient_as_bucket_view, on 2 and 3
gloo ranks (grad_handout_scenarios.py)."""

import pytest

from tests.python.ddp import grad_handout_scenarios as s

VIEW = pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
# One bucket (the default cap, for these small models), or one per parameter or two.
BUCKETS = pytest.mark.parametrize("bucket_cap_mb", [None, 0.0001], ids=["one_bucket", "tiny"])


@pytest.mark.parametrize(("set_to_none", "bucket_cap_mb"),
                         [(True, None), (True, 0.0001), (False, None)],
                         ids=["to_none-one_bucket", "to_none-tiny", "zeroed-one_bucket"])
@VIEW
def test_zero_grad_each_step(world, gradient_as_bucket_view, set_to_none, bucket_cap_mb):
    world.check(s.zero_grad_each_step, gradient_as_bucket_view=gradient_as_bucket_view,
                set_to_none=set_to_none, bucket_cap_mb=bucket_cap_mb)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["to_none", "zeroed"])
@VIEW
def test_no_sync_micro_batches(world, gradient_as_bucket_view, set_to_none):
    world.check(s.no_sync_micro_batches, gradient_as_bucket_view=gradient_as_bucket_view,
                set_to_none=set_to_none)


@pytest.mark.parametrize("how", ["all", "some", "strided"])
@VIEW
def test_own_grad_tensors(world, gradient_as_bucket_view, how):
    world.check(s.own_grad_tensors, gradient_as_bucket_view=gradient_as_bucket_view, how=how)


@pytest.mark.parametrize("how", ["assign_shape", "assign_dtype", "data_shape", "data_dtype"])
@VIEW
def test_grad_of_another_shape_or_dtype(world, gradient_as_bucket_view, how):
    outcomes = world.check(s.bad_grad, gradient_as_bucket_view=gradient_as_bucket_view, how=how)
    if how.startswith("assign"):
        # The .grad setter refuses it, under both, before any DDP code runs.
        for (t_kind, _), (f_kind, _) in outcomes:
            assert t_kind == f_kind == "RuntimeError", outcomes


@VIEW
def test_channels_last(world, gradient_as_bucket_view):
    world.check(s.channels_last, gradient_as_bucket_view=gradient_as_bucket_view)


@VIEW
def test_kept_references(world, gradient_as_bucket_view):
    world.check(s.kept_references, gradient_as_bucket_view=gradient_as_bucket_view)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "state_dict"])
@VIEW
def test_serialized_mid_training(world, gradient_as_bucket_view, how):
    world.check(s.serialized_mid_training, gradient_as_bucket_view=gradient_as_bucket_view,
                how=how)


@pytest.mark.parametrize("mode", ["find_unused_parameters", "static_graph"])
@VIEW
def test_unused_parameters(world, gradient_as_bucket_view, mode):
    world.check(s.unused_parameters, gradient_as_bucket_view=gradient_as_bucket_view, mode=mode)


@VIEW
def test_optimizer_in_backward(world, gradient_as_bucket_view):
    world.check(s.optimizer_in_backward, gradient_as_bucket_view=gradient_as_bucket_view)


@pytest.mark.parametrize("hook", list(s.HOOKS))
@VIEW
def test_compression_hook(world, gradient_as_bucket_view, hook):
    world.check(s.compression_hook, gradient_as_bucket_view=gradient_as_bucket_view, hook=hook,
                bucket_cap_mb=0.001)


@BUCKETS
@VIEW
def test_grad_properties(world, gradient_as_bucket_view, bucket_cap_mb):
    world.check(s.grad_properties, gradient_as_bucket_view=gradient_as_bucket_view,
                bucket_cap_mb=bucket_cap_mb)
