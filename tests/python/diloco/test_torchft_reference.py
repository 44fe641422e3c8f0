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


def test_matches_torchft(world, lighthouse):
    # Steps: 2 syncs of H = 3 plus 1 local step; the harness deadline is generous since
    # torchft's Manager and quorum start-up are slow on a loaded machine.
    results = world.run(torchft_scenarios.matches_torchft, timeout_s=300,
                        lighthouse=lighthouse, steps=7, sync_every=3)
    failed = [f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
              for r in results if not r.ok]
    assert not failed, "\n".join(failed)
