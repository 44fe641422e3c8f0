"""The "int8" / "fp8" comm hooks on real gloo ranks (2 and 3, and 4): bit for bit against
the same algorithm in torch ops run by torch DDP (quant8_hooks_scenarios.ReferenceHook), within
the quantization bound of torch DDP's exact float32 mean, the error-feedback invariant, and
the bytes comm_stats() counts."""

import pytest
import torch

import fastddp
from tests.python.hooks import quant8_hooks_scenarios

FORMATS = ["int8", "e4m3", "e5m2"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_torch_reference(world, fmt):
    results = world.check(quant8_hooks_scenarios.matches_reference, fmt=fmt, bucket_cap_mb=0.001)
    assert results[0]["hook"] == ("int8" if fmt == "int8" else f"fp8({fmt})"), results[0]
    # Error feedback: what was sent plus what is owed is what came in, up to float32
    # rounding: each step rounds the residual's two float ops (v = scaled + residual,
    # residual = v - sent) by half an ulp each, 4 steps: 4 eps of the largest |value|, the
    # reference's float64 sums being exact by comparison (measured 0.4 eps).
    assert max(r["gap"] for r in results) < 4 * torch.finfo(torch.float32).eps, results


@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
def test_matches_torch_reference_world4(world4, fmt):
    world4.check(quant8_hooks_scenarios.matches_reference, fmt=fmt, steps=3)


def test_without_error_feedback(world):
    result = world.check(quant8_hooks_scenarios.matches_reference, fmt="int8", error_feedback=False,
                         steps=3)[0]
    assert result["hook"] == "int8(error_feedback=False)"


def test_gradient_as_bucket_view(world):
    world.check(quant8_hooks_scenarios.matches_reference, fmt="e4m3", steps=3,
                gradient_as_bucket_view=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_close_to_exact_mean(world4, fmt):
    ratios = world4.check(quant8_hooks_scenarios.error_against_exact_mean, fmt=fmt)
    assert max(ratios) < 1.0, ratios
    # Not a bound so loose that anything passes: the error is a visible part of it.
    assert max(ratios) > 0.02, ratios


@pytest.mark.parametrize("fmt", ["int8", "e5m2"])
def test_wire_bytes_in_comm_stats(world, fmt):
    stats = world.check(quant8_hooks_scenarios.wire_bytes, fmt=fmt)[0]
    plain, quant = stats["allreduce"], stats[fmt]
    assert plain["sent"] == plain["reduced"] == quant["reduced"], stats
    # 1 byte per value + 4 bytes per 256 values, over 4 bytes per value (+ padding).
    assert 0.25 * plain["sent"] < quant["sent"] < 0.26 * plain["sent"], stats


def test_float64_model_is_refused(world):
    message = world.check(quant8_hooks_scenarios.float64_model_is_refused, fmt="int8")[0]
    assert "float32" in message, message


def test_options_are_checked():
    with pytest.raises(ValueError, match="format must be 'e4m3' or 'e5m2'"):
        fastddp.hooks.fp8(format="e3m4")
    with pytest.raises(TypeError, match="error_feedback must be a bool"):
        fastddp.hooks.int8(error_feedback=1)
    assert fastddp.hooks.fp8().options == {"format": "e4m3", "error_feedback": True}
    assert {"int8", "fp8"} <= set(fastddp._C.comm_hook_names())


def test_launcher_spelling():
    from fastddp.launch.patch import (HookSpec, HookUnavailableError, fastddp_hook, parse_hook_spec,
                               torch_hook)

    assert parse_hook_spec("int8") == HookSpec("int8")
    assert parse_hook_spec("fp8") == HookSpec("fp8")
    assert parse_hook_spec("fp8:e5m2") == HookSpec("fp8", format="e5m2")
    assert str(parse_hook_spec("fp8:e5m2")) == "fp8:e5m2"
    with pytest.raises(ValueError, match="fp8's format"):
        parse_hook_spec("fp8:e3m4")
    with pytest.raises(ValueError, match="only powersgd and acpsgd take a rank"):
        parse_hook_spec("int8:2")
    assert fastddp_hook(HookSpec("fp8", format="e5m2"))[1].options == {
        "format": "e5m2", "error_feedback": True}
    assert fastddp_hook(HookSpec("int8"))[1].name == "int8"
    with pytest.raises(HookUnavailableError, match="stock torch DDP has no int8"):
        torch_hook(HookSpec("int8"))
