"""How benchmarks/quality.py --write-table merges one run into the quality table
(python/fastddp/tuning/quality_table.py) instead of rewriting it from that run alone: a run
of a few configurations (issue 47's periodic ones) keeps every row measured before.

A task's entry has one main run (its ``steps`` and ``ranks``): a run with the same settings
replaces the rows it measured and adds its new ones. A run with other settings (more steps,
so that DiLoCo at H = 100 syncs several times) adds only the rows the entry lacks, each with
its run's settings and fp32 final score in ``other_runs``: its ``reaches_fp32_at`` step is
against that score, not the main run's. ``bytes_per_step`` is what one rank sent per step
(counted; None where nothing counted)."""

import os
import pprint


def read(path: str, name: str = "QUALITY") -> dict:
    """The ``name`` literal of an existing generated table (quality.py's QUALITY,
    diloco_small.py's SMALL_JOBS), {} where there is none."""
    if not os.path.exists(path):
        return {}
    scope: dict = {}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), scope)  # a file a benchmark generated
    return scope.get(name, {})


def merge(old: dict, new: dict) -> dict:
    """`new`: task -> an entry of one run (every key of the module's docstring but
    other_runs). Returns the merged table; `old` is left as it was."""
    table = {task: dict(entry) for task, entry in old.items()}
    for task, run in new.items():
        entry = table.get(task)
        if entry is None:
            table[task] = run
            continue
        same = (entry["steps"], entry["ranks"]) == (run["steps"], run["ranks"])
        rows = list(run["final"]) if same else [c for c in run["final"]
                                                if c not in entry["final"]]
        for key in ("final", "reaches_fp32_at", "bytes_per_step"):
            entry[key] = {**entry.get(key, {}), **{c: run[key][c] for c in rows}}
        if not same:
            entry["other_runs"] = {**entry.get("other_runs", {}), **{
                c: {"steps": run["steps"], "ranks": run["ranks"],
                    "fp32 allreduce": run["final"]["fp32 allreduce"]} for c in rows}}
    return table


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(path: str, table: dict) -> None:
    shown = os.path.relpath(os.path.abspath(path), ROOT)  # as run from the repository root
    text = ('"""Generated (do not edit) by\n\n'
            f"    python benchmarks/quality.py --write-table {shown}\n\n"
            "held-out scores of each hook on the two real-data tasks, which --advise cites\n"
            "(fastddp/tuning/quality.py); each run merged into the rows before it\n"
            "(benchmarks/common/quality_table_merge.py). The full tables:\n"
            'benchmarks/results/quality.md and diloco_quality.md."""\n\n'
            f"QUALITY = {pprint.pformat(table, width=96, sort_dicts=False)}\n")
    with open(path, "w") as f:
        f.write(text)
