"""fastddp.hooks.acpsgd (Note [acpsgd]) against ACP-SGD written out with torch ops
(acpsgd_scenarios.Reference), and its one collective per bucket per step."""

import pytest

from tests.python.harness import World
from tests.python.hooks import acpsgd_scenarios


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_matches_the_algorithm_written_with_torch_ops(world, rank):
    # 8 steps: 2 of plain allreduce, then P, Q, P, Q, P, Q.
    compressed = world.check(acpsgd_scenarios.against_reference, rank=rank)[0]
    assert compressed >= 3  # the conv and the three square matrices at every rank here


def test_one_allreduce_per_bucket_per_step(world):
    *counts, buckets = world.check(acpsgd_scenarios.allreduces_per_step, hook="acpsgd")[0]
    # Step 0 runs before the bucket rebuild (other buckets); from step 1 on, one per bucket,
    # compressed (steps 2-4) or not, by torch's profiler and by comm_stats() alike.
    assert buckets > 1 and counts[1:] == [(buckets, buckets)] * 4, (counts, buckets)
    *psgd, psgd_buckets = world.check(acpsgd_scenarios.allreduces_per_step, hook="powersgd")[0]
    assert psgd[2:] == [(2 * psgd_buckets,) * 2] * 3, (psgd, psgd_buckets)  # P, then Q


def test_resume_takes_the_same_steps(world):
    out = world.check(acpsgd_scenarios.resume)[0]
    if world.size == 2:
        assert out["equal"], out
    else:
        # On 3 ranks the resumed run's first step reduces over the initial bucket layout,
        # the uninterrupted run's over the rebuilt one: gloo's ring adds in another order
        # (powersgd_state_scenarios.ROUNDING_ULPS); a lost state is ~1e-2 away (below).
        assert out["max_diff"] < 1e-5, out
    assert out["keys"] == ["error", "hook", "iter", "next_stats_report", "numel_after",
                           "numel_before", "p", "q", "rng_state"]
    assert "b.weight" in out["p_names"] and "b.bias" not in out["p_names"], out


def test_resume_without_the_state_differs(world):
    # The control: a resumed run with a fresh state (no error, no factors) is far off.
    out = world.check(acpsgd_scenarios.resume, load_hook_state=False)[0]
    assert not out["equal"] and out["max_diff"] > 1e-4, out


def test_arguments_and_the_launcher_option():
    import fastddp
    from fastddp.launch.hook_spec import (HookSpec, HookUnavailableError, fastddp_hook,
                                          parse_hook_spec, torch_hook)

    with pytest.raises(ValueError, match="start_iter must be > 1"):
        fastddp.hooks.acpsgd(start_iter=1)  # the buckets are rebuilt after step 1
    with pytest.raises(ValueError, match="matrix_approximation_rank must be an int >= 1"):
        fastddp.hooks.acpsgd(0)
    assert parse_hook_spec("acpsgd:2") == HookSpec("acpsgd", 2)
    hook = fastddp_hook(parse_hook_spec("acpsgd:2"))[1]
    assert hook.name == "acpsgd"
    assert (hook.options["matrix_approximation_rank"], hook.options["start_powerSGD_iter"]) \
        == (2, 2)
    with pytest.raises(ValueError, match="acpsgd rank must be a positive integer"):
        parse_hook_spec("acpsgd:0")
    with pytest.raises(HookUnavailableError, match="stock torch DDP has no acpsgd"):
        torch_hook(HookSpec("acpsgd"))


@pytest.mark.gpu
def test_matches_the_algorithm_on_cuda():
    # One GPU over NCCL: the hook's CUDA path (bmm, the fused orthogonalization, the
    # collective's stream) against the same torch ops on the GPU; rank 4 takes QR.
    world = World(1, backend="nccl")
    try:
        for rank in (1, 4):
            assert world.check(acpsgd_scenarios.against_reference, rank=rank,
                               device="cuda")[0] >= 3
    finally:
        world.close()
