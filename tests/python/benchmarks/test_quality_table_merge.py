"""benchmarks/common/quality_table_merge.py: --write-table merges a run into the quality
table rather than rewriting it from that run alone."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import quality_table_merge as merge  # noqa: E402 -- after the path above


def _entry(steps: int, final: dict, reaches: dict) -> dict:
    return {"metric": "bits/char", "higher_is_better": False, "tolerance": 0.02,
            "steps": steps, "ranks": 4, "final": final, "reaches_fp32_at": reaches,
            "bytes_per_step": {c: 100 for c in final}}


def test_a_run_of_other_steps_adds_only_new_rows_with_its_own_baseline(tmp_path):
    old = {"text": _entry(300, {"fp32 allreduce": 3.14, "int8": 3.15},
                          {"fp32 allreduce": 175, "int8": 175})}
    new = {"text": _entry(600, {"fp32 allreduce": 3.0, "diloco h50": 3.05},
                          {"fp32 allreduce": 400, "diloco h50": 500})}
    path = tmp_path / "table.py"
    merge.write(str(path), merge.merge(old, new))
    text = merge.read(str(path))["text"]
    # The main run's rows stay as they were (its fp32 row too: int8's score is read against it).
    assert text["steps"] == 300
    assert text["final"] == {"fp32 allreduce": 3.14, "int8": 3.15, "diloco h50": 3.05}
    assert text["reaches_fp32_at"]["diloco h50"] == 500
    assert text["other_runs"] == {"diloco h50": {"steps": 600, "ranks": 4,
                                                 "fp32 allreduce": 3.0}}
    assert old["text"]["final"] == {"fp32 allreduce": 3.14, "int8": 3.15}  # not mutated


def test_a_run_of_the_same_settings_replaces_its_rows_and_keeps_the_others():
    old = {"text": _entry(300, {"fp32 allreduce": 3.14, "int8": 3.15},
                          {"fp32 allreduce": 175, "int8": 175}),
           "digits": _entry(300, {"fp32 allreduce": 0.98}, {"fp32 allreduce": 125})}
    new = {"text": _entry(300, {"fp32 allreduce": 3.13}, {"fp32 allreduce": 150})}
    table = merge.merge(old, new)
    assert table["text"]["final"] == {"fp32 allreduce": 3.13, "int8": 3.15}
    assert "other_runs" not in table["text"]
    assert table["digits"] == old["digits"]
    assert merge.read("/nonexistent/table.py") == {}
