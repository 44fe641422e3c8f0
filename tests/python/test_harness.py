"""The harness keeps its promises: results per rank, no hangs, no leftover processes."""

import os

import pytest

from tests.python import harness
from tests.python.harness import World


def reaped(pids: list[int]) -> bool:
    # A zombie keeps its /proc entry until its parent waits for it.
    return not any(os.path.exists(f"/proc/{pid}") for pid in pids)


@pytest.fixture(scope="module")
def spare_world():
    # Its own world: these tests kill ranks on purpose.
    w = World(2, timeout_s=60)
    yield w
    w.close()


def test_results_come_back_per_rank(spare_world):
    assert spare_world.check(harness.ping) == [0, 1]
    assert spare_world.check("tests.python.harness.ping") == [0, 1]


def test_failure_on_every_rank_keeps_world(spare_world):
    spare_world.start()
    pids = spare_world.pids
    with pytest.raises(AssertionError, match="rank 1 raises on purpose"):
        spare_world.check(harness.raise_on_ranks, ranks=[0, 1])
    assert spare_world.pids == pids


def test_mixed_outcome_is_reported_and_world_torn_down(spare_world):
    spare_world.start()
    pids = spare_world.pids
    results = spare_world.run(harness.raise_on_ranks, ranks=[1])
    assert results[0].ok and results[0].value == "fine"
    assert results[1].error_type == "ValueError"
    assert "rank 1 raises on purpose" in results[1].error
    # Ranks that disagreed may have collectives out of step: the world is gone and reaped.
    assert not spare_world.running and reaped(pids)


def test_hung_rank_times_out_and_is_killed(spare_world):
    spare_world.start()
    pids = spare_world.pids
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not answer"):
        spare_world.run(harness.hang_on_rank, timeout_s=2, rank=1)
    assert not spare_world.running and reaped(pids)
    starts = spare_world.starts
    assert spare_world.check(harness.ping) == [0, 1]
    assert spare_world.starts == starts + 1


@pytest.mark.parametrize("allow_deaths", [True, False])
def test_rank_killed_by_a_signal(allow_deaths):
    # Forked from a server that imported torch: a fresh world in well under a second.
    world = World(2, timeout_s=60, start_method="forkserver")
    world.start()
    pids = world.pids
    try:
        if allow_deaths:
            results = world.run(harness.kill_rank, allow_deaths=True, rank=1)
            assert results[0].ok and results[0].value == "alive"
            assert (results[1].error_type, results[1].error) == (harness.DIED, "exit code -9")
        else:
            with pytest.raises(RuntimeError, match="rank 1 died; the world was torn down"):
                world.run(harness.kill_rank, rank=1)
    finally:
        world.close(polite=False)
    assert not world.running and reaped(pids)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ranks_see_the_environment_of_their_start(monkeypatch, start_method):
    # The fork server keeps the environment of its own start (an earlier test's, here);
    # a rank must see the test process's as it is when the rank starts, as a spawned one does.
    early = World(1, start_method=start_method)
    early.start()  # the fork server (if not started yet) starts without the variable
    early.close()
    monkeypatch.setenv("FASTDDP_HARNESS_PROBE", start_method)
    world = World(2, timeout_s=60, start_method=start_method)
    try:
        assert world.check(harness.environment, name="FASTDDP_HARNESS_PROBE") == \
            [start_method] * 2
        assert world.check(harness.environment, name="RANK") == ["0", "1"]
    finally:
        world.close()
    assert World(1).start_method == "forkserver"
    assert World(1, backend="nccl").start_method == "spawn"  # CUDA is not fork-safe
