"""The 8-bit hooks train: the MLP regression of test_powersgd_convergence.py (2 gloo ranks,
a fixed random teacher, each rank its own shard) reaches within 10% of plain float32
averaging's final loss with fastddp.hooks.int8() and fastddp.hooks.fp8() (e4m3), error
feedback on (the default). Fails if the compression were lost (comm_stats) or wrong enough
to stall or derail training (the loss checks)."""

import pytest

from tests.python.hooks import quant8_hooks_scenarios
from tests.python.hooks.test_powersgd_convergence import STEPS, train_student


def train(hook: str, steps: int = STEPS) -> dict:
    """Trains the student with `hook` ("none", "int8", "e4m3"); losses and comm figures."""
    native = None if hook == "none" else quant8_hooks_scenarios.native_hook(hook)
    return train_student(native, steps)


@pytest.mark.parametrize("world", [2], indirect=True, ids=["world2"])
def test_8bit_loss_close_to_fp32(world):
    fp32 = world.check(train, hook="none")[0]
    for hook in ("int8", "e4m3"):
        run = world.check(train, hook=hook)[0]
        for name, r in (("fp32", fp32), (hook, run)):
            assert r["last"] < 0.2 * r["first"], (name, r)  # both learned
        assert run["bytes_sent"] * 3 < run["bytes_reduced"], run  # compression really ran
        # A training bound, not a rounding one: error feedback recovers what 8 bits drop,
        # so the run may trail fp32 by a little (10% of its final loss), no more.
        assert run["last"] <= 1.1 * fp32["last"], (hook, run, fp32)
