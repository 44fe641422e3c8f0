"""A process group written in Python over 2 and 3 ranks, never registered with c10d, whose
collectives need their options and whose Works need wait's timeout: it carries
construction's checks, the skip votes and join (python_process_group_world_scenarios.py), as
under torch DDP and to torch DDP's numbers. On 1 and 2 ranks, a group as torch's
test_c10d_pypg.py writes one: test_python_process_group.py."""

import pytest

from tests.python.ddp import python_process_group_world_scenarios as w


def _fastddp_waited_as_torch(seen: dict) -> None:
    """Every Work fastddp waited on got a timeout, as torch's C++ passes one (kNoTimeout,
    0:00:00), and its futures were read."""
    fast = seen["fastddp"]
    assert fast["timedelta"] and fast["timeouts"] == ["0:00:00"], seen
    assert fast["futures"] > 0, seen


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
def test_construction_and_training_through_a_python_group(world, gradient_as_bucket_view):
    """Construction's shape and bucket checks (allgathers) and the parameters' broadcast go
    through the group object; fastddp trains as torch DDP over the same kind of group."""
    for seen in world.check(w.construction_and_training,
                            gradient_as_bucket_view=gradient_as_bucket_view):
        _fastddp_waited_as_torch(seen)
        assert seen["fastddp"]["calls"]["allgather"] == 4, seen  # 2 checks x (lengths, data)
        assert seen["fastddp"]["calls"]["broadcast"] >= 1, seen
        assert seen["torch"]["calls"]["broadcast"] >= 1, seen


def test_construction_check_raises_through_a_python_group(world):
    for message in world.expect_error(w.shapes_differ, ValueError):
        assert "rank 1" in message and "0.weight" in message, message


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
def test_skip_votes_through_a_python_group(world, gradient_as_bucket_view):
    """find_unused_parameters and skip_all_reduce_unused_params: the used-parameter map and
    fastddp's vote on the skips are int32 allreduces on the group, as torch's map is."""
    for seen in world.check(w.skip_votes, gradient_as_bucket_view=gradient_as_bucket_view):
        _fastddp_waited_as_torch(seen)
        int_sums = {k: n for k, n in seen["fastddp"]["calls"].items() if "int32" in k}
        assert int_sums and all("SUM" in k for k in int_sums), seen
        assert any("int32" in k for k in seen["torch"]["calls"]), seen


@pytest.mark.parametrize("find_unused_parameters", [False, True])
def test_join_through_a_registered_python_group(world, find_unused_parameters):
    """Join with uneven inputs: the joined ranks' shadow collectives and the MAX allreduces
    that pick the source rank go through the group, as torch DDP's do; every Work fastddp
    waits on gets a timeout (torch's Join itself waits without one)."""
    for seen in world.check(w.join_uneven, find_unused_parameters=find_unused_parameters):
        for name in ("torch", "fastddp"):
            assert any("MAX" in k for k in seen[name]["calls"]), seen
        assert seen["fastddp"]["untimed_in_fastddp"] == 0, seen
        assert "0:00:00" in seen["fastddp"]["timeouts"], seen


def test_global_ranks_of_a_python_group(world):
    """The ranks a hierarchical hook splits into node groups: gathered through a group c10d
    does not know (one allgather on it), read from c10d for one it knows."""
    ranks = list(range(world.size))
    for out in world.check(w.global_ranks):
        assert out["strict"] == out["hierarchical"] == out["registered"] == ranks, out
        assert out["strict_calls"] == {"allgather": 2} and out["registered_calls"] == {}, out


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
def test_bare_module_backward_after_the_models(world, gradient_as_bucket_view):
    world.check(w.bare_module_backward_after_ddp, gradient_as_bucket_view=gradient_as_bucket_view)
