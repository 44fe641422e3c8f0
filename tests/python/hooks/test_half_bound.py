"""The half hooks' modes that torch has no hook for (accumulate="fp32", error feedback) on
real gloo ranks (2 and 3), against the exact mean of the ranks' gradients gathered by torch,
within the wire format's error bound (half_bound_scenarios.py)."""

import pytest

from tests.python.hooks import half_bound_scenarios


@pytest.mark.parametrize("spec", ["fastddp.bf16_fp32", "fastddp.fp16_fp32", "fastddp.bf16_ef",
                                  "fastddp.bf16_fp32_ef", "fastddp.fp16_fp32_ef"])
def test_modes_without_torch_hook_within_bound_of_mean(world, spec):
    """accumulate="fp32" and error feedback against torch's exact mean of the gathered
    gradients, within the wire format's stated error bound."""
    out = world.check(half_bound_scenarios.within_bound_of_mean, spec=spec)[0]
    assert out["used"] < 1.0 and out["traced"], out
