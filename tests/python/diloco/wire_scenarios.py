"""DiLoCo's averaging wires (fastddp/diloco/_wire.py) against their algorithm written again in
torch ops, run on every rank of a harness world: each rank gathers every rank's inputs and
replays every rank's encoding (torch's ``.to(torch.bfloat16)`` rounding; the 8-bit and 4-bit
codes of tests/python/hooks/quant8_reference.py and quant4_reference.py, torch.round half to
even), its error feedback, and the float32 sum in rank order. Bit for bit: the same float32
operations on the same numbers.
"""

import torch
import torch.distributed as dist

from fastddp.diloco._shard_wire import ShardSumWire
from fastddp.diloco._wire import INT4_BLOCK, make_wire
from tests.python.hooks import quant4_reference as q4
from tests.python.hooks import quant8_reference as q8
from tests.python.scenarios import agree


def _encode(wire: str, staged: torch.Tensor) -> torch.Tensor:
    """What rank's `staged` (pseudo-gradient / world + residual) reads back as."""
    if wire == "bf16":
        return staged.to(torch.bfloat16).float()
    if wire == "int4":
        codes, scales = q4.quantize(staged, INT4_BLOCK)
        return q4.dequantize(codes, scales, staged.numel(), INT4_BLOCK)
    codes, scales = q8.quantize(staged, "int8")
    return q8.dequantize(codes, scales, "int8")


def _rounds(wire: str, numel: int, rounds: int, ours, reference) -> None:
    """`rounds` averages by the wire `ours` of fresh random tensors of `numel` values (not a
    multiple of a block), error feedback carried from one round to the next, each checked
    bit for bit against reference(inputs of every rank, residuals of every rank), which
    returns the expected average and updates the residuals in place."""
    world, rank = dist.get_world_size(), dist.get_rank()
    residuals = [torch.zeros(numel) for _ in range(world)]
    for round_ in range(rounds):
        g = torch.Generator().manual_seed(100 * round_ + rank)
        mine = torch.randn(numel, generator=g) * (1 + rank)
        inputs = [torch.empty(numel) for _ in range(world)]
        dist.all_gather(inputs, mine)
        average = ours.start(0, mine.clone()).wait()
        expected = reference(inputs, residuals)

        def check() -> None:
            assert torch.equal(average, expected), (
                f"round {round_}: the {wire} wire's average differs from the reference by "
                f"{(average - expected).abs().max().item():.3g}")
            assert torch.equal(ours.residuals[0], residuals[rank]), (
                f"round {round_}: the {wire} wire's residual differs from the reference")
        agree(check)


def _sum_in_rank_order(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0].clone()
    for v in values[1:]:
        total += v
    return total


def average_matches_reference(wire: str, numel: int, rounds: int) -> None:
    """quantized_sum="gather" (and bf16): each rank's pseudo-gradient / world + residual
    encoded (its error the next residual); the average is the float32 sum in rank order of
    every rank's decoded buffer."""
    world = dist.get_world_size()

    def reference(inputs: list[torch.Tensor], residuals: list[torch.Tensor]) -> torch.Tensor:
        decoded = []
        for r in range(world):
            staged = inputs[r] * (1.0 / world) + residuals[r]
            decoded.append(_encode(wire, staged))
            residuals[r] = staged - decoded[-1]
        return _sum_in_rank_order(decoded)
    ours = make_wire(wire, dist.group.WORLD, [torch.zeros(numel)], error_feedback=True)
    _rounds(wire, numel, rounds, ours, reference)


def shard_sum_matches_reference(wire: str, numel: int, rounds: int) -> None:
    """quantized_sum="shards": each rank's buffer, zero-padded to world x S values (S whole
    blocks), encoded once with its error fed back; shard s of the average is the float32 sum
    in rank order of every rank's decoded shard s, encoded again (not fed back) and decoded."""
    world = dist.get_world_size()
    block = INT4_BLOCK if wire == "int4" else q8.BLOCK
    shard = -(-numel // (world * block)) * block

    def reference(inputs: list[torch.Tensor], residuals: list[torch.Tensor]) -> torch.Tensor:
        decoded = []
        for r in range(world):
            staged = torch.zeros(world * shard)
            staged[:numel] = inputs[r] * (1.0 / world) + residuals[r]
            decoded.append(_encode(wire, staged).view(world, shard))
            residuals[r] = (staged - decoded[-1].reshape(-1))[:numel]
        sums = _sum_in_rank_order(decoded)
        return torch.cat([_encode(wire, sums[s]) for s in range(world)])[:numel]
    ours = ShardSumWire(wire, dist.group.WORLD, [torch.zeros(numel)], error_feedback=True)
    _rounds(wire, numel, rounds, ours, reference)
