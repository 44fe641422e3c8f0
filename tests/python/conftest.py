"""Fixtures: persistent worlds of real gloo ranks, started once per session.

A world costs a few seconds to start (every rank imports torch), so the training and
error scenarios of all test modules share one world per size.

The test folders mirror fastddp's subpackages (ddp/, hooks/, tuning/, ...). tests/ is a
package: pytest imports every test module by its qualified name (tests.python.ddp.test_x),
with the repository's root on sys.path, and tests import their scenario modules by those
names (``from tests.python.hooks import hooks_scenarios``). The ranks of a world, spawned
or forked from a fork server, inherit that sys.path and import a scenario by its module's
qualified name (harness.World.run).
"""

import pytest

from tests.python.harness import World


def _started(size: int):
    w = World(size)
    w.start()
    yield w
    w.close()


@pytest.fixture(scope="session", params=[2, 3], ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest):
    """A 2-rank and a 3-rank world; tests that take it run on both."""
    yield from _started(request.param)


@pytest.fixture(scope="session")
def world1():
    """A 1-rank world: a process group of size one."""
    yield from _started(1)


@pytest.fixture(scope="module")
def world4():
    """A 4-rank world, for the few tests that need more ranks (started per module)."""
    yield from _started(4)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Decided per test, at run time: nothing touches CUDA while modules are imported.
    if item.get_closest_marker("gpu") is None:
        return
    import torch

    import fastddp

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible")
    if not fastddp.build_info()["cuda"]:
        pytest.skip("fastddp was built without CUDA")
