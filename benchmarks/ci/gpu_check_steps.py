"""The steps of `make gpu-check` (benchmarks/ci/gpu_check.py), what each one's output means,
and two probes that steps run:

    python benchmarks/ci/gpu_check_steps.py env     # GPU, driver, torch, fastddp build, tools
    python benchmarks/ci/gpu_check_steps.py build   # pip install -e . only if _C needs it

Importing this module touches neither torch nor CUDA: the dry run must work anywhere.
A probe prints `gpu-check figures: {json}` (merged into the report) and, when it decided
there was nothing to do, `gpu-check skip: reason`.
"""

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # benchmarks/common/, as the scripts see it

from common.nominal_hbm import nominal_hbm_gbps  # noqa: E402

FIGURES_PREFIX = "gpu-check figures: "
SKIP_PREFIX = "gpu-check skip: "
# ViT-L/32's gradient (torchvision vit_l_32: 306.5M parameters) and the 25 and 100 MiB
# buckets the article sweeps, in float32 elements.
VIT_L32_SIZES = "6553600,26214400,306535400"


@dataclass
class Step:
    """One command of the check. `figures(output)` reads key figures from its output;
    `verdict(output, figures)` may fail a step that exited 0 (returns the reason);
    `skip_reason()` is asked just before it would run (and by the dry run)."""

    name: str
    command: list[str]
    timeout_s: float
    title: str = ""
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""
    figures: Callable[[str], dict] | None = None
    verdict: Callable[[str, dict], str | None] | None = None
    skip_reason: Callable[[], str | None] | None = None


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, else in the CUDA toolkit's folders."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(str(Path(nvcc).resolve().parent.parent))
    for home in filter(None, homes):
        for candidate in (Path(home) / "bin" / "compute-sanitizer",
                          Path(home) / "compute-sanitizer" / "compute-sanitizer"):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


# --- reading outputs -----------------------------------------------------------------

def json_figures(output: str) -> dict:
    """The last `gpu-check figures: {json}` line of an output ({} if none)."""
    for line in reversed(output.splitlines()):
        if line.startswith(FIGURES_PREFIX):
            return json.loads(line[len(FIGURES_PREFIX):])
    return {}


def table_rows(output: str) -> list[list[str]]:
    """Cells of the markdown table rows in an output (separator rows left out)."""
    rows = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("|") and line.endswith("|") and not set(line) <= set("|-: "):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def pytest_figures(output: str) -> dict:
    counts = {}
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skip|"
                                                                 r"error|deselected)", line)]
    if summary:
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|"
                                  r"xpassed)", summary[-1]):
            counts["errors" if what.startswith("error") else what] = int(n)
    counts["summary"] = ", ".join(f"{v} {k}" for k, v in counts.items()) or "no summary line"
    return counts


def pytest_verdict(output: str, figures: dict) -> str | None:
    # conftest.py skips GPU tests where no GPU is visible or _C lacks CUDA: on the GPU
    # machine a skip means the check proved nothing.
    if figures.get("skipped"):
        return f"{figures['skipped']} GPU tests skipped (no GPU visible, or _C without CUDA?)"
    if not figures.get("passed"):
        return "no test passed"
    return None


def selfcheck_figures(output: str) -> dict:
    """`python -m fastddp --check`: its table's rows that passed, all of them, its verdict."""
    lines = output.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.startswith("hook ")), len(lines))
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(line)
    ok = sum(1 for line in rows if "  ok: " in line)
    last = next((line for line in reversed(lines) if line.startswith("fastddp self-check")),
                "no verdict line")
    return {"summary": f"{ok}/{len(rows)} rows ok; {last}", "ok": ok, "rows": len(rows)}


def world1_figures(output: str) -> dict:
    found = json_figures(output)
    cases = found.get("cases", {})
    worst = max((c.get("max_rel_diff", 0.0) for c in cases.values()), default=0.0)
    failed = [k for k, c in cases.items() if c.get("result") != "pass"]
    found["summary"] = (f"{found.get('passed', 0)}/{len(cases)} cases match torch DDP; "
                        f"worst rel. grad diff {worst:.2g}"
                        + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return {"summary": found["summary"], "passed": found.get("passed"),
            "failed": found.get("failed"), "failed_cases": failed, "cases": cases}


def sanitizer_figures(output: str) -> dict:
    figures = {}
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", output)
    if errors:
        figures["sanitizer_errors"] = int(errors[-1])
    races = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, "
                      r"(\d+) warnings?\)", output)
    if races:
        figures["hazards"], figures["race_errors"], figures["race_warnings"] = map(
            int, races.groups())
    figures["nccl_probes"], figures["other_reports"] = sanitizer_errors(output)
    cases = world1_figures(output)
    parts = [f"{figures.get('sanitizer_errors', '?')} sanitizer errors "
             f"({figures['nccl_probes']} of them NCCL start-up probes)"]
    if races:
        parts.append(f"{figures['hazards']} hazards ({figures['race_warnings']} warnings)")
    parts.append(cases["summary"].split(";")[0] if cases.get("cases") else "cases: no result")
    figures["cases_passed"], figures["cases_failed"] = cases.get("passed"), cases.get("failed")
    figures["summary"] = "; ".join(parts)
    return figures


# Not errors of fastddp: NCCL probes at communicator start-up which kernel images the
# device can run (cudaFuncGetAttributes / cudaGetLastError on kernels built for other
# architectures); seen on an H100 and an H200 with torch 2.11's NCCL.
NCCL_PROBE = re.compile(r"cudaErrorNoKernelImageForDevice.*?\n(?:=+ +[^\n]*\n)*?"
                        r"=+ +Host Frame: ncclInitKernelsForDevice", re.S)


def sanitizer_errors(output: str) -> tuple[int, int]:
    """(NCCL start-up probes, other errors) among the reports compute-sanitizer printed.
    Each report starts with a '========= ' line that is not indented and not a summary."""
    reports = re.split(r"\n(?==+ (?=\S)(?!(?:COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK "
                       r"SUMMARY|LEAK SUMMARY|Target application)))", "\n" + output)[1:]
    reports = [r for r in reports if r.startswith("=")]
    probes = sum(1 for r in reports if NCCL_PROBE.search(r))
    return probes, len(reports) - probes


def sanitizer_verdict(output: str, figures: dict) -> str | None:
    if "race_errors" in figures:  # racecheck ends with its own summary line
        return (f"{figures['race_errors']} race errors" if figures["race_errors"] else None)
    if "sanitizer_errors" not in figures:
        return "no ERROR SUMMARY line: compute-sanitizer did not finish its report"
    probes, other = figures.get("nccl_probes", 0), figures["sanitizer_errors"]
    if other - probes > 0:
        return f"{other - probes} sanitizer errors besides {probes} NCCL start-up probes"
    return None


def kernels_figures(output: str) -> dict:
    """benchmarks/kernels.py: per kernel at the largest size, fastddp GB/s, % of HBM, % of
    a device-to-device copy of the same elements and the speed-up over torch; the range
    of the orthogonalization speed-ups."""
    half, ortho = {}, []
    copy = {int(n.replace(",", "")): float(g) for n, g in
            re.findall(r"^copy float32 ([\d,]+): ([\d.]+) GB/s", output, re.M)}
    for row in table_rows(output):
        if len(row) >= 5 and row[1].replace(",", "").isdigit() and row[3]:
            n = int(row[1].replace(",", ""))
            if row[0] not in half or n >= half[row[0]]["elements"]:
                half[row[0]] = {"elements": n, "fastddp_gbps": float(row[2]),
                                "torch_gbps": float(row[3]), "speedup": row[4],
                                "of_hbm": row[5] if len(row) > 5 else None}
                # The quant8 sizes are rounded down to whole blocks: the nearest copy.
                near = min(copy, key=lambda c: abs(c - n), default=None)
                if near is not None:
                    half[row[0]]["of_copy"] = round(float(row[2]) / copy[near], 3)
        elif len(row) == 5 and row[0].startswith("("):
            ortho.append({"shape": row[0], "fastddp_us": float(row[1]),
                          "torch_us": float(row[2]), "speedup": float(row[3].rstrip("x"))})
    parts = [f"{k} {v['fastddp_gbps']:.0f} GB/s" + (f" ({v['of_hbm']} HBM)" if v["of_hbm"]
                                                     else "")
             + (f" ({100 * v['of_copy']:.0f}% of copy)" if "of_copy" in v else "")
             + f", {v['speedup']} torch" for k, v in half.items()]
    if ortho:
        ups = [o["speedup"] for o in ortho]
        parts.append(f"ortho {min(ups):.2g}x-{max(ups):.2g}x torch")
    return {"summary": "; ".join(parts) or "no table", "half": half, "ortho": ortho,
            "copy_gbps": copy}


def powersgd_figures(output: str) -> dict:
    times = {row[0]: float(row[1]) for row in table_rows(output)
             if len(row) == 3 and re.fullmatch(r"[\d.]+", row[1])}
    native = times.get("fastddp native powersgd")
    theirs = times.get("torch powerSGD_hook")
    summary = "no table"
    if native and theirs:
        summary = (f"hook time per step: native {native:.2f} ms, torch {theirs:.2f} ms "
                   f"({theirs / native:.2f}x)")
    return {"summary": summary, "ms": times}


def reducer_cost_figures(output: str) -> dict:
    """benchmarks/reducer_cost.py: per group, each variant's step time relative to bare."""
    groups: dict[str, dict[str, float]] = {}
    for row in table_rows(output):
        if len(row) == 5 and re.fullmatch(r"[\d.]+", row[3]):
            groups.setdefault(row[0], {})[row[1]] = float(row[3])
    parts = [f"{g}: fastddp {v['fastddp']:.3f}x bare, torch {v['torch DDP']:.3f}x"
             for g, v in groups.items() if "fastddp" in v and "torch DDP" in v]
    return {"summary": "; ".join(parts) or "no table", "vs_bare": groups}


def article_figures(output: str) -> dict:
    ratios, na = {}, []
    for row in table_rows(output):
        if len(row) == 7 and row[1].isdigit():
            if re.fullmatch(r"[\d.]+", row[4]):
                ratios[row[0]] = float(row[4])
            elif "n/a" in row[2] + row[3]:
                na.append(row[0])
    summary = "no table"
    if ratios:
        values = sorted(ratios.values())
        summary = (f"fastddp/torch steps/s over {len(values)} configs: min {values[0]:.3f}, "
                   f"median {statistics.median(values):.3f}, max {values[-1]:.3f}")
        if na:
            summary += f"; n/a: {len(na)}"
    return {"summary": summary, "fastddp_over_torch": ratios, "not_available": na}


# --- the steps -------------------------------------------------------------------------

def default_steps(out_dir: Path, python: str = sys.executable) -> list[Step]:
    """What has never been measured first (issue 55): after the build, the reducer's cost and
    the kernels on real bucket shapes, then the GPU tests that never ran on a GPU, then the
    self-check and the rest; the budget cuts the later benchmarks, not those figures."""
    here = "benchmarks/ci/gpu_check_steps.py"
    world1 = "tests/python/hooks/world1_hooks_scenarios.py"
    sanitizer = find_sanitizer()

    def sanitized(tool: str) -> Step:
        return Step(
            f"sanitizer-{tool}",
            # No --error-exitcode: NCCL's start-up probes are API errors the sanitizer
            # counts too; sanitizer_verdict() tells them from fastddp's own.
            [sanitizer or "compute-sanitizer", "--tool", tool,
             "--target-processes", "all", "--print-limit", "100",
             python, world1, "--device", "cuda", "--backend", "nccl", "--steps", "3",
             "--configs", "plain", "--exit-zero"],
            150, f"compute-sanitizer {tool}: a short world-size-1 training with each hook "
            "(its grads against torch are the nccl-world1 step's verdict)",
            # Every tensor its own cudaMalloc, so that memcheck sees the true bounds.
            env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
            figures=sanitizer_figures, verdict=sanitizer_verdict,
            skip_reason=lambda: None if sanitizer else (
                "compute-sanitizer is not on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin"))

    return [
        Step("env", [python, here, "env"], 60,
             "GPU, driver, torch and CUDA versions, fastddp.build_info(), tools"),
        Step("build", [python, here, "build"], 420,
             "pip install --no-build-isolation -e . if _C is missing, lacks CUDA or was "
             "built against another torch", note="MAX_JOBS: $MAX_JOBS, else all cores"),
        Step("reducer-cost", [python, "benchmarks/reducer_cost.py", "--device", "cuda",
                              "--profile"], 180,
             "GPT-style model (216.7M parameters) at world size 1, reducer forced: bare vs "
             "fastddp vs torch DDP, default / gbv / bf16 hook / PowerSGD r4",
             env={"FASTDDP_WORLD1_REDUCER": "1"}, figures=reducer_cost_figures),
        Step("kernels", [python, "benchmarks/kernels.py", "--device", "cuda", "--sizes",
                         VIT_L32_SIZES], 150,
             "half casts, 8-bit codes and orthogonalization vs torch at ViT-L/32 sizes "
             "(GB/s vs HBM)",
             figures=kernels_figures),
        Step("pytest-gpu",
             [python, "-m", "pytest", "-m", "gpu", "tests/python", "-q", "-p",
              "no:cacheprovider", "-rfEs", "--durations=15", "--deselect",
              "tests/python/hooks/test_world1_hooks.py::test_world1_hooks_nccl"],
             240, "every GPU-marked test (the world-size-1 NCCL one is the next step)",
             figures=pytest_figures, verdict=pytest_verdict),
        Step("self-check", [python, "-m", "fastddp", "--check"], 120,
             "python -m fastddp --check: the environment, the build's libstdc++, every hook "
             "against torch DDP on the CPU and on each GPU", figures=selfcheck_figures),
        Step("nccl-world1", [python, world1, "--device", "cuda", "--backend", "nccl"], 150,
             "NCCL at world size 1, FASTDDP_WORLD1_REDUCER=1: every hook against torch DDP",
             figures=world1_figures),
        Step("powersgd-hook", [python, "benchmarks/powersgd.py", "--device", "cuda",
                               "--parts", "a", "--world", "1", "--rounds", "6"], 180,
             "native PowerSGD vs torch's powerSGD_hook on ViT-L/32 gradients, world size 1",
             note="parts (b) and (c) need 2 ranks (on one GPU they would fall back to gloo): "
                  "not run", figures=powersgd_figures),
        sanitized("memcheck"),
        sanitized("racecheck"),
        Step("article", [python, "benchmarks/article.py", "--device", "cuda", "--quick",
                         "--out", str(out_dir / "article")], 300,
             "the article's configurations at world size 1 (ViT-L/32, NCCL), torch vs fastddp",
             # fastddp's full reducer path, as torch always builds its own: a fair comparison.
             env={"FASTDDP_WORLD1_REDUCER": "1"}, figures=article_figures),
    ]


# --- probes ----------------------------------------------------------------------------

def _run(cmd: list[str], timeout: float = 60) -> tuple[int, str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, str(e)
    return done.returncode, (done.stdout + done.stderr).strip()


def _fastddp_build_info() -> tuple[dict | None, str]:
    """build_info() from a fresh interpreter (a stale _C may not even load)."""
    rc, out = _run([sys.executable, "-c", "import json, fastddp; "
                    "print(json.dumps(fastddp.build_info()))"])
    if rc != 0:
        return None, out.splitlines()[-1] if out else f"exit code {rc}"
    return json.loads(out.splitlines()[-1]), ""


def probe_env() -> int:
    figures: dict = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
    smi = shutil.which("nvidia-smi")
    if smi:
        rc, out = _run([smi])
        print(out + "\n")
        rc, out = _run([smi, "--query-gpu=name,driver_version,memory.total",
                        "--format=csv,noheader"])
        figures["nvidia_smi"] = out if rc == 0 else f"failed: {out}"
    else:
        figures["nvidia_smi"] = "not found"
    import torch

    figures.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                   cuda_available=torch.cuda.is_available())
    if figures["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        figures.update(device=props.name, devices=torch.cuda.device_count(),
                       capability=f"{props.major}.{props.minor}",
                       memory_gib=round(props.total_memory / 2**30, 1),
                       sms=props.multi_processor_count,
                       nominal_hbm_gbps=nominal_hbm_gbps(props.name))
        clock, width = (getattr(props, a, None) for a in ("memory_clock_rate",
                                                          "memory_bus_width"))
        if clock and width:  # kHz, bits; double data rate
            figures["derived_hbm_gbps"] = round(2 * clock * 1e3 * width / 8 / 1e9, 1)
    info, why = _fastddp_build_info()
    figures["fastddp_build_info"] = info if info is not None else f"does not import: {why}"
    figures["compute_sanitizer"] = find_sanitizer() or "not found"
    rc, out = _run(["nvcc", "--version"]) if shutil.which("nvcc") else (-1, "not found")
    figures["nvcc"] = out.splitlines()[-1] if rc == 0 else "not found"
    for key, value in figures.items():
        print(f"{key}: {value}")
    bandwidth = figures.get("nominal_hbm_gbps")
    figures["summary"] = (
        f"{figures.get('device', 'NO GPU')}, {figures.get('memory_gib', '?')} GiB, HBM "
        f"{bandwidth or '?'} GB/s (nominal); torch {figures['torch']} CUDA "
        f"{figures['torch_cuda']}; fastddp cuda="
        f"{info.get('cuda') if info else 'not built'}")
    print(FIGURES_PREFIX + json.dumps(figures))
    if not figures["cuda_available"]:
        print("no CUDA GPU is visible to torch")
        return 1
    return 0


def probe_build() -> int:
    import torch

    info, why = _fastddp_build_info()
    if info is None:
        reason = f"fastddp._C does not import ({why})"
    elif not info.get("cuda"):
        reason = "fastddp._C was built without CUDA"
    elif info.get("built_with_torch") != torch.__version__:
        reason = f"fastddp._C was built against torch {info.get('built_with_torch')}"
    else:
        summary = (f"already built: CUDA {info.get('cuda_version')}, against torch "
                   f"{info.get('built_with_torch')}")
        print(FIGURES_PREFIX + json.dumps({"summary": summary, **info}))
        print(SKIP_PREFIX + f"fastddp._C is built with CUDA {info.get('cuda_version')} "
              f"against torch {torch.__version__}")
        return 0
    jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
    print(f"building: {reason}; MAX_JOBS={jobs}", flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
           "--no-index", "-v", "-e", "."]
    rc = subprocess.call(cmd, cwd=REPO, env={**os.environ, "MAX_JOBS": jobs})
    if rc != 0:
        print(f"pip install failed with exit code {rc}")
        return rc
    info, why = _fastddp_build_info()
    summary = (f"built ({reason}): CUDA {info.get('cuda')} {info.get('cuda_version')}"
               if info else f"built ({reason}), but it does not import: {why}")
    print(FIGURES_PREFIX + json.dumps({"summary": summary, **(info or {})}))
    if info is None or not info.get("cuda"):
        print(f"after the build, fastddp.build_info() is {info or why}: no CUDA")
        return 1
    return 0


if __name__ == "__main__":
    probes = {"env": probe_env, "build": probe_build}
    if len(sys.argv) != 2 or sys.argv[1] not in probes:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(probes)}")
    sys.exit(probes[sys.argv[1]]())
