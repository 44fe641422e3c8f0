"""Native PowerSGD on real gloo ranks (2 and 3) against torch DDP running torch's
powerSGD_hook with the same PowerSGDState arguments: grads within float32 rounding
(powersgd_scenarios.TOL) after every step.
"""

import numpy as np
import pytest
import torch

from fastddp import _C
from tests.python.hooks import powersgd_scenarios
from tests.python.hooks.powersgd_scenarios import RANK, SHARED_CASES, START

CASES = {
    **SHARED_CASES,
    "rank1_ws_only_eps": {RANK: 1, START: 3, "use_error_feedback": False,
                          "orthogonalization_epsilon": 1e-8},
    "rank3_qr": {RANK: 3, START: 2},
    "rank2_batched": {RANK: 2, START: 2, "batch_tensors_with_same_shape": True},
    "rank1_seed7": {RANK: 1, START: 2, "random_seed": 7},
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_powersgd(world, case):
    out = world.check(powersgd_scenarios.powersgd_training, **CASES[case])[0]
    assert out["hook"] == "powersgd"
    assert out["differs_from_mean"], "the compressed steps equal the plain average"
    assert out["bytes_sent"] < out["bytes_reduced"], out


@pytest.mark.parametrize("ddp_args", [{"bucket_cap_mb": 25}, {"gradient_as_bucket_view": True}],
                         ids=["one_bucket", "gradient_as_bucket_view"])
def test_bucketing_variants(world, ddp_args):
    out = world.check(powersgd_scenarios.powersgd_training, **ddp_args,
                      matrix_approximation_rank=2, start_powerSGD_iter=2)[0]
    assert out["differs_from_mean"]


@pytest.mark.parametrize("case", ["rank1_ef_ws", "rank2_batched"])
def test_torch_hook_and_state_run_natively(world, case):
    out = world.check(powersgd_scenarios.powersgd_training, how="torch", **CASES[case])[0]
    assert out["hook"] == "powersgd", out  # the C++ hook ran, not torch's Python function


def test_mismatch_is_caught(world):
    # A different random Q on fastddp's side: the comparison must fail.
    results = world.run(powersgd_scenarios.powersgd_training, fast_seed=1,
                        matrix_approximation_rank=1, start_powerSGD_iter=2)
    assert not any(r.ok for r in results)
    assert "AssertionError" in results[0].error_type, results[0].error


def test_argument_errors(world):
    messages = world.check(powersgd_scenarios.argument_errors)[0]
    for arg, message in zip(["matrix_approximation_rank", "start_powerSGD_iter", "random_seed",
                             "warm_start", "min_compression_rate", "orthogonalization_epsilon"],
                            messages, strict=True):
        assert arg in message, (arg, message)


@pytest.mark.parametrize("seed", [0, 1, 42, 2**32 - 1])
def test_seeds_are_numpys(seed):
    rs = np.random.RandomState(seed)
    assert _C.numpy_randint(seed, 1_000_000_000, 700) == [
        rs.randint(1_000_000_000) for _ in range(700)]


@pytest.mark.parametrize(("rank", "epsilon", "dtype"), [
    (1, 0.0, torch.float32), (2, 1e-8, torch.float32), (4, 0.0, torch.float32),
    (2, 0.0, torch.float64), (2, 0.0, torch.bfloat16)])
def test_orthogonalize_is_torchs(rank, epsilon, dtype):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    m = torch.randn(3, 17, rank, generator=torch.Generator().manual_seed(rank)).to(dtype)
    want = m.clone()
    psgd._orthogonalize(want, epsilon)
    got = _C.powersgd_orthogonalize(m.clone(), epsilon)
    if rank > 2:  # QR's columns are fixed up to sign only
        got = got * torch.sign((got * want).sum(dim=1, keepdim=True))
    # bf16 takes torch's ops (bit for bit); float32/64 the fused kernel, whose dot products
    # run in double: it differs from torch by torch's own rounding, at most gamma_17 = 17u
    # of the columns' entries (|entry| <= 1) for its 17-term float sums (Gram-Schmidt's
    # norms and projections, or QR's reflections); measured 1 eps (float32 and float64).
    atol = 0 if dtype == torch.bfloat16 else m.shape[1] * torch.finfo(dtype).eps / 2
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
