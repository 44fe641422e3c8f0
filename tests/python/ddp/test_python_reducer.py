"""torch._dynamo.config.optimize_ddp="python_reducer" on 2 real gloo ranks
(python_reducer_scenarios.py): compiled autograd trains fastddp to torch DDP's numbers on a
model built in that mode (as torch DDP needs), with a Python comm hook too; fastddp's
built-in hooks are refused there with NotImplementedError.
"""

import pytest

from tests.python.ddp import python_reducer_scenarios as pr
from tests.python.ddp.test_compile import world2  # noqa: F401 (its fixture: a world per module)

pytestmark = pytest.mark.compile  # compiles on every test, as test_compile.py's


@pytest.mark.parametrize("hook", [False, True], ids=["default", "python_hook"])
@pytest.mark.parametrize("backward", ["compiled", "eager"])
def test_python_reducer_mode_trains_as_torch(world2, backward, hook):
    """Built under optimize_ddp="python_reducer": torch DDP's gradients and parameters,
    under compiled autograd too (which must really have captured the backward)."""
    captures = world2.check(pr.trains_as_torch, backward=backward, hook=hook)[0]
    if backward == "compiled":
        assert captures["fastddp"] > 0 and captures["torch"] > 0, captures


@pytest.mark.parametrize("how", ["register", "builtin_type"])
def test_python_reducer_mode_refuses_builtin_hooks(world2, how):
    message = world2.check(pr.builtin_hook_refused, how=how)[0]
    assert "python_reducer" in message, message


def test_python_reducer_without_compiled_forward_trains_as_torch(world2):
    world2.check(pr.other_mode_trains_as_torch, mode="python_reducer_without_compiled_forward")
