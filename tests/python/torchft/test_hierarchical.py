"""The hierarchical hook under torchft (fastddp/integrations/_torchft_hierarchical.py):
replica groups of two ranks, each rank a process with its own torchft Manager, the replica
group its node (real torchft: Lighthouse, quorums, recovery; gloo).

References we did not write: torch DDP over the same four ranks as one plain world; and,
bit for bit, fastddp's hierarchical hook on that plain world (nodes of two ranks, node-major,
as torchft's replica groups here), which the multi-node tests hold against torch's hooks.
"""

import pytest

pytest.importorskip("torchft")

import torch  # noqa: E402

from tests.python.torchft.torchft_world import (assert_same_training_state,  # noqa: E402
                                                run_replicas)
from tests.python.torchft import whole_world  # noqa: E402

STEPS = 6
KILL_AT = 3
RANKS = 2  # per replica group


@pytest.mark.parametrize("inner", ["allreduce", "bf16"])
def test_equals_the_hierarchical_hook_on_one_world(tmp_path, world4, inner):
    # init_sync=False: every replica group starts from the same weights, as the plain world
    # does (with torchft's default, replica group 1 heals from 0 at step 0 and sends zeros
    # in that step, as under torchft's own DDP: test_fault_tolerance.py).
    ours = run_replicas(tmp_path / "torchft", replicas=2, steps=STEPS, hook=f"hier:{inner}",
                        ranks_per_replica=RANKS, extra={"init_sync": False})
    per_rank = world4.check(whole_world.train_both, local_size=RANKS, steps=STEPS,
                            inner=inner)
    world = {impl: dict(enumerate(r[impl] for r in per_rank)) for impl in ("torch", "fastddp")}
    # Rank k of replica group r is rank r * RANKS + k of the plain world.
    plain = {(r, k): world["fastddp"][r * RANKS + k] for r in range(2) for k in range(RANKS)}
    for key, result in ours.items():
        assert all(c for _, _, c, _ in result["log"]), result["log"]  # nothing failed
        assert_same_training_state({0: result, 1: plain[key]})
    if inner == "allreduce":
        # torch DDP: the same mean of the same gradients, summed in another order (gloo's
        # ring over 4 ranks against 2 x 2): a few float32 ulps per step, grown by 6 steps of
        # momentum SGD on weights of order 0.1-1: 1e-6 absolute covers it; a wrong divisor
        # or a missing replica group's gradients would be off by 1e-3 or more.
        for name, tensor in ours[(0, 0)]["model"].items():
            torch.testing.assert_close(tensor, world["torch"][0]["model"][name],
                                       rtol=0, atol=1e-6)


def test_a_replica_group_dies_and_rejoins(tmp_path):
    # Replica group 1 (both its ranks) dies mid-backward at step KILL_AT. Group 0's two ranks
    # fail the step (their inner collectives fail at whatever bucket each one's peer died;
    # the allgathers inside the group stay matched), go on alone (a quorum of one replica
    # group: the inner hook over one rank) without a restart, and the restarted group heals
    # from them and ends with their bits.
    results = run_replicas(tmp_path, replicas=2, steps=STEPS, hook="hier:bf16",
                           ranks_per_replica=RANKS, min_replicas=1, victim=1,
                           kill_at=KILL_AT, restart_after_survivors_commit=True,
                           extra={"full": 2})
    for k in range(RANKS):
        log = [(s, n, c) for s, n, c, _ in results[(0, k)]["log"]]
        assert (KILL_AT, 2, False) in log, log  # the step of the death committed nowhere
        assert (KILL_AT, 1, True) in log, log  # then on alone
        assert log[-1][1:] == (2, True), log  # and with the restarted group again
    for k in range(RANKS):
        rejoined = [n for _, n, _, _ in results[(1, k)]["log"]]
        assert rejoined[0] == 1 and all(n == 2 for n in rejoined[1:]), rejoined
    assert_same_training_state(results)
