"""The 8-bit hooks train: the MLP regression of test_powersgd_convergence.py (2 gloo ranks,
a fixed random teacher, each rank its own shard) reaches within 10% of plain float32
averaging's final loss with fastddp.hooks.int8() and fastddp.hooks.fp8() (e4m3), error
feedback on (the default). Fails if the compression were lost (comm_stats) or wrong enough
to stall or derail training (the loss checks)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fastddp
import quant8_scenarios
from test_powersgd_convergence import ROWS_PER_RANK, STEPS, _global_loss, _mlp, _shard


def train(hook: str, steps: int = STEPS) -> dict:
    """Trains the student with `hook` ("none", "int8", "e4m3"); losses and comm figures."""
    x, y = _shard()
    model = fastddp.DistributedDataParallel(copy.deepcopy(_mlp(torch.Generator().manual_seed(0))))
    if hook != "none":
        model.register_comm_hook(None, quant8_scenarios.native_hook(hook))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch = torch.Generator().manual_seed(torch.distributed.get_rank())
    first = _global_loss(model.module, x, y)
    for _ in range(steps):
        idx = torch.randint(0, ROWS_PER_RANK, (64,), generator=batch)
        opt.zero_grad()
        F.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    stats = model.comm_stats()
    return {"first": first, "last": _global_loss(model.module, x, y),
            "bytes_reduced": stats["bytes_reduced"], "bytes_sent": stats["bytes_sent"]}


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
