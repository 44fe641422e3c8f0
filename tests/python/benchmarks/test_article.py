"""benchmarks/article.py: its CPU mode end to end on a tiny model (2 real gloo ranks), and
the projection arithmetic of fastddp.launch.report with hand-computed numbers."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastddp
from fastddp.launch.report import format_projection, projected_step_ms, ring_allreduce_ms

ROOT = Path(__file__).resolve().parents[3]
ARTICLE = ROOT / "benchmarks" / "article.py"
PACKAGE_DIR = Path(fastddp.__file__).resolve().parents[1]


def _article_module():
    spec = importlib.util.spec_from_file_location("article", ARTICLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ring_allreduce_cost() -> None:
    # pytest.approx's default (1e-6 relative) here and below: float64 arithmetic on decimal
    # figures against the hand-worked results differs only by decimal-to-binary rounding.
    # 2(n-1)/n * S / B: 1.2 GB over 8 ranks at 3 GB/s is 0.7 s; one rank moves nothing.
    assert ring_allreduce_ms(1.2e9, 8, 3.0) == pytest.approx(700.0)
    assert ring_allreduce_ms(1e9, 2, 100.0) == pytest.approx(10.0)
    assert ring_allreduce_ms(1e9, 1, 3.0) == 0.0
    with pytest.raises(ValueError):
        ring_allreduce_ms(1e9, 8, 0.0)


def test_projected_step() -> None:
    # One bucket: everything exposed. 4 buckets: the larger of the last bucket's share
    # and what backward cannot hide.
    assert projected_step_ms(100.0, 5.0, 1.2e9, 8, 3.0) == pytest.approx(805.0)
    assert projected_step_ms(100.0, 0.0, 1.2e9, 8, 3.0, overlap_ms=60.0, buckets=4) == (
        pytest.approx(100.0 + 640.0))
    assert projected_step_ms(100.0, 0.0, 1.2e9, 8, 3.0, overlap_ms=600.0, buckets=4) == (
        pytest.approx(100.0 + 175.0))
    table = format_projection(
        [{"name": "fp32", "compute_ms": 100.0, "kernel_ms": 0.0, "wire_bytes": 1.2e9,
          "reported": {(8, "PCIe"): "1.43"}}],
        [2, 8], [("PCIe", 3.0)], "title")
    row = table.splitlines()[-1]
    assert row == "| fp32 | 1200.0 | 100.0 | 2.00 | 1.25 (article: 1.43) |", row


def test_wire_bytes_follow_torch_powersgd_rule() -> None:
    article = _article_module()
    params = [torch.zeros(100, 50), torch.zeros(100), torch.zeros(3, 2), torch.zeros(8, 4, 3, 3)]
    total, psgd = article.wire_bytes(params)
    assert total == 4 * (5000 + 100 + 6 + 288)
    # 100x50 compresses to 150 floats; the vector, the 3x2 (5*2 >= 6) and the 8x36 conv
    # (44*2 < 288, compressed to 44) follow torch's min_compression_rate of 2.
    assert psgd == 4 * (150 + 100 + 6 + 44)


def test_cpu_mode_on_a_tiny_config(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_DIR), OMP_NUM_THREADS="1")
    env.pop("FASTDDP_DISABLE", None)
    cmd = [sys.executable, str(ARTICLE), "--device", "cpu", "--model", "tiny", "--warmup", "1",
           "--rounds", "1", "--steps", "2", "--project-n", "2,8", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    configs = _article_module().configurations((1,))
    # A progress line per configuration, in order.
    progress = re.findall(r"^\[(\d+)/(\d+)\] (.*?):", proc.stdout, re.MULTILINE)
    assert [name for _, _, name in progress] == [c.name for c in configs]
    md = (tmp_path / "article_cpu_tiny.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| ")]
    by_name = {r.split(" | ")[0][2:]: r.split(" | ") for r in rows}
    baseline = by_name["no DDP (bare model, 1 process): baseline"]
    assert float(baseline[2]) > 0
    for cfg in configs:
        cells = by_name[cfg.name]
        for cell in cells[2:4]:  # torch and fastddp: a rate or the reason it is missing
            assert cell.startswith("n/a (") or float(cell) > 0, cells
        if cfg.hook is None and not cfg.kwargs.get("static_graph"):
            assert float(cells[3]) > 0, f"fastddp must run {cfg.name}: {cells}"
        if cfg.hook is not None and cfg.hook.name != "bf16-fp32acc":
            assert float(cells[2]) > 0, f"torch must run {cfg.name}: {cells}"
    assert "PROJECTION, not a measurement" in md and "2(n-1)/n * S / B" in md
    assert "(article: 7.5)" in md and "(article: 5.04)" not in md
    png = tmp_path / "article_cpu_tiny.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "chart skipped: matplotlib is not installed" in output
