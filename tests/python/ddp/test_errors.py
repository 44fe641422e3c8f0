"""Misuse raises a clear Python exception, on every rank, without hanging."""

import pytest
import torch.distributed as dist
from torch import nn

import fastddp
from tests.python.ddp import errors_scenarios

PRIOR_REDUCTION = "Expected to have finished reduction in the prior iteration"


def test_no_process_group():
    # The test process itself never joins a process group; only the harness ranks do.
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fastddp.DistributedDataParallel(nn.Linear(2, 2))


def test_parameters_on_several_devices(world):
    for message in world.expect_error(errors_scenarios.several_devices, ValueError):
        assert "'local.weight' on cpu" in message and "'remote' on meta" in message, message


def test_shapes_differ_across_ranks(world):
    for message in world.expect_error(errors_scenarios.shapes_differ, ValueError):
        assert "0.weight" in message and "rank 0" in message and "rank 1" in message, message


def test_second_backward_through_one_forward(world):
    world.expect_error(errors_scenarios.second_backward, RuntimeError, match="already reduced")


def test_sparse_gradients_with_a_dense_only_hook(world):
    for message in world.expect_error(errors_scenarios.sparse_embedding_with_bf16,
                                      NotImplementedError, match="sparse"):
        assert "'bf16'" in message and "'0.weight'" in message, message


def test_forward_after_partial_backward(world):
    ours = world.expect_error(errors_scenarios.forward_after_partial_backward, RuntimeError,
                              match=PRIOR_REDUCTION, implementation="fastddp")
    theirs = world.expect_error(errors_scenarios.forward_after_partial_backward, RuntimeError,
                                match=PRIOR_REDUCTION, implementation="torch")
    for rank, (mine, torchs) in enumerate(zip(ours, theirs)):
        assert mine.startswith(PRIOR_REDUCTION), mine
        # The advice, up to "calculating loss.", is torch's word for word (torch wraps lines).
        advice = " ".join(torchs.split()).split("calculating loss.")[0]
        assert " ".join(mine.split()).startswith(advice), f"fastddp: {mine}\ntorch: {torchs}"
        # Torch names parameters only under TORCH_DISTRIBUTED_DEBUG; fastddp always does.
        unready = mine.split(f"did not receive grad for rank {rank}: ")[1].split("\n")[0]
        assert unready == "unused.weight, unused.bias", mine


@pytest.mark.parametrize("implementation", ["torch", "fastddp"])
def test_static_graph_changed(world, implementation):
    """A parameter used in the first iterations then left out: torch's static-graph text."""
    world.expect_error(errors_scenarios.static_graph_changed, RuntimeError,
                       match="not compatible with static_graph set to True",
                       implementation=implementation)


@pytest.mark.parametrize("implementation", ["torch", "fastddp"])
def test_marked_ready_twice(world, implementation):
    """Reentrant checkpointing of one block twice, without static_graph."""
    messages = world.expect_error(errors_scenarios.marked_ready_twice, RuntimeError,
                                  match="Expected to mark a variable ready only once",
                                  implementation=implementation)
    if implementation == "fastddp":
        assert all("block.0.weight" in m or "block.0.bias" in m or "block.2" in m
                   for m in messages), messages


def test_set_static_graph_too_late(world):
    world.expect_error(errors_scenarios.static_graph_too_late, RuntimeError,
                       match="should be called before training loop starts")


def test_failed_peer_surfaces_as_error():
    """A rank that stops before its backward: the others' backward raises (the collective
    times out) instead of hanging, and names the bucket and the hook."""
    from tests.python.harness import World

    world = World(2, timeout_s=60)
    try:
        results = world.run(errors_scenarios.peer_fails_before_backward)
    finally:
        world.close()
    assert results[1].error_type == "ValueError", results[1]
    assert results[0].error_type == "RuntimeError", results[0]
    assert "reduction of bucket 0 (comm hook 'allreduce') failed on rank 0" in results[0].error
