"""The sharded optimizer's 8-bit reduce-scatter (wire8_scenarios.py) on 2 and 3 gloo ranks."""

import pytest

from tests.python.optim import wire8_scenarios as s


# Bit for bit: the C++ kernels quantize as the independent reference does (the 8-bit hooks'
# kernel tests hold them to it), and the dequantized rows are added in float32 in rank order
# in both. The relative error of the 8-bit average against the float32 one is the wire's:
# each rank's value rounded once to 8 bits of its block's scale (int8: half of 1/127 of the
# block's absmax; e4m3: 2^-4 relative; e5m2: 2^-3), summed over the ranks: at most world x
# that of the largest element, bounded here by 2^-2 for e5m2 and 2^-4 for the others
# (measured on 3 ranks: 0.075, 0.042 for e4m3, 0.0073 for int8), so a wrong row, scale or
# rank (errors of the gradient's own size) fails.
@pytest.mark.parametrize("wire", sorted(s.FORMATS))
def test_an_8_bit_reduce_scatter_is_the_written_out_sum(world, wire):
    fmt = s.FORMATS[wire]
    for r in world.check(s.shards_are_the_written_out_sum, wire=wire):
        assert r["hook"] == f"reduce_scatter_{fmt}", r
        assert r["diff"] == 0.0, r
        assert r["relative_error"] <= (2 ** -2 if fmt == "e5m2" else 2 ** -4), r


# Counted, not timed (Note [counted cost]): the quantization reads the float32 bucket once
# and writes a byte a value (5 bytes a value: 5b/4 for a bucket of b bytes); per received
# row the dequantization reads its codes and writes float32 (5b/4 over the world rows), and
# each row after the first is added into the shard (8 bytes a shard value: 2b(n-1)/n).
# Nothing else: no re-quantization, no copy back into .grad.
def test_an_8_bit_wire_costs_one_quantization_and_one_sum(world):
    from tests.python.optim import sharded_scenarios

    for out in world.check(sharded_scenarios.step_cost, wire="int8"):
        g, b, n = out["grad_bytes"], out["bucket_bytes"], world.size
        assert out["cost"] == {"copy_in_bytes": 2 * g, "write_back_bytes": 0,
                               "hook_bytes": 5 * b // 2 + 2 * (n - 1) * b // n,
                               "check_bytes": 0, "state_copy_bytes": 0, "host_syncs": 0,
                               "kept_grad_copy_bytes": 0}, out
