"""ParameterShardedOptimizer (by_parameter_scenarios.py) on 2 and 3 gloo ranks: torch's
numbers for whole-tensor optimizers, each rank's share of the state, its checkpoints."""

import pytest

from tests.python.optim import by_parameter_scenarios as s


# Bit for bit against torch DDP + the unsharded optimizer and against torch's
# ZeroRedundancyOptimizer: the same reducer sums (fastddp's allreduce is torch DDP's on 2
# ranks; on 3, gloo's ring order follows the same bucket layout in both), and each parameter
# is stepped by torch's own code from the same gradient. GradScaler's unscale_ and torch's
# clip_grad_norm_ run on the ordinary .grad; the scale (a power of two) unscales exactly.
@pytest.mark.parametrize("optimizer", sorted(s.OPTIMIZERS))
@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clip"])
def test_whole_parameter_shards_are_torchs(world, optimizer, clip):
    for r in world.check(s.train, optimizer=optimizer, clip=clip):
        assert r["moved"], r
        assert r["diff_ref"] == 0.0 and r["diff_zero"] == 0.0, r
        # Each rank holds its own parameters' state: the shares add up to the whole, and
        # the rule is ZeroRedundancyOptimizer's (the same share on every rank).
        assert r["shares_sum"] == r["whole_state_bytes"], r
        assert r["state_bytes"] == r["zero_state_bytes"], r
        assert r["state_bytes"] < r["whole_state_bytes"], r


def test_state_dict_is_the_unsharded_optimizers(world):
    for r in world.check(s.state_dict_round_trip):
        assert r["consolidated_equal"] and r["diff_after_load"] == 0.0, r


def test_refusals_name_the_culprit(world):
    for r in world.check(s.refusals):
        assert r["lbfgs"].startswith("NotImplementedError") and "LBFGS" in r["lbfgs"], r
        assert "consolidate_state_dict" in r["state_dict_first"], r
        assert r["a_foreign_parameter"].startswith("ValueError"), r
