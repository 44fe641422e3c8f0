"""delay_all_reduce_named_params / param_to_hook_all_reduce against torch DDP
(delayed_allreduce_scenarios.py): the same grads and parameters on 2 and 3 gloo ranks, torch's
errors for half the arguments, fastddp's for what it refuses."""

from tests.python.ddp import delayed_allreduce_scenarios as s


def test_delayed_parameters_train_as_torch(world):
    world.check(s.delayed_training)


def test_delayed_argument_errors(world):
    for out in world.check(s.delayed_errors):
        assert out["fastddp"] == out["torch"], out
