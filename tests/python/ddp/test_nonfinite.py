"""check_for_nan_in_grad: a NaN or Inf gradient on any rank raises on every rank, naming
the parameter, the rank and the step, and the next step trains as torch DDP does."""

import math

import pytest

import fastddp
from tests.python.ddp import nonfinite_scenarios

STATELESS = ["allreduce", "bf16", "python"]


@pytest.mark.parametrize("hook", STATELESS)
def test_nan_on_one_rank_raises_everywhere(world, hook):
    messages = world.check(nonfinite_scenarios.nan_then_train, hook=hook, bad_ranks=[1])
    for message in messages:
        assert "non-finite gradient (NaN or Inf) in parameter '2.weight' on rank 1 at step 2" in (
            message), message
        assert "rank 0" not in message, message


def test_inf_on_two_ranks_names_both(world):
    messages = world.check(nonfinite_scenarios.nan_then_train, hook="allreduce",
                           bad_ranks=[0, 1], value=-math.inf)
    for message in messages:
        assert "'2.weight' on rank 0 at step 2; in parameter '2.weight' on rank 1 at step 2" in (
            message), message


def test_gradient_as_bucket_view(world):
    messages = world.check(nonfinite_scenarios.nan_then_train, hook="allreduce", bad_ranks=[0],
                           gradient_as_bucket_view=True)
    assert all("on rank 0 at step 2" in m and "gradient_as_bucket_view" in m for m in messages)


@pytest.mark.parametrize("hook", ["bf16-fp32acc-ef", "powersgd"])
def test_stateful_hooks_drop_the_poisoned_state(world, hook):
    """Error feedback and PowerSGD's memories took this step's NaN in: they are dropped,
    so the next steps are finite and equal on every rank (compared within the scenario)."""
    messages = world.check(nonfinite_scenarios.nan_then_finite, hook=hook, bad_ranks=[1])
    assert all("on rank 1 at step 4" in m for m in messages), messages


@pytest.mark.parametrize("hook", STATELESS + ["bf16-fp32acc-ef", "powersgd"])
def test_finite_gradients_are_unchanged_by_the_check(world, hook):
    world.check(nonfinite_scenarios.clean_run_is_unchanged, hook=hook)


def test_world_size_one_checks_too(world1):
    messages = world1.check(nonfinite_scenarios.nan_then_train, hook="allreduce", bad_ranks=[0])
    assert "on rank 0 at step 2" in messages[0], messages


def test_patch_passes_the_check_on():
    with fastddp.patch(check_for_nan_in_grad=True, disable=False) as handle:
        assert "check_for_nan_in_grad" in handle.describe()
        assert handle.check_for_nan_in_grad
