"""benchmarks/ci/suite_cpu.py (issue 52's per-test CPU report) on a pytest run of its own:
CPU burnt by a child is the test's that burnt it, whether the child was reaped by then or is
still alive, and reaping it later adds nothing to the later test."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# Each child burns 1 s of its own CPU time (time.process_time), then says so.
BURN = ("import sys, time\nstart = time.process_time()\n"
        "while time.process_time() - start < 1.0: pass\nprint('burnt', flush=True)\n")
TESTS = f'''
import subprocess, sys, time
BURN = {BURN!r}
LIVE = []

def test_reaped_child():
    subprocess.run([sys.executable, "-c", BURN], check=True)

def test_idle():
    time.sleep(0.3)

def test_live_child():
    child = subprocess.Popen([sys.executable, "-c", BURN + "time.sleep(120)"],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "burnt\\n"
    LIVE.append(child)

def test_reap_it():
    LIVE[0].kill()
    LIVE[0].wait()
'''


def test_cpu_goes_to_the_test_that_burnt_it(tmp_path: Path) -> None:
    (tmp_path / "test_burn.py").write_text(TESTS)
    report = tmp_path / "cpu.tsv"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "benchmarks.ci.suite_cpu", "--cpu-report", str(report),
                           str(tmp_path / "test_burn.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[suite_cpu] 4 tests" in done.stdout, done.stdout
    rows = {line.split("\t")[0].split("::")[1]: float(line.split("\t")[2])
            for line in report.read_text().splitlines()[1:]}
    # Each burner used at least 1.0 s of CPU by its own clock; /proc and rusage count in
    # 10 ms ticks, so 0.05 s below covers their rounding. Its interpreter's start adds some
    # 0.05 s; 2.0 s above would mean a count taken twice.
    assert 0.95 <= rows["test_reaped_child"] < 2.0, rows
    assert 0.95 <= rows["test_live_child"] < 2.0, rows
    # Sleeping, and killing a child whose CPU was counted already, cost pytest's own
    # bookkeeping only (a few ms); 0.5 s is far below the 1 s a recount would add.
    assert rows["test_idle"] < 0.5, rows
    assert rows["test_reap_it"] < 0.5, rows
