"""The gpu-check's readers on real outputs of its steps: the H100 visit of 2026-11-26
(`make gpu-check`, torch 2.11.0+cu130), kept verbatim in outputs/. A reader that breaks on
what a GPU prints loses the figures of a visit that cannot be repeated at will."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks" / "ci"))

import gpu_check_steps as steps  # noqa: E402

OUTPUTS = Path(__file__).resolve().parent / "outputs"


def output(step: str) -> str:
    return (OUTPUTS / f"h100_{step}.txt").read_text()


def test_kernels_against_the_copy_of_the_same_run():
    f = steps.kernels_figures(output("kernels"))
    assert "figures_error" not in f
    assert f["copy_gbps"] == {6_553_600: 1864.1, 26_214_400: 2552.3, 306_535_400: 2962.6}
    half = f["half"]
    assert half["compress"]["fastddp_gbps"] == 2768.2
    assert half["compress"]["of_copy"] == round(2768.2 / 2962.6, 3)
    # The quant8 table: sizes rounded to whole blocks of 256 still find their copy.
    assert half["quantize int8"]["elements"] == 306_535_168
    assert half["quantize int8"]["of_copy"] == round(901.3 / 2962.6, 3)
    # torch's bf16 cast is a scale line of one column, not a kernel with a speed-up.
    assert "torch x.to(bfloat16)" not in half
    assert [o["speedup"] for o in f["ortho"]][:2] == [1.94, 5.81]
    assert "decompress 1825 GB/s (54% HBM) (62% of copy), 0.94x torch" in f["summary"]


def test_memcheck_tells_nccl_probes_from_errors():
    out = output("sanitizer-memcheck")
    f = steps.sanitizer_figures(out)
    assert (f["sanitizer_errors"], f["nccl_probes"], f["other_reports"]) == (8, 8, 0)
    assert f["cases_passed"] == 13
    assert steps.sanitizer_verdict(out, f) is None
    # One report that is not NCCL's start-up probing fails the step.
    bad = out.replace("========= ERROR SUMMARY: 8 errors",
                      "========= Invalid __global__ read of size 4 bytes\n"
                      "=========     at fastddp::decompress_kernel+0x40\n"
                      "========= ERROR SUMMARY: 9 errors")
    g = steps.sanitizer_figures(bad)
    assert (g["nccl_probes"], g["other_reports"]) == (8, 1)
    assert steps.sanitizer_verdict(bad, g) == "1 sanitizer errors besides 8 NCCL start-up probes"


def test_racecheck_ends_with_its_own_summary():
    out = output("sanitizer-racecheck")
    f = steps.sanitizer_figures(out)
    assert (f["hazards"], f["race_errors"], f["cases_passed"]) == (0, 0, 13)
    assert steps.sanitizer_verdict(out, f) is None
    raced = out.replace("(0 errors, 0 warnings)", "(2 errors, 0 warnings)")
    assert steps.sanitizer_verdict(raced, steps.sanitizer_figures(raced)) == "2 race errors"


def test_reducer_cost_and_powersgd():
    f = steps.reducer_cost_figures(output("reducer-cost"))
    assert f["vs_bare"]["default"] == {"bare": 1.0, "fastddp": 1.16, "torch DDP": 1.21}
    assert f["vs_bare"]["powersgd"]["fastddp"] == 1.567
    assert f["summary"].startswith("default: fastddp 1.160x bare, torch 1.210x")
    p = steps.powersgd_figures(output("powersgd-hook"))
    assert p["ms"] == {"fastddp native powersgd": 21.42, "torch powerSGD_hook": 90.58}


@pytest.mark.parametrize("step,summary", [
    ("nccl-world1", "26/26 cases match torch DDP"),
    ("self-check", "9/10 rows ok"),
])
def test_other_readers(step, summary):
    reader = {"nccl-world1": steps.world1_figures, "self-check": steps.selfcheck_figures}[step]
    assert reader(output(step))["summary"].startswith(summary)
