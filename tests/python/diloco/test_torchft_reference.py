"""fastddp.DiLoCo against torchft's DiLoCo (torchft 0.2.0, tests/stacks/requirements.txt) on
gloo, same settings, no failure: torchft_scenarios.py."""

import pytest

from tests.python.diloco import torchft_scenarios

coordination = pytest.importorskip("torchft.coordination")


@pytest.fixture
def lighthouse(world):
    """A torchft Lighthouse in this process that forms a quorum once every rank joined."""
    server = coordination.LighthouseServer(bind="[::]:0", min_replicas=world.size)
    yield server.address()
    server.shutdown()


# (steps, H, streaming kwargs). DiLoCo: 2 syncs of H = 3 plus 1 local step. Streaming: 3
# fragments of H = 6 (one syncs every 2 steps), each exchange launched 1 step early, merged
# halfway toward the local weights: every fragment synced twice.
CASES = {
    "diloco": (7, 3, {}),
    "streaming": (12, 6, {"streaming": True, "overlap": 1, "merge_alpha": 0.5}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torchft(world, lighthouse, case):
    steps, sync_every, streaming = CASES[case]
    # The harness deadline is generous: torchft's Manager and quorum start-up are slow on a
    # loaded machine.
    results = world.run(torchft_scenarios.matches_torchft, timeout_s=300,
                        lighthouse=lighthouse, steps=steps, sync_every=sync_every, **streaming)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
              for r in results if not r.ok]
    assert not failed, "\n".join(failed)
