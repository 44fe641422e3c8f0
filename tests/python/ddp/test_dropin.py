"""Where fastddp used to differ silently from torch DDP: each case against torch DDP on the
same data (dropin_scenarios.py), on 2 and 3 gloo ranks unless it is about world size 1."""

import pytest

from tests.python.ddp import dropin_scenarios as s


def test_hook_result_read_through_strides(world):
    world.check(s.hook_returns_new_tensor)


def test_hook_runs_at_world_size_one(world1):
    (calls,) = world1.check(s.hook_at_world_size_one)
    assert calls["fastddp"] == calls["torch"] > 0


def test_world1_reducer_option(world1):
    (plan,) = world1.check(s.world1_reducer_requested)
    assert len(plan) > 1, plan  # several buckets: the whole bucket path ran


def test_powersgd_compresses_at_world_size_one(world1):
    world1.check(s.powersgd_at_world_size_one)


@pytest.mark.parametrize("mode", ["find_unused_parameters", "static_graph"])
def test_inplace_op_on_output(world, mode):
    world.check(s.inplace_on_output, find_unused_parameters=mode == "find_unused_parameters",
                static_graph=mode == "static_graph")


def test_hook_error_reaches_user_and_next_step_works(world):
    for message in world.check(s.raising_hook_then_recovery):
        assert "flaky hook failed on purpose" in message


def test_comm_stats_from_another_thread(world):
    results = world.run(s.comm_stats_reader_thread, timeout_s=90)
    assert all(r.ok and r.value > 0 for r in results), [(r.error, r.traceback) for r in results]


@pytest.mark.parametrize("hook", ["default", "python"])
@pytest.mark.parametrize("find_unused_parameters", [False, True])
def test_sparse_gradients(world, hook, find_unused_parameters):
    world.check(s.sparse_gradients, hook=hook, find_unused_parameters=find_unused_parameters)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_serialized_model_trains_as_torch(world, how):
    world.check(s.serialized, how=how)


def test_deepcopy_keeps_hook(world):
    world.check(s.serialized_with_hook)


def test_pickle_needs_default_group(world):
    for message in world.check(s.pickle_with_subgroup):
        assert "only supported when using DDP with the default process group" in message


def test_create_graph(world):
    for warned in world.check(s.create_graph):
        assert warned and "create_graph=True" in warned[0]


def test_logging_data_for_a_direct_group(world):
    assert world.check(s.logging_data_any_group) == [[r, r] for r in range(world.size)]


def test_error_logged_as_torch(world):
    pytest.importorskip("expecttest", reason="torch's common_distributed imports expecttest")
    world.check(s.error_logged)


def test_static_graph_without_outputs(world):
    world.check(s.static_graph_without_outputs)

