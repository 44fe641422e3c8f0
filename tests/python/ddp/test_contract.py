"""static_graph, find_unused_parameters, join(), low-precision modules and the logging
data: fastddp against torch DDP on the same data, on 2 and 3 gloo ranks."""

import pytest

from tests.python.ddp import contract_scenarios as cs


@pytest.mark.parametrize("model", ["mlp", "tied", "checkpointed"])
def test_static_graph(world, model):
    world.check(cs.static_graph, model=model, set_later=False)


def test_set_static_graph_after_construction(world):
    world.check(cs.static_graph, model="checkpointed", set_later=True)


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
def test_find_unused_parameters(world, gradient_as_bucket_view):
    world.check(cs.unused_parameters, gradient_as_bucket_view=gradient_as_bucket_view)


def test_outputs_not_in_loss(world):
    world.check(cs.outputs_not_in_loss)


@pytest.mark.parametrize(("divide_by_initial_world_size", "find_unused_parameters"),
                         [(True, False), (False, False), (True, True)],
                         ids=["initial", "effective", "unused"])
def test_join_uneven_inputs(world, divide_by_initial_world_size, find_unused_parameters):
    world.check(cs.uneven_inputs, divide_by_initial_world_size=divide_by_initial_world_size,
                find_unused_parameters=find_unused_parameters)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_low_precision_module(world, dtype_name):
    world.check(cs.low_precision, dtype_name=dtype_name)


def test_mixed_low_precision(world):
    world.check(cs.mixed_low_precision)


@pytest.mark.parametrize("find_unused_parameters", [False, True], ids=["default", "unused"])
def test_logging_data_matches_torch(world, find_unused_parameters):
    world.check(cs.logging_data, find_unused_parameters=find_unused_parameters)


@pytest.mark.parametrize(("dtype_name", "width"), [("float32", 4), ("bfloat16", 2)])
def test_comm_stats(world, dtype_name, width):
    for stats in world.check(cs.comm_stats, dtype_name=dtype_name):
        numel = sum(b["numel"] for b in stats["buckets"])
        assert numel == 8 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4
        assert stats["bytes_reduced"] == width * numel == stats["bytes_sent"]
        assert stats["steps"] == 2 and stats["hook"] == "allreduce"
        assert stats["clock"] == "host"  # CPU tensors: no device events
        assert stats["compression_ratio"] == 1.0
        for b in stats["buckets"]:
            assert b["dtype"] == dtype_name and b["bytes"] == width * b["numel"]
            assert 0 <= b["ready_ms"] <= b["launched_ms"] <= b["done_ms"], b
        assert stats["exposed_comm_ms"] >= 0


def test_hook_registration_errors_are_logged_as_torch(world):
    """A hook refused at registration: the same exception as torch DDP, and the same
    has_error/error in _get_ddp_logging_data()."""
    (cases, *_) = world.check(cs.hook_registration_errors)
    assert all(case["has_error"] == 1 and case["error"] for case in cases), cases


@pytest.mark.parametrize("case", ["allreduce", "bf16", "int8", "powersgd", "python hook",
                                  "find_unused_parameters"])
def test_comm_stats_counts_the_collectives_torch_records(world, case):
    # comm_stats()["collectives"] is c10d's sequence number; the reference is torch's
    # profiler. Closed forms where the hook fixes them: one allreduce per bucket, int8's
    # alltoall and allgather per bucket, plus the unused-parameter map's allreduce.
    *counts, buckets = world.check(cs.collective_counts, case=case)[0]
    per_bucket = {"int8": 2}.get(case, 1)
    extra = 1 if case == "find_unused_parameters" else 0
    for seen, reported in counts:
        assert seen == reported, (counts, buckets)
        if case == "powersgd":  # P and Q, but a bucket of biases alone is only allreduced
            assert buckets < reported <= 2 * buckets, (counts, buckets)
        else:
            assert reported == per_bucket * buckets + extra, (counts, buckets)
