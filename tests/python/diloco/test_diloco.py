"""fastddp.DiLoCo on real gloo ranks (2 and 3) against references fastddp did not write: torch
DDP + SGD at H = 1, torch.optim.SGD(nesterov=True) for the outer step, an uninterrupted run for
restarts; and its refusals of bad and unsupported arguments."""

import pytest
import torch

import fastddp
from tests.python.diloco import diloco_scenarios, wire_scenarios

WIRES = ["fp32", "bf16", "int8", "int4"]


@pytest.mark.parametrize("model", ["mlp", "partly_frozen"])
def test_h1_matches_torch_ddp(world, model):
    world.check(diloco_scenarios.h1_matches_torch_ddp, steps=5, model=model)


@pytest.mark.parametrize("wire", WIRES)
def test_outer_step_is_nesterov_sgd(world, wire):
    world.check(diloco_scenarios.outer_step_is_nesterov_sgd, wire=wire, syncs=3, sync_every=2)


@pytest.mark.parametrize("wire", WIRES)
def test_restart_is_exact(world, wire):
    # Stopped mid-period (step 4 of H = 3): the local weights, the anchor, the outer momentum
    # and the residuals all carry over.
    world.check(diloco_scenarios.restart_is_exact, wire=wire, stop_at=4, steps=10)


@pytest.mark.parametrize("wire", WIRES)
def test_streaming_restart_is_exact(world, wire):
    # 2 fragments of H = 4: one syncs every 2 steps, its exchange launched a step earlier
    # (overlap 1). Stopped at step 5, with fragment 0's exchange in flight: state_dict waits
    # for it and saves its average.
    world.check(diloco_scenarios.restart_is_exact, wire=wire, stop_at=5, steps=10,
                sync_every=4, fragments=2, overlap=1, merge_alpha=0.5)


# mlp()'s 1476 parameters, 2 syncs: fp32 4 bytes a value; bf16 2; int8 1476 codes padded
# to 6 whole blocks of 256 (1536) plus 6 float32 scales; int4 738 bytes of codes, padded to
# 740, plus 24 scales (blocks of 64).
PAYLOAD = {"fp32": 2 * 1476 * 4, "bf16": 2 * 1476 * 2, "int8": 2 * (1536 + 6 * 4),
           "int4": 2 * (740 + 24 * 4)}


@pytest.mark.parametrize("wire", WIRES)
def test_stats_count_the_payload(world, wire):
    for stats in world.check(diloco_scenarios.stats_after, wire=wire, steps=5, sync_every=2):
        assert stats == {"inner_steps": 5, "syncs": 2, "payload_bytes": PAYLOAD[wire]}, stats


@pytest.mark.parametrize("wire", ["int8", "int4"])
@pytest.mark.parametrize("stop_at", [4, 5])
def test_shard_sum_restart_is_exact(world, wire, stop_at):
    # 2 fragments of H = 6 (period 3), overlap 2: a fragment's alltoall after step 1 of its
    # turn, its allgather after step 2, applied after step 3. Stopped after the alltoall
    # (step 4) or the allgather (step 5) of fragment 1's first exchange.
    world.check(diloco_scenarios.restart_is_exact, wire=wire, stop_at=stop_at, steps=12,
                sync_every=6, fragments=2, overlap=2, quantized_sum="shards")


def test_buffers_follow_rank0(world):
    world.check(diloco_scenarios.buffers_follow_rank0, sync_every=2)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"fragments": 3}, ValueError, "sync_every=2 must be a multiple of the number of fragm"),
    ({"fragments": 2, "overlap": 1}, ValueError, "overlap=1 must be < sync_every / fragments"),
    ({"merge_alpha": 1.5}, ValueError, "merge_alpha must be in [0.0, 1.0]"),
    ({"quantized_sum": "shards"}, ValueError, "wire='fp32' has no such form"),
    ({"quantized_sum": "ring"}, ValueError, "quantized_sum must be one of"),
    ({"wire": "bf16", "float64": True}, NotImplementedError, "torch.float64"),
    ({"wire": "fp8"}, ValueError, "wire must be one of"),
    ({"sync_every": 0}, ValueError, "sync_every must be >= 1"),
    ({"sync_every": 2.0}, TypeError, "sync_every must be an int"),
    ({"outer_lr": -1.0}, ValueError, "outer_lr must be >= 0.0"),
    ({"outer_lr": float("inf")}, ValueError, "outer_lr must be a finite number"),
    ({"outer_momentum": 1.0}, ValueError, "outer_momentum must be < 1"),
    ({"model": "mlp"}, TypeError, "model must be a torch.nn.Module"),
    ({"inner_optimizer": None}, TypeError, "inner_optimizer must be a torch.optim.Optimizer"),
    ({"foreign_parameter": True}, ValueError, "not a parameter of model"),
    ({"process_group": "world"}, TypeError, "process_group must be"),
])
def test_bad_argument(world, kwargs, error, match):
    world.expect_error(diloco_scenarios.bad_argument, error, match=match, **kwargs)


@pytest.mark.parametrize("what, error, match", [
    ("config", ValueError, "saved with wire='fp32'"),
    ("missing", KeyError, "lacks ['fragments']"),
    ("shape", ValueError, "anchor buffer 0"),
    ("pending", ValueError, "pending buffer 0"),
])
def test_load_mismatch(world, what, error, match):
    world.expect_error(diloco_scenarios.load_mismatch, error, match=match, what=what)


def test_needs_a_process_group():
    """Without init_process_group (this test process has none) and no process_group."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        fastddp.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)


@pytest.mark.parametrize("wire", ["bf16", "int8", "int4"])
def test_wire_average_matches_reference(world, wire):
    # 1001 values: whole 256-value (int8) and 64-value (int4) blocks and a short one, and an
    # odd count (int4's last byte holds one code).
    world.check(wire_scenarios.average_matches_reference, wire=wire, numel=1001, rounds=3)


@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_shard_sum_matches_reference(world, wire):
    world.check(wire_scenarios.shard_sum_matches_reference, wire=wire, numel=1001, rounds=3)
