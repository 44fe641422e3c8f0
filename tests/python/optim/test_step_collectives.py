"""The sharded step's collectives get no Python tensor (step_collectives_scenarios.py), on 2
and 3 gloo ranks."""

from tests.python.optim import step_collectives_scenarios as s


# Note [no Python tensor in a Work] (csrc/hooks/common/collectives.h): a sharded step hands
# its collectives aliases made in C++, never a tensor Python holds nor a view of one (its
# base), so that no backend thread releases a Python object at the interpreter's exit.
# Fails with the all-gather's shard views made in Python (checked: 'broadcast' listed).
def test_the_step_hands_no_python_tensor_to_the_group(world):
    for r in world.check(s.step_hands_no_python_tensor_to_the_group):
        assert {"allreduce", "broadcast", "all_to_all_single"} <= set(r["collectives"]), r
        assert r["python_held"] == [], r
