"""``python -m fastddp --shard-optimizer`` on an unmodified script with AdamW, a schedule and
torch.nn.utils.clip_grad_norm_ (tests/python/scripts/train_adamw_clip.py), on 2 gloo ranks,
against the same script under stock torch DDP; and FASTDDP_DISABLE=1 with the flag, which
runs torch's ZeroRedundancyOptimizer (Note [sharded optimizer under the launcher])."""

from pathlib import Path

import torch

from tests.python.launch.launch_script import run_launcher

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_adamw_clip.py"


def _run(tmp_path: Path, name: str, args: list[str], disable: bool = False) -> tuple[dict, str]:
    result, code, output, cmd = run_launcher(SCRIPT, tmp_path / f"{name}.json", args,
                                             disable=disable)
    assert code == 0 and result is not None, f"{' '.join(cmd)} failed ({code}):\n{output}"
    return result, output


def _diff(a: dict, b: dict) -> float:
    return max((torch.tensor(x) - torch.tensor(y)).abs().max().item()
               for x, y in zip(a["params"], b["params"], strict=True))


def test_shard_optimizer_flag_shards_an_unmodified_script(tmp_path: Path) -> None:
    stock, _ = _run(tmp_path, "stock", [], disable=True)
    sharded, output = _run(tmp_path, "sharded", ["--shard-optimizer"])
    assert stock["optimizer"] == "torch.optim.adamw.AdamW", stock
    assert sharded["optimizer"] == "fastddp.optim.sharded.ShardedOptimizer", sharded
    assert "fastddp.optim.ShardedOptimizer" in output, output
    # The clip's norm: torch sums per parameter then over parameters, the shards per run
    # then over ranks: float32 sums in two orders, a few ulps of the norm (about 1e-8 here).
    assert all(abs(a - b) <= 1e-6 * max(1.0, b) for a, b in zip(sharded["norms"],
                                                               stock["norms"])), sharded
    # 2 ranks: the average is torch's to the bit (Note [sharded optimizer]); the clip factor
    # may differ in its last bits (above), which AdamW passes on as a relative 2^-23 of the
    # update (lr 0.01): 1e-6 over six steps is ten times that.
    assert _diff(sharded, stock) <= 1e-6, (sharded, stock)


def test_shard_optimizer_flag_with_stock_torch_runs_zero_redundancy(tmp_path: Path) -> None:
    stock, _ = _run(tmp_path, "stock", [], disable=True)
    zero, _ = _run(tmp_path, "zero", ["--shard-optimizer"], disable=True)
    assert zero["optimizer"].endswith("ZeroRedundancyOptimizer"), zero
    assert _diff(zero, stock) == 0.0  # torch's own: whole gradients, the same updates


def test_what_the_patch_shards_and_what_it_leaves(world) -> None:
    from tests.python.launch import shard_optimizer_scenarios as s
    for r in world.check(s.patched):
        assert r["sharded"] == "ShardedOptimizer" and r["restored"], r
        assert r["kept"] == "Adam" and r["part"] == "SGD", r  # not theirs to shard
        assert r["whole_norm"] > 0 and "part of them" in (r["part_clip"] or ""), r
        # why each stayed torch's, said once (printed on rank 0)
        assert any("before its model was wrapped" in n for n in r["notes"]), r
        assert any("part of a wrapped model" in n for n in r["notes"]), r
