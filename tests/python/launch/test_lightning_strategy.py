"""``Trainer(strategy="fastddp")`` and its hook variants, registered in Lightning's
StrategyRegistry by ``import fastddp.integrations.lightning``, started with Lightning's own
launcher (no torchrun, no ``-m fastddp``), against Lightning's ``"ddp"`` (torch's class,
torch's closest hook) on 2 CPU gloo ranks (lightning_strategy_scenarios.py). Skipped when
Lightning is not installed (``make deps-stacks``)."""

import importlib.util

import pytest
import torch

from tests.python.launch.lightning_strategy_scenarios import (FASTDDP_CLASS, SCENARIOS,
                                                              TORCH_CLASS, run_pair)
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


def test_registered_names() -> None:
    import fastddp.integrations.lightning as integration
    from lightning.pytorch.strategies import StrategyRegistry

    for name in SCENARIOS:
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, integration.FastDDPStrategy), name
    with pytest.raises(ValueError, match="unknown hook 'nope'"):
        integration.FastDDPStrategy(hook="nope")
    with pytest.raises(ValueError, match="hook or ddp_comm_hook"):
        integration.FastDDPStrategy(hook="bf16", ddp_comm_hook=lambda state, bucket: None)
