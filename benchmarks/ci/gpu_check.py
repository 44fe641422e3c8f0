"""`make gpu-check`: everything that proves fastddp on a machine with one GPU, in one command.

    python benchmarks/ci/gpu_check.py [--out DIR] [--budget 480] [--steps a,b] [--skip a,b]
                                      [--dry-run] [--verbose]

Runs named steps (benchmarks/ci/gpu_check_steps.py: environment, build if needed, the GPU
tests, NCCL at world size 1 with every hook, compute-sanitizer, kernel, PowerSGD and
article benchmarks), each a subprocess with its own timeout, and writes one report to DIR:
gpu_check.md (a table: step, command, status, wall time, key figures), gpu_check.json (the
same with the tail of each step's output) and gpu_check.log (every step's full output).

Every step runs whatever happened before it. The total budget (default 480 s: issue 32's
8 minutes, inside a 10-minute command) caps each step's timeout; steps that find less than
MIN_START_S left, and a step the budget cuts short, are reported "not run: out of time"
(never "fail": the budget, not the step, stopped it). Exit code: 0 all passed (or skipped),
1 some step failed, 2 none failed but some were not run. --dry-run lists the steps and
writes the report with every step "dry run", running nothing and touching no GPU.
"""

import argparse
import datetime
import functools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpu_check_steps import FIGURES_PREFIX, REPO, SKIP_PREFIX, Step, default_steps, json_figures

__all__ = ["Step", "run_steps", "main"]

DEFAULT_BUDGET_S = 480.0
MIN_START_S = 15.0  # a step is not started with less than this left (or its own timeout)
TAIL_CHARS = 4000  # of each step's output, in gpu_check.json
PASS, FAIL, SKIP, NOT_RUN, DRY = "pass", "fail", "skip", "not run: out of time", "dry run"
PENDING = "pending"  # not reached yet: what a report shows of a run killed from outside


def shown_command(step: Step) -> str:
    """The command as a person would type it: env settings first, `python` for this
    interpreter."""
    words = ["python" if w == sys.executable else w for w in step.command]
    env = [f"{k}={shlex.quote(v)}" for k, v in step.env.items()]
    return " ".join(env + [shlex.join(words)])


def _pump(stream, chunks: list[str], log, echo: bool) -> None:
    for raw in iter(stream.readline, b""):
        text = raw.decode("utf-8", errors="replace")
        chunks.append(text)
        log.write(text)
        log.flush()
        if echo:
            sys.stdout.write(text)
            sys.stdout.flush()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's own process group (it runs in a session of its own), then
    SIGKILL: the processes it spawned (torch ranks) go too."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(step: Step, limit_s: float, cwd: Path, log, verbose: bool = False) -> dict:
    """Runs one step for at most `limit_s`; its status, reason, wall time, figures, tail."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.env}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "python"),
                                                      env.get("PYTHONPATH")]))
    log.write(f"\n===== {step.name}: {shown_command(step)} (limit {limit_s:.0f} s)\n")
    log.flush()
    start = time.monotonic()
    try:
        proc = subprocess.Popen(step.command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        return {"status": FAIL, "reason": f"could not start: {e}", "wall_s": 0.0,
                "returncode": None, "figures": {}, "output_tail": ""}
    chunks: list[str] = []
    reader = threading.Thread(target=_pump, args=(proc.stdout, chunks, log, verbose),
                              daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(proc)
    reader.join(timeout=10)
    wall = time.monotonic() - start
    output = "".join(chunks)
    try:
        figures = step.figures(output) if step.figures else json_figures(output)
    except Exception as e:  # a report must come out even when an output is unexpected
        figures = {"figures_error": f"{type(e).__name__}: {e}"}
    skip = [line[len(SKIP_PREFIX):] for line in output.splitlines()
            if line.startswith(SKIP_PREFIX)]
    if timed_out and limit_s < step.timeout_s:
        status, reason = NOT_RUN, f"cut after {limit_s:.0f} s: the total budget ran out"
    elif timed_out:
        status, reason = FAIL, f"timed out after {limit_s:.0f} s"
    elif proc.returncode != 0:
        status, reason = FAIL, f"exit code {proc.returncode}"
    elif skip:
        status, reason = SKIP, skip[-1]
    else:
        reason = step.verdict(output, figures) if step.verdict else None
        status, reason = (FAIL, reason) if reason else (PASS, "")
    log.write(f"===== {step.name}: {status} {reason} ({wall:.1f} s)\n")
    tail = output[-TAIL_CHARS:]
    if len(output) > TAIL_CHARS:
        tail = tail.partition("\n")[2]  # whole lines only
    return {"status": status, "reason": reason, "wall_s": round(wall, 1),
            "returncode": proc.returncode, "figures": figures, "output_tail": tail}


def run_steps(steps: list[Step], out_dir: Path, budget_s: float = DEFAULT_BUDGET_S,
              dry_run: bool = False, verbose: bool = False, min_start_s: float = MIN_START_S,
              cwd: Path = REPO) -> dict:
    """Runs every step in order (none stops the others) and returns the report. The
    report in `out_dir` is rewritten after every step, so that a run killed from outside
    still leaves one (the steps it did not reach say "pending")."""
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows = [{"name": s.name, "title": s.title, "command": shown_command(s), "argv": s.command,
             "env": s.env, "timeout_s": s.timeout_s, "note": s.note, "status": PENDING,
             "reason": "", "wall_s": None, "returncode": None, "figures": {},
             "output_tail": ""} for s in steps]
    report = _report(rows, started, budget_s, dry_run, out_dir)
    with open(out_dir / "gpu_check.log", "w") as log:
        for i, (step, row) in enumerate(zip(steps, rows), 1):
            left = budget_s - (time.monotonic() - started)
            if dry_run:
                why = step.skip_reason() if step.skip_reason else None
                outcome = {"status": DRY, "reason": f"would skip: {why}" if why else ""}
            elif left < min(min_start_s, step.timeout_s):
                outcome = {"status": NOT_RUN,
                           "reason": f"{max(left, 0):.0f} s of the {budget_s:.0f} s budget left"}
            elif step.skip_reason and (why := step.skip_reason()):
                outcome = {"status": SKIP, "reason": why}
            else:
                print(f"[gpu-check] {i}/{len(steps)} {step.name}: {row['command']} "
                      f"(limit {min(step.timeout_s, left):.0f} s)", flush=True)
                outcome = run_one(step, min(step.timeout_s, left), cwd, log, verbose)
            row.update(outcome)
            if not dry_run:
                summary = row["figures"].get("summary", "")
                reason = f" ({row['reason']})" if row["reason"] else ""
                wall = f", {row['wall_s']} s" if row["wall_s"] is not None else ""
                print(f"[gpu-check] {step.name}: {row['status']}{reason}{wall}: {summary}",
                      flush=True)
                report = _report(rows, started, budget_s, dry_run, out_dir)
    return _report(rows, started, budget_s, dry_run, out_dir) if dry_run else report


def _report(rows: list[dict], started: float, budget_s: float, dry_run: bool,
            out_dir: Path) -> dict:
    """The report as it stands, written to gpu_check.json and gpu_check.md."""
    counts = {s: sum(r["status"] == s for r in rows)
              for s in (PASS, FAIL, SKIP, NOT_RUN, PENDING, DRY)}
    report = {
        "written": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(), "commit": _commit(), "dry_run": dry_run,
        "budget_s": budget_s, "used_s": round(time.monotonic() - started, 1),
        "counts": counts, "exit_code": exit_code(rows), "steps": rows,
    }
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "gpu_check.md").write_text(markdown(report))
    return report


def exit_code(results: list[dict]) -> int:
    if any(r["status"] == FAIL for r in results):
        return 1
    return 2 if any(r["status"] in (NOT_RUN, PENDING) for r in results) else 0


@functools.cache
def _commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(report: dict) -> str:
    c = report["counts"]
    head = ("dry run: nothing was executed" if report["dry_run"] else
            f"{c[PASS]} passed, {c[FAIL]} failed, {c[SKIP]} skipped, {c[NOT_RUN]} not run "
            f"(out of time)" + (f", {c[PENDING]} pending" if c[PENDING] else "")
            + f"; exit code {report['exit_code']}")
    out = ["# fastddp GPU check", "",
           f"{report['written']} on {report['host']}, fastddp at {report['commit']}; "
           f"budget {report['budget_s']:.0f} s, used {report['used_s']:.0f} s. {head}.", "",
           "Full output of every step: gpu_check.log; figures and output tails: "
           "gpu_check.json.", "",
           "| step | command | timeout s | status | wall s | key figures |",
           "|---|---|---:|---|---:|---|"]
    for r in report["steps"]:
        status = r["status"] + (f": {r['reason']}" if r["reason"] else "")
        figures = r["figures"].get("summary", "") or r["title"]
        if r["note"]:
            figures += f" ({r['note']})"
        wall = "-" if r["wall_s"] is None else r["wall_s"]
        out.append(f"| {r['name']} | `{_cell(r['command'])}` | {r['timeout_s']:.0f} | "
                   f"{_cell(status)} | {wall} | {_cell(figures)} |")
    failed = [r for r in report["steps"] if r["status"] == FAIL]
    for r in failed:
        lines = [line for line in r["output_tail"].splitlines()
                 if not line.startswith(FIGURES_PREFIX)]  # in the table and the JSON already
        tail = "\n".join(lines[-40:])
        out += ["", f"## {r['name']}: {r['reason']}", "", "```", tail, "```"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "build" / "gpu-check"),
                        help="report folder (default: build/gpu-check)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="total seconds for all steps (default: %(default)s)")
    parser.add_argument("--steps", default="", help="run only these steps (comma-separated)")
    parser.add_argument("--skip", default="", help="leave these steps out (comma-separated)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the steps and write the report; run nothing")
    parser.add_argument("--verbose", action="store_true", help="echo every step's output")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    steps = default_steps(out)
    names = [s.name for s in steps]
    only, skip = ([n for n in text.split(",") if n] for text in (args.steps, args.skip))
    unknown = [n for n in only + skip if n not in names]
    if unknown:
        parser.error(f"unknown step {', '.join(unknown)}; steps: {', '.join(names)}")
    steps = [s for s in steps if (not only or s.name in only) and s.name not in skip]
    report = run_steps(steps, out, args.budget, dry_run=args.dry_run, verbose=args.verbose)
    print()
    print((out / "gpu_check.md").read_text(), end="")
    print(f"\nreport: {out / 'gpu_check.md'}, {out / 'gpu_check.json'}")
    return 0 if args.dry_run else report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
