"""benchmarks/ci/gpu_check.py (`make gpu-check`) without a GPU: the dry run, and the
orchestrator on made-up steps (a failure does not stop the others, timeouts kill the
step's whole process group, the budget leaves late steps "not run: out of time": decided on a
fake clock, not timed), and the readers of the benchmarks' outputs."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks" / "ci"))

import gpu_check  # noqa: E402
import gpu_check_steps as steps  # noqa: E402
from gpu_check_steps import Step  # noqa: E402

PY = sys.executable
# The steps the check promises (README), in their order: none may silently drop out of the
# list, and what was never measured on a GPU (the reducer's cost, the kernels, the GPU
# tests) comes right after the build, before the self-check (issue 55).
PROMISED = ["env", "build", "reducer-cost", "kernels", "pytest-gpu", "self-check",
            "nccl-world1", "powersgd-hook", "sanitizer-memcheck", "sanitizer-racecheck",
            "article"]


def py(code: str) -> list[str]:
    return [PY, "-c", code]


def test_dry_run_lists_every_step_and_imports_no_torch(tmp_path):
    # In a fresh interpreter: the dry run must not import torch (so it cannot touch CUDA).
    code = ("import sys; sys.path.insert(0, 'benchmarks/ci'); import gpu_check; "
            f"rc = gpu_check.main(['--dry-run', '--out', {str(tmp_path)!r}]); "
            "assert 'torch' not in sys.modules, 'the dry run imported torch'; sys.exit(rc)")
    done = subprocess.run(py(code), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["name"] for s in report["steps"]] == PROMISED
    assert all(s["status"] == "dry run" for s in report["steps"])
    assert report["dry_run"] and report["exit_code"] == 0
    md = (tmp_path / "gpu_check.md").read_text()
    for s in report["steps"]:
        assert f"| {s['name']} | `" in md and s["command"] in done.stdout
    assert "FASTDDP_WORLD1_REDUCER=1" in md  # the article runs the full reducer path
    assert not (tmp_path / "article").exists(), "the dry run ran the article benchmark"


def test_unknown_step_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--out", str(tmp_path), "--steps", "env,nope"])
    assert "unknown step nope" in capsys.readouterr().err


def test_failures_are_reported_and_the_rest_runs(tmp_path):
    figures = {"summary": "two figures", "x": 2}
    made = [
        Step("fails", py("print('broken on purpose'); raise SystemExit(3)"), 20),
        Step("figures", py(f"print('gpu-check figures: ' + {json.dumps(json.dumps(figures))})"),
             20),
        Step("skips-itself", py("print('gpu-check skip: nothing to build')"), 20),
        Step("skipped", py("raise SystemExit(9)"), 20, skip_reason=lambda: "no tool here"),
        Step("verdict", py("print('0 passed')"), 20, verdict=lambda out, f: "no test passed"),
        Step("hangs", py(_writes_pid(tmp_path / "hangs.pid") + "time.sleep(60)"), 1),
        Step("missing", ["/nonexistent/tool"], 20),
        Step("last", py("print('still ran')"), 20),
    ]
    report = gpu_check.run_steps(made, tmp_path, budget_s=60)
    _assert_gone(tmp_path / "hangs.pid")  # the timeout stopped it, not its end
    by = {s["name"]: s for s in report["steps"]}
    assert by["fails"]["status"] == "fail" and by["fails"]["reason"] == "exit code 3"
    assert "broken on purpose" in by["fails"]["output_tail"]
    assert by["figures"]["status"] == "pass" and by["figures"]["figures"] == figures
    assert by["skips-itself"]["status"] == "skip"
    assert by["skips-itself"]["reason"] == "nothing to build"
    assert by["skipped"]["status"] == "skip" and by["skipped"]["reason"] == "no tool here"
    assert by["verdict"]["status"] == "fail" and by["verdict"]["reason"] == "no test passed"
    assert by["hangs"]["status"] == "fail" and "timed out after 1 s" in by["hangs"]["reason"]
    assert by["missing"]["status"] == "fail" and "could not start" in by["missing"]["reason"]
    assert by["last"]["status"] == "pass" and "still ran" in by["last"]["output_tail"]
    assert report["exit_code"] == 1
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## fails: exit code 3" in md and "broken on purpose" in md
    assert "| last | " in md and "two figures" in md
    log = (tmp_path / "gpu_check.log").read_text()
    assert "broken on purpose" in log and "still ran" in log


def test_report_is_rewritten_after_every_step(tmp_path):
    # What a run killed from outside leaves: the steps done so far, the rest "pending".
    peek = ("import json; r = json.load(open('gpu_check.json')); "
            "print('seen', [s['status'] for s in r['steps']])")
    made = [Step("first", py("print('ok')"), 20), Step("peek", py(peek), 20),
            Step("third", py("print('ok')"), 20)]
    report = gpu_check.run_steps(made, tmp_path, budget_s=60, cwd=tmp_path)
    assert "seen ['pass', 'pending', 'pending']" in report["steps"][1]["output_tail"]
    assert [s["status"] for s in report["steps"]] == ["pass"] * 3


def _writes_pid(path: Path) -> str:
    """Python code that writes its process id to ``path`` first."""
    return f"import os, time; open({str(path)!r}, 'w').write(str(os.getpid())); "


def _assert_gone(pid_file: Path) -> None:
    """The process whose id ``pid_file`` holds has exited (a zombie that init has not reaped
    yet counts); none written means it was stopped before it started its code."""
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    # "No hang" deadline: the step was killed already; its end takes milliseconds to show.
    deadline = time.monotonic() + 10
    while not _gone(pid):
        assert time.monotonic() < deadline, f"process {pid} outlived its step"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # still there (or a zombie not yet reaped by init)
    except ProcessLookupError:
        return True
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_timeout_kills_the_steps_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    report = gpu_check.run_steps([Step("spawns", py(code), 3)], tmp_path / "r", budget_s=30)
    step = report["steps"][0]
    assert (step["status"], step["reason"]) == ("fail", "timed out after 3 s"), step
    # 3 s for an interpreter to start and spawn one child: several times what it takes
    # with both cores busy; were it not written, there would be no child to check.
    assert pid_file.exists(), step
    _assert_gone(pid_file)


class FakeClock:
    """gpu_check's time.monotonic: a fake run_one moves it by each step's made-up time."""

    def __init__(self):
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def _fake_run(clock: FakeClock, took: dict, ran: list):
    """A stand-in for gpu_check.run_one: records the step and its limit, and takes the
    made-up seconds ``took`` gives it (cut at the limit, as a timeout would)."""
    def run_one(step, limit_s, cwd, log, verbose=False):
        ran.append((step.name, limit_s))
        clock.now += min(took[step.name], limit_s)
        cut = took[step.name] > limit_s  # by the budget: every limit here is below timeout_s
        return {"status": gpu_check.NOT_RUN if cut else "pass", "reason": "cut" if cut else "",
                "wall_s": 0.0, "returncode": None, "figures": {}, "output_tail": ""}
    return run_one


def test_budget_cuts_late_steps(tmp_path, monkeypatch):
    clock, ran = FakeClock(), []
    monkeypatch.setattr(gpu_check, "time", SimpleNamespace(monotonic=clock.monotonic))
    took = {"quick": 1.0, "slow": 30.0, "late": 0.1, "later": 0.1, "tight": 0.1}
    monkeypatch.setattr(gpu_check, "run_one", _fake_run(clock, took, ran))
    made = [Step("quick", py("print('ok')"), 20),
            # Its own timeout is 30 s, but only 2 s of the budget are left for it.
            Step("slow", py("import time; time.sleep(30)"), 30),
            Step("late", py("print('never')"), 20), Step("later", py("print('never')"), 20)]
    report = gpu_check.run_steps(made, tmp_path, budget_s=3.0, min_start_s=1.0)
    assert ran == [("quick", 3.0), ("slow", 2.0)]
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status == {"quick": "pass", "slow": "not run: out of time",
                      "late": "not run: out of time", "later": "not run: out of time"}
    assert report["steps"][2]["reason"] == "0 s of the 3 s budget left"
    assert report["exit_code"] == 2  # nothing failed; some steps did not (fully) run
    assert "not run: out of time" in (tmp_path / "gpu_check.md").read_text()
    # 0.9 s left is less than min_start_s: not started, though the step would fit.
    ran.clear()
    took["quick"] = 2.1
    tight = [made[0], Step("tight", py("print('ok')"), 20)]
    report = gpu_check.run_steps(tight, tmp_path / "t", budget_s=3.0, min_start_s=1.0)
    assert ran == [("quick", 3.0)]
    assert [s["status"] for s in report["steps"]] == ["pass", "not run: out of time"]
    # Nothing failed, something was not run: exit code 2.
    ran.clear()
    report = gpu_check.run_steps(made[:1] + made[2:3], tmp_path / "b", budget_s=0.5,
                                 min_start_s=1.0)
    assert ran == [] and [s["status"] for s in report["steps"]] == ["not run: out of time"] * 2
    assert report["exit_code"] == 2


def test_a_step_cut_by_the_budget_says_so(tmp_path):
    """run_one given less than the step's own timeout (what the budget left): killed at
    that limit, and the reason names the budget."""
    step = Step("slow", py(_writes_pid(tmp_path / "slow.pid") + "time.sleep(30)"), 30)
    with open(tmp_path / "log", "w") as log:
        row = gpu_check.run_one(step, 1.0, tmp_path, log)
    # Not a failure of the step: the report must not say "fail" (issue 32).
    assert row["status"] == "not run: out of time"
    assert row["reason"] == "cut after 1 s: the total budget ran out", row
    _assert_gone(tmp_path / "slow.pid")


# --- readers of the steps' outputs (formats as the scripts print them) ------------------

KERNELS = """\
| kernel | elements | fastddp GB/s | torch GB/s | speed-up | fastddp / HBM |
|---|---:|---:|---:|---:|---:|
| compress | 6,553,600 | 1500.0 | 900.0 | 1.67x | 45% |
| compress | 306,535,400 | 2800.0 | 1400.0 | 2.00x | 84% |

| P batch (B, n, r) | fastddp us | torch us | speed-up | fastddp GB/s |
|---|---:|---:|---:|---:|
| (24, 1024, 1) | 7.5 | 14.6 | 1.95x | 26.2 |
| (24, 4096, 8) | 32.3 | 29.9 | 0.93x | 24.4 |
"""


# Lines of real `python -m fastddp --check` outputs on this CPU machine (the FAIL and the
# ValueError rows from runs of a draft whose fp16 and hierarchical cases were wrong).
SELF_CHECK = """\
  module check      ok: uses the shared libstdc++

hook                                                 where            against         s  result
(no hook)                                            cpu, gloo x2     torch DDP    1.20  ok: equal
torch fp16_compress_hook                             cpu, gloo x2     torch DDP    0.09  ok: 0.86 of the allowed difference
fastddp.hooks.fp16()                                 cpu, gloo x4     torch DDP    0.65  FAIL: 20 of the allowed difference
fastddp.hooks.hierarchical(bf16(), local_size=1)     cpu, gloo x2     exact mean   0.00  ValueError: fastddp.hooks.hierarchical: local_size=1: with fewer than 2 ranks per node
fastddp.hooks.int8()                                 cpu, gloo x2     exact mean   0.04  ok: 0.82 of the allowed difference

fastddp self-check FAILED (2 of them, 18 s):
"""


def test_self_check_figures():
    f = steps.selfcheck_figures(SELF_CHECK)
    assert (f["ok"], f["rows"]) == (3, 5)
    assert f["summary"] == "3/5 rows ok; fastddp self-check FAILED (2 of them, 18 s):"


def test_kernel_figures():
    f = steps.kernels_figures(KERNELS)
    assert f["half"]["compress"] == {"elements": 306_535_400, "fastddp_gbps": 2800.0,
                                     "torch_gbps": 1400.0, "speedup": "2.00x", "of_hbm": "84%"}
    assert [o["speedup"] for o in f["ortho"]] == [1.95, 0.93]
    assert "compress 2800 GB/s (84% HBM), 2.00x torch" in f["summary"]


def test_pytest_figures_and_verdict():
    f = steps.pytest_figures("....s\n4 passed, 1 skipped, 12 deselected in 3.2s\n")
    assert (f["passed"], f["skipped"], f["deselected"]) == (4, 1, 12)
    assert "skipped" in steps.pytest_verdict("", f)
    assert steps.pytest_verdict("", steps.pytest_figures("5 passed in 1s")) is None
    assert steps.pytest_verdict("", steps.pytest_figures("no tests ran")) == "no test passed"


def test_sanitizer_figures():
    out = ("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
           "gpu-check figures: " + json.dumps({"passed": 2, "failed": 0, "cases": {
               "a/plain": {"result": "pass", "max_rel_diff": 0.0}}}) + "\n"
           "========= ERROR SUMMARY: 0 errors\n")
    f = steps.sanitizer_figures(out)
    assert (f["sanitizer_errors"], f["hazards"], f["cases_passed"]) == (0, 0, 2)
    assert steps.sanitizer_verdict(out, f) is None
    assert "did not finish" in steps.sanitizer_verdict("", steps.sanitizer_figures(""))


def test_powersgd_and_article_figures():
    f = steps.powersgd_figures("| variant | median ms | vs torch powerSGD_hook |\n|---|---:|---:|\n"
                               "| fastddp native powersgd | 2.00 | 0.5x |\n"
                               "| torch powerSGD_hook | 5.00 | 1.000x |\n")
    assert f["summary"] == "hook time per step: native 2.00 ms, torch 5.00 ms (2.50x)"
    table = ("| configuration | ranks | torch DDP steps/s | fastddp steps/s | fastddp / torch "
             "| torch / baseline | fastddp / baseline |\n|---|---|---|---|---|---|---|\n"
             "| no DDP (bare model, 1 process): baseline | 1 | 9.0 | 9.0 | - | 1.00 | 1.00 |\n"
             "| DDP, 1 process | 1 | 8.0 | 8.8 | 1.100 | 0.89 | 0.98 |\n"
             "| + static_graph | 1 | 8.0 | n/a (not yet) | - | 0.89 | - |\n"
             "| + BF16 hook | 1 | 8.0 | 7.6 | 0.950 | 0.89 | 0.84 |\n")
    f = steps.article_figures(table)
    assert f["fastddp_over_torch"] == {"DDP, 1 process": 1.1, "+ BF16 hook": 0.95}
    assert f["not_available"] == ["+ static_graph"]
    assert "min 0.950" in f["summary"] and "n/a: 1" in f["summary"]


def test_nominal_bandwidth_by_name():
    assert steps.nominal_hbm_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert steps.nominal_hbm_gbps("NVIDIA H100 PCIe") == 2000.0
    assert steps.nominal_hbm_gbps("NVIDIA H200") == 4800.0
    assert steps.nominal_hbm_gbps("NVIDIA GH200 480GB") == 4000.0
    assert steps.nominal_hbm_gbps("Some Other GPU") is None
