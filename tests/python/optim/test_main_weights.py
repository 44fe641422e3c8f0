"""ShardedOptimizer(main_weights="fp32") on bf16 and fp16 parameters against the written-out
computation (main_weights_scenarios.py), on 2 and 3 gloo ranks."""

import pytest

from tests.python.optim import main_weights_scenarios as s


# Bit for bit: the same quotients in the same 16-bit format, the same float32 sum in rank
# order, torch's own optimizer on float32 copies, the same single rounding; SGD with
# momentum, Adam and AdamW in their for-loop and foreach forms (the fused CPU kernels round
# their tail apart from their body: sharded_scenarios.POSITION_DEPENDENT).
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam", "adamw", "adamw_foreach"])
def test_main_weights_are_the_written_out_mixed_precision(world, optimizer, dtype):
    for r in world.check(s.train, optimizer=optimizer, dtype=dtype):
        assert r["dtypes"] == [f"torch.{'bfloat16' if dtype == 'bf16' else 'float16'}"], r
        assert r["state_dtypes"] == ["torch.float32"], r  # the optimizer's state: float32
        assert r["moved"] and r["grads_none"], r
        assert r["diff"] == 0.0, r
        # Memory: a float32 gradient shard and float32 main weights, 1/world of the 16-bit
        # buckets' elements each (2 bytes per element in the buckets, 4 in the shards).
        assert r["main_bytes"] == r["grad_shard_bytes"] == 2 * r["flat_bytes"] // world.size


# Clipped, the norm is summed over shards and the reference's per parameter: another order
# of the same float32 squares, whose roots may differ by an ulp, and an ulp of the clip
# factor moves a 16-bit weight by at most one rounding step: at most 1 bf16 ulp (2^-7
# relative) of a weight (measured: 0 on 2 and 3 ranks).
def test_main_weights_with_clipping(world):
    for r in world.check(s.train, optimizer="adamw", clip=True):
        assert r["ulps"] <= 2 ** -7, r


def test_main_weights_refusals(world):
    for r in world.check(s.refusals):
        assert r["float32_parameters"].startswith("ValueError") and "float32" in \
            r["float32_parameters"], r
        assert r["with_a_wire"].startswith("NotImplementedError") and "gradient_wire" in \
            r["with_a_wire"], r
        assert r["other_dtype"].startswith("NotImplementedError"), r
        assert r["checkpoint"].startswith("NotImplementedError") and "main weights" in \
            r["checkpoint"], r
