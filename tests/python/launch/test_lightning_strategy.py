"""``Trainer(strategy="fastddp")`` and its hook variants, registered in Lightning's
StrategyRegistry by ``import fastddp.integrations.lightning``, started with Lightning's own
launcher (no torchrun, no ``-m fastddp``), against Lightning's ``"ddp"`` (torch's class,
torch's closest hook) on 2 CPU gloo ranks (lightning_strategy_scenarios.py). Skipped when
Lightning is not installed (``make deps-stacks``)."""

import importlib.util

import pytest
import torch

from tests.python.launch.lightning_strategy_scenarios import (FASTDDP_CLASS, SCENARIOS,
                                                              TORCH_CLASS, finish, run_pair,
                                                              start)
from tests.python.launch.test_stacks import assert_ranks_agree, assert_same_training

pytestmark = [pytest.mark.stacks,
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                 reason="lightning is not installed (make deps-stacks)")]

# Bit for bit: 2 ranks add their gradients in the one order there is, fastddp.hooks.bf16()
# rounds as torch's bf16_compress_hook, and the runs do the same float ops otherwise.
EXACT = {"rtol": 0.0, "atol": 0.0}
# PowerSGD: torch's BLAS and fastddp's fused kernels round each product of P Q^T differently
# (tests/python/hooks/powersgd_scenarios.py: gradients within 5e-5 of their scale), and 6
# SGD steps of lr 0.05 carry that into the weights; measured at most 6e-8 here.
POWERSGD = {"rtol": 1e-5, "atol": 1e-6}
TOLERANCE = {"fastddp": EXACT, "fastddp_bf16": EXACT, "fastddp_powersgd": POWERSGD}


@pytest.mark.parametrize("strategy", list(SCENARIOS))
def test_strategy_matches_lightning_ddp(strategy: str, tmp_path) -> None:
    fast, stock = run_pair(tmp_path, strategy)
    assert [r["rank"] for r in fast] == [0, 1]
    for ours, theirs in zip(fast, stock, strict=True):
        assert ours["wrapper"]["classes"][0] == FASTDDP_CLASS, ours["wrapper"]
        assert theirs["wrapper"]["classes"][0] == TORCH_CLASS, theirs["wrapper"]
        hook = SCENARIOS[strategy]
        assert ours["wrapper"]["comm_hooks"] == ([f"fastddp_{hook}_hook"] if hook else [])
        assert len(theirs["wrapper"]["comm_hooks"]) == (1 if hook else 0)
    assert_same_training(fast, stock, TOLERANCE[strategy])
    assert_ranks_agree(fast, {k for k in fast[0]["state"] if "running_" in k})


# FastDDPStrategy(shard_optimizer=True): configure_optimizers' SGD with momentum becomes
# fastddp's ShardedOptimizer, its per-step StepLR schedules the sharded one, and the Trainer's
# gradient_clip_val clips the shards: the run is Lightning's "ddp" with the unsharded SGD,
# bit for bit without clipping (2 ranks: the same reduction order, Note [sharded optimizer]).
# Clipped, the norm is summed over shards, not per parameter: another order, measured
# 3.7e-9 on the weights and 0 on the losses (the clip itself moves the weights by 0.44).
CLIP_TOL = {"rtol": 1e-5, "atol": 1e-6}


# Lightning's trainer.save_checkpoint consolidates the sharded state on rank 0: the momentum
# buffers and learning rates saved are those of the unsharded run, in torch's format.
@pytest.mark.parametrize("clip", [[], ["--clip", "0.5"]], ids=["plain", "clip"])
def test_shard_optimizer_matches_lightning_ddp(clip: list[str], tmp_path) -> None:
    fast = start(tmp_path, "sharded", ["--shard-optimizer", "--schedule", "--checkpoint", *clip])
    stock = start(tmp_path, "ddp", ["--strategy", "ddp", "--schedule", "--checkpoint", *clip])
    fast, stock = finish(*fast), finish(*stock)
    for ours, theirs in zip(fast, stock, strict=True):
        assert ours["wrapper"]["classes"][0] == FASTDDP_CLASS, ours["wrapper"]
        assert (ours["wrapper"]["optimizer"], theirs["wrapper"]["optimizer"]) == (
            "ShardedOptimizer", "SGD")
        assert ours["wrapper"]["lr"] == theirs["wrapper"]["lr"] < 0.05  # StepLR stepped it
        assert "gradient_clip_algorithm='value'" in ours["wrapper"]["refused"], ours["wrapper"]
        if ours["rank"] != 0:
            continue  # rank 0 wrote the checkpoint
        saved, reference = ours["wrapper"]["saved_optimizer"], theirs["wrapper"]["saved_optimizer"]
        assert saved["lr"] == reference["lr"]
        assert len(saved["momentum"]) == len(reference["momentum"]) == 6  # 3 layers, w and b
        for mine, want in zip(saved["momentum"], reference["momentum"]):
            torch.testing.assert_close(torch.tensor(mine), torch.tensor(want),
                                       **(CLIP_TOL if clip else EXACT))
    assert_same_training(fast, stock, CLIP_TOL if clip else EXACT)
    assert_ranks_agree(fast, {k for k in fast[0]["state"] if "running_" in k})


def test_registered_names() -> None:
    import fastddp.integrations.lightning as integration
    from lightning.pytorch.strategies import StrategyRegistry

    for name in SCENARIOS:
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, integration.FastDDPStrategy), name
    with pytest.raises(ValueError, match="unknown hook 'nope'"):
        integration.FastDDPStrategy(hook="nope")
    with pytest.raises(TypeError, match="shard_optimizer is True, False or a dict"):
        integration.FastDDPStrategy(shard_optimizer="yes")
    with pytest.raises(ValueError, match="hook or ddp_comm_hook"):
        integration.FastDDPStrategy(hook="bf16", ddp_comm_hook=lambda state, bucket: None)
