"""Fixtures: persistent worlds of real gloo ranks, started once per session.

A world costs a few seconds to start (every rank imports torch), so the training and
error scenarios of all test modules share one world per size.
"""

import pytest

from harness import World


@pytest.fixture(scope="session", params=[2, 3], ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest):
    """A 2-rank and a 3-rank world; tests that take it run on both."""
    w = World(request.param)
    w.start()
    yield w
    w.close()


@pytest.fixture(scope="session")
def world1():
    """A 1-rank world: a process group of size one."""
    w = World(1)
    w.start()
    yield w
    w.close()


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
