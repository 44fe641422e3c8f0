"""A process group written in Python, as torch's test_c10d_pypg.py writes one, on 1 and 2
ranks: fastddp trains through its Works as torch DDP does (python_process_group_scenarios.py).
On 2 and 3 ranks, a group c10d never registered: test_python_process_group_world.py."""

import pytest

from tests.python.ddp import python_process_group_scenarios as s
from tests.python.harness import World


@pytest.fixture(scope="module", params=[1, 2])
def any_world(request):
    world = World(request.param)
    world.start()
    yield world
    world.close()


def test_python_works_are_waited_on_and_read_as_torch(any_world):
    """World size 1 is torch's LonelyRankProcessGroup: torch DDP syncs the module and
    reduces through the group there too, so fastddp does (its Works may count, log or
    fence). Every step's futures are read: one per bucket per step, at least."""
    for result in any_world.check(s.trains_through_python_works, steps=3):
        assert result["identical"], result
        assert result["fastddp"]["futures"] >= 3 and result["fastddp"]["waits"] > 0, result
        assert result["torch"]["futures"] >= 3 and result["torch"]["waits"] > 0, result
