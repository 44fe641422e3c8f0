"""Fixtures: persistent worlds of real gloo ranks, started once per session.

A world costs a few seconds to start (every rank imports torch), so the training and
error scenarios of all test modules share one world per size.

The test folders mirror fastddp's subpackages (ddp/, hooks/, tuning/, ...) and import each
other's scenario modules by plain name (``import hook_scenarios``), here and in the ranks,
which import a scenario by its module's name (harness.World.run): every folder is on
sys.path, which spawned and forkserver ranks inherit. Test module names are unique across
the folders (pytest's default import mode needs that).
"""

import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
for _folder in sorted(_HERE.iterdir(), reverse=True):
    if _folder.is_dir() and _folder.name not in ("scripts", "__pycache__") and (
            str(_folder) not in sys.path):
        sys.path.insert(0, str(_folder))

from harness import World  # noqa: E402


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
