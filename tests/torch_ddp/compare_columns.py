"""Run PyTorch's DDP tests in both columns (stock torch DDP, then fastddp) and print them
side by side: test, stock result, fastddp result, DDP constructor calls, seconds.

    python tests/torch_ddp/compare_columns.py [--out DIR] [--table-only] [PYTEST ARGS, e.g. -k hook]

Both columns run the same selection (conftest.py); the fastddp column carries the xfail
marks of known_failures.txt, so a listed failure shows as ``xfail`` and a listed test that
passes as ``XPASS``. Exits non-zero when either column's pytest run did.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLUMNS = ("stock", "fastddp")


def run_column(name: str, out: Path, pytest_args: list[str]) -> tuple[int, float]:
    """One pytest run of the suite; returns (exit status, wall seconds)."""
    env = dict(os.environ, FASTDDP_DISABLE="1" if name == "stock" else "0",
               FASTDDP_TORCH_DDP_RECORD=str(out / f"{name}.jsonl"))
    (out / f"{name}.jsonl").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", str(HERE), "-q", "-p", "no:cacheprovider",
           f"--junitxml={out / f'{name}.xml'}", *pytest_args]
    print(f"[torch_ddp] {name} column: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        status = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    (out / f"{name}.wall").write_text(f"{wall:.1f}\n")
    print(f"[torch_ddp] {name} column: exit {status}, {wall:.0f} s (log {out / f'{name}.log'})",
          flush=True)
    return status, wall


def read_results(xml_path: Path) -> dict[str, tuple[str, float]]:
    """``{"Class::test": (outcome, seconds)}`` from a junit file; outcomes: passed, failed,
    error, skipped, xfail (a listed known failure that failed), XPASS (listed but passed)."""
    results: dict[str, tuple[str, float]] = {}
    if not xml_path.exists():
        return results
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag == "failure":
                outcome = "XPASS" if "XPASS" in (child.get("message") or "") else "failed"
            elif child.tag == "error":
                outcome = "error"
            elif child.tag == "skipped":
                outcome = "xfail" if child.get("type") == "pytest.xfail" else "skipped"
        results[test] = (outcome, float(case.get("time", 0.0)))
    return results


def read_calls(jsonl: Path) -> dict[str, int]:
    """DDP constructor calls per test, summed over ranks (test_torch_ddp.ColumnChecked)."""
    if not jsonl.exists():
        return {}
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return {r["test"]: r["ddp_calls"] for r in rows}


def table(out: Path) -> str:
    results = {c: read_results(out / f"{c}.xml") for c in COLUMNS}
    calls = {c: read_calls(out / f"{c}.jsonl") for c in COLUMNS}
    tests = sorted(set(results["stock"]) | set(results["fastddp"]))
    width = max([len(t) for t in tests] + [4])
    lines = [f"{'test':<{width}}  {'stock':<8} {'fastddp':<8} {'DDP() s/f':<9} {'sec s/f'}"]
    for t in tests:
        cells = [results[c].get(t, ("-", 0.0)) for c in COLUMNS]
        ddps = "/".join(str(calls[c].get(t, "-")) for c in COLUMNS)
        secs = "/".join(f"{cell[1]:.0f}" for cell in cells)
        lines.append(f"{t:<{width}}  {cells[0][0]:<8} {cells[1][0]:<8} {ddps:<9} {secs}")
    lines.append("")
    for c in COLUMNS:
        counts: dict[str, int] = {}
        for outcome, _ in results[c].values():
            counts[outcome] = counts.get(outcome, 0) + 1
        wall_file = out / f"{c}.wall"
        wall = f", wall {float(wall_file.read_text()):.0f} s" if wall_file.exists() else ""
        summary = ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
        lines.append(f"{c:>8} column: {summary or 'no results'}{wall}")
    # A passing test that never called a DDP constructor tests nothing of DDP.
    idle = [t for t in tests if results["fastddp"].get(t, ("",))[0] == "passed"
            and calls["fastddp"].get(t) == 0]
    if idle:
        lines.append(f"passed in the fastddp column without a DDP constructor call: "
                     f"{', '.join(idle)}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("build/torch_ddp"),
                        help="where the junit files, logs and counts go")
    parser.add_argument("--table-only", action="store_true",
                        help="print the table from an earlier run's files in --out")
    args, pytest_args = parser.parse_known_args()  # the rest goes to both pytest runs
    args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    if not args.table_only:
        for c in COLUMNS:
            status = max(status, run_column(c, args.out, pytest_args)[0])
    print(table(args.out))
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
