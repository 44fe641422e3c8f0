"""Native batched PowerSGD on real gloo ranks (2 and 3) against torch DDP running torch's
batched_powerSGD_hook with the same PowerSGDState arguments: grads within float32 rounding
(powersgd_scenarios.TOL) after every step. torch 2.14's hook needs one fix to run at all
(powersgd_scenarios._orthogonalize_2d).
"""

import math

import pytest

from fastddp import _C
from tests.python.hooks import powersgd_batched_scenarios
from tests.python.hooks import powersgd_scenarios
from tests.python.hooks.powersgd_scenarios import RANK, SHARED_CASES, START

CASES = {
    **SHARED_CASES,
    "rank1_ws_only": {RANK: 1, START: 3, "use_error_feedback": False},
    "rank1_seed7_unused_args": {RANK: 1, START: 2, "random_seed": 7, "min_compression_rate": 5,
                                "orthogonalization_epsilon": 1e-8,
                                "batch_tensors_with_same_shape": True},
}


def _train(world, **kwargs) -> dict:
    return world.check(powersgd_scenarios.powersgd_training, batched=True, **kwargs)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_batched_powersgd(world, case):
    out = _train(world, **CASES[case])
    assert out["hook"] == "powersgd_batched"
    assert out["buckets"] > 1, out
    assert out["differs_from_mean"], "the compressed steps equal the plain average"
    assert out["bytes_sent"] < out["bytes_reduced"], out


@pytest.mark.parametrize("ddp_args", [{"bucket_cap_mb": 25}, {"gradient_as_bucket_view": True}],
                         ids=["one_bucket", "gradient_as_bucket_view"])
@pytest.mark.parametrize("case", ["rank2_ef_ws", "rank1_plain_start1"])
def test_bucketing_variants(world, ddp_args, case):
    out = _train(world, **ddp_args, **CASES[case])
    assert out["differs_from_mean"]
    assert out["buckets"] == 1 if "bucket_cap_mb" in ddp_args else out["buckets"] > 1


def test_rank3_qr_one_bucket(world):
    # r > 2 orthogonalizes by QR; one bucket of ~2300 elements is a 49 x 49 matrix.
    out = _train(world, bucket_cap_mb=25, matrix_approximation_rank=3, start_powerSGD_iter=2)
    assert out["differs_from_mean"]


@pytest.mark.parametrize("case", ["rank1_ef_ws", "rank2_plain_start3"])
def test_torch_hook_and_state_run_natively(world, case):
    out = _train(world, how="torch", **CASES[case])
    assert out["hook"] == "powersgd_batched", out  # the C++ hook ran, not torch's function


def test_mismatch_is_caught(world):
    # A different random Q on fastddp's side: the comparison must fail.
    results = world.run(powersgd_scenarios.powersgd_training, batched=True, fast_seed=1,
                        matrix_approximation_rank=1, start_powerSGD_iter=2)
    assert not any(r.ok for r in results)
    assert "AssertionError" in results[0].error_type, results[0].error


@pytest.mark.parametrize("case", ["rank2_ef_ws", "rank2_ef_only"])
def test_checkpoint_resume_and_stats(world, case):
    out = world.check(powersgd_batched_scenarios.checkpoint_resume, **CASES[case])[0]
    # Exact: both divide the same element counts.
    assert out["native_stats"] == out["torch_stats"], out
    assert out["errors"] == 10, out  # every parameter of Mixed
    assert (out["bucket_qs"] > 0) == CASES[case].get("warm_start", True), out
    before, after = out["last_step_bytes"]
    assert 0 < after < before, out
    assert [r[0] for r in out["reports"]] == [CASES[case][START]], out  # torch logs once


def test_checkpoint_not_loaded_is_caught(world):
    results = world.run(powersgd_batched_scenarios.checkpoint_resume, load=False,
                        **CASES["rank2_ef_ws"])
    assert not any(r.ok for r in results)
    assert "step 4" in results[0].error, results[0].error


def test_argument_errors(world):
    messages = world.check(powersgd_scenarios.argument_errors, batched=True)[0]
    for arg, message in zip(["matrix_approximation_rank", "start_powerSGD_iter", "random_seed",
                             "warm_start", "min_compression_rate", "orthogonalization_epsilon"],
                            messages, strict=True):
        assert arg in message and "batched_powersgd" in message, (arg, message)


def test_side_is_torchs():
    for numel in [*range(1, 3000), 2**24 - 1, 2**24, 2**24 + 1, 46341**2, 46341**2 + 1]:
        assert _C.batched_powersgd_side(numel) == math.ceil(math.sqrt(numel)), numel
