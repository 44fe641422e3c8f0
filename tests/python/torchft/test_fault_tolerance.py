"""fastddp under torchft (fastddp/integrations/torchft.py), with real torchft: its Lighthouse,
Managers, quorums and checkpoint transport, replica groups in their own processes (gloo).

The reference we did not write is torchft's own DistributedDataParallel (torch DDP with
manager.allreduce as its comm hook): with two replicas it divides by 2, a power of two, so
fastddp's divide-then-sum and torchft's sum-then-divide give the same bits, and the runs are
compared bit for bit. A death is a real one: the replica's process exits mid-backward.
"""

import pytest

pytest.importorskip("torchft")

from tests.python.torchft.torchft_world import (assert_same_training_state,  # noqa: E402
                                                run_replicas)

STEPS = 8
KILL_AT = 4


def _committed_steps(log: list) -> list[int]:
    return [step for step, _, committed, _ in log if committed]


def _after_backward(result: dict) -> list[tuple[int, bool]]:
    """(step, manager.is_participating() after its backward) per step attempted. After the
    forward, torchft's own DDP answers before its asynchronous quorum is in (False while it
    is not, whatever comes): only after the backward is the answer the step's. fastddp's
    forward waits for the quorum, so there both agree, and they are checked equal."""
    participation = result["participation"]
    if result.get("impl") == "fastddp":
        assert all(forward == backward for _, forward, backward in participation), participation
    return [(step, backward) for step, _, backward in participation]


@pytest.mark.parametrize("init_sync", [True, False])
def test_equals_torchfts_ddp_without_failure(tmp_path, init_sync):
    # init_sync=True (torchft's default): replica 1 heals from replica 0 at step 0 and sends
    # zeros; is_participating() says so under torchft's DDP, and must under fastddp's.
    extra = {"init_sync": init_sync}
    ours = run_replicas(tmp_path / "fastddp", replicas=2, steps=STEPS, impl="fastddp",
                        extra=extra)
    theirs = run_replicas(tmp_path / "torchft", replicas=2, steps=STEPS, impl="torchft",
                          extra=extra)
    assert_same_training_state(ours)
    for r in ours:
        assert _committed_steps(ours[r]["log"]) == list(range(STEPS))
        assert _after_backward(ours[r]) == _after_backward(theirs[r]), r
    if init_sync:  # the test sees a heal: one of the two sent zeros at step 0
        assert [_after_backward(theirs[r])[0] for r in (0, 1)].count((0, False)) == 1
    assert_same_training_state({0: ours[0], 1: theirs[0], 2: theirs[1]})


def test_equals_torchfts_ddp_through_a_death(tmp_path):
    # The death between two steps: torchft 0.2.0's own DDP raises out of backward
    # (an AssertionError in its comm hook) when a collective fails mid-backward, which
    # fastddp survives (the next test). min_replicas=2: the survivor waits in the quorum for
    # the restarted replica, so both runs change their quorums at the same steps and can be
    # compared bit for bit. The restarted replica heals from the survivor and sends zeros in
    # that step (torchft's allreduce zeroes a non-participant's tensor; fastddp's copy-in
    # writes zeros), the mean divides by the one participant, and the step is not committed
    # (one participant, fewer than min_replicas); its retry, with two, is.
    kwargs = dict(replicas=2, steps=STEPS, victim=1, kill_at=KILL_AT,
                  extra={"kill_in": "between"})
    ours = run_replicas(tmp_path / "fastddp", impl="fastddp", **kwargs)
    theirs = run_replicas(tmp_path / "torchft", impl="torchft", **kwargs)
    # Its first step: begun at step 0 (the log notes the step before the quorum), healed to
    # the survivor's, with one participant (the survivor), then on with two.
    rejoined = [(step, n) for step, n, _, _ in ours[1]["log"]]
    assert rejoined[0] == (0, 1), rejoined
    assert rejoined[1:] == [(s, 2) for s in range(KILL_AT + 1, STEPS)], rejoined
    # is_participating() of the healing step (False) and of every other, as torchft's DDP.
    for r in (0, 1):
        assert _after_backward(ours[r]) == _after_backward(theirs[r]), r
    assert _after_backward(ours[1])[0] == (0, False)
    assert_same_training_state(ours)
    assert_same_training_state({0: ours[0], 1: theirs[0]})


def test_a_death_mid_backward_fails_the_step_on_the_survivor(tmp_path):
    # Two replicas, the second dies in the backward of step KILL_AT: the survivor's
    # collective fails, its backward returns, the step is not committed, and it retries the
    # step (on the same data) once the restarted replica has healed from it.
    results = run_replicas(tmp_path, replicas=2, steps=STEPS, victim=1, kill_at=KILL_AT)
    # Then the retries of that step: while the restarted replica heals (one participant,
    # fewer than min_replicas: not committed either) and with both.
    log = results[0]["log"]
    assert [(s, n, c) for s, n, c, _ in log if s == KILL_AT] == [
        (KILL_AT, 2, False), (KILL_AT, 1, False), (KILL_AT, 2, True)], log
    assert _committed_steps(log) == list(range(STEPS))
    assert_same_training_state(results)


@pytest.mark.parametrize("hook", ["powersgd", "acpsgd"])
def test_a_synchronous_quorum_heals_the_hook_state(tmp_path, hook):
    # use_async_quorum=False: torchft heals the restarted replica inside zero_grad, before
    # fastddp has bound the quorum's group; the peer's hook state (PowerSGD's iteration, past
    # start_powerSGD_iter=2 here) must still reach the hook that runs, or the replicas
    # would issue different collectives.
    results = run_replicas(tmp_path, replicas=2, steps=STEPS, hook=hook, victim=1,
                           kill_at=KILL_AT, extra={"use_async_quorum": False})
    assert _committed_steps(results[0]["log"]) == list(range(STEPS))
    assert results[0]["hook_iter"] is not None
    assert results[1]["hook_iter"] == results[0]["hook_iter"], results
    assert_same_training_state(results)


@pytest.mark.parametrize("hook", [None, "powersgd", "acpsgd", "int8", "fp8", "bf16", "bf16-fp32acc"])
def test_a_death_fails_one_step_and_the_replica_rejoins(tmp_path, hook):
    # Three replicas, at least two per quorum: the two survivors go on without a restart,
    # the killed one is restarted, rejoins, recovers from a peer (weights, optimizer, hook
    # state) and ends with the same bits as the others.
    results = run_replicas(tmp_path, replicas=3, steps=STEPS, hook=hook, victim=2,
                           kill_at=KILL_AT, restart_after_survivors_commit=True,
                           extra={"full": 3})
    end = results[0]["log"][-1][0] + 1  # they train on until the restarted one is back
    for survivor in (0, 1):
        log = results[survivor]["log"]
        failed = [(step, n) for step, n, committed, _ in log if not committed]
        assert (KILL_AT, 3) in failed, log  # the step of the death committed nowhere
        # (A replica that started late healed at its first step: its log begins there.)
        assert _committed_steps(log)[-(end - KILL_AT):] == list(range(KILL_AT, end)), log
        # On at two without a restart (the retried step and after), then at three again.
        assert (KILL_AT, 2, True) in [(s, n, c) for s, n, c, _ in log], log
    # The restarted replica's first step (logged at 0, before its quorum) healed it from a
    # peer with the two survivors as the participants; from then on three.
    rejoined = [(step, n) for step, n, _, _ in results[2]["log"]]
    assert rejoined[0] == (0, 2) and all(n == 3 for _, n in rejoined[1:]), rejoined
    assert_same_training_state(results)


def test_a_late_replica_stalls_the_others_one_timeout_at_most(tmp_path):
    # Replica 2 sends its buckets of step KILL_AT 4 timeouts late (a sleep inside its
    # backward). The two others wait in that step's collective for one timeout, fail the step
    # (reported to torchft, not raised), form a quorum without it and go on at two; the late
    # one fails its step too, heals from them and ends with their bits. Nothing hangs: the
    # harness's deadline is 20 timeouts. (fastddp's link emulator would not do here: it
    # delays a collective's completion on its own rank, never what the peers wait for.)
    timeout = 3.0
    results = run_replicas(tmp_path, replicas=3, steps=STEPS, timeout_s=timeout,
                           extra={"full": 3, "stall_at": KILL_AT, "stall_s": 4 * timeout,
                                  "stall_replica": 2})
    for fast in (0, 1):
        log = [(s, n, c) for s, n, c, _ in results[fast]["log"]]
        first = log.index((KILL_AT, 3, False))  # waited one timeout, then failed
        assert log[first + 1] == (KILL_AT, 2, True), log  # on without the late one
    late = [(s, n, c) for s, n, c, _ in results[2]["log"]]
    assert (KILL_AT, 3, False) in late, late
    assert_same_training_state(results)


def test_check_for_nan_in_grad_still_raises(tmp_path):
    # A non-finite gradient is the user's to see, as without torchft: check_for_nan_in_grad
    # raises out of backward on every replica (the check is shared), not a failed step.
    results = run_replicas(tmp_path, replicas=2, steps=STEPS, extra={
        "nan_at": 2, "ddp_kwargs": {"check_for_nan_in_grad": True}})
    for r in (0, 1):
        step, _, committed, error = results[r]["log"][-1]
        assert (step, committed) == (2, False) and "non-finite gradient" in error, error
