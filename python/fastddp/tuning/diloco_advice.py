"""Whether ``--advise`` (and ``--hook auto``'s one message) proposes DiLoCo (``--sync
diloco:H=...``, docs/diloco.md) instead of a per-step hook, and why.

Note [DiLoCo advice]: DiLoCo changes the training algorithm (H local steps with the script's
optimizer, then an outer Nesterov step on the averaged pseudo-gradient), so speed alone never
recommends it. It is proposed when all three hold:

1. **Per-step synchronization is the bottleneck**: the fastest per-step candidate (the cost
   model's, any hook) spends at least ``COMM_BOUND`` (1/2) of its compute time on the link
   (compute-to-communication at most 2). Below that, the best hook hides most of its bytes
   behind backward, and nothing is said of DiLoCo.
2. **DiLoCo is predicted faster**: its amortized step (cost_model.diloco: the measured step
   without communication, plus the exchange every H / P steps that overlap does not hide) is
   at least ``MIN_GAIN`` (20%) shorter than that hook's predicted step.
3. **Its quality was measured and holds**: the configuration's final score on the nearest
   real-data task (quality_table.py, benchmarks/quality.py) is within the table's tolerance
   of fp32 allreduce's (the tolerance the table's ``reaches_fp32_at`` uses). A configuration
   without a row is not recommended, and the text says it was not measured; no figure is
   made up.

Of the configurations meeting 2 and 3, the fastest predicted is recommended. When 1 holds and
2 or 3 does not, the text says which, with the figures.

Those rows were measured at the paper's outer step (Nesterov SGD, lr 0.7, momentum 0.9). What
the outer learning rate and momentum do on a short run with few workers is a second table
(diloco_small_table.py, benchmarks/diloco_small.py, docs/diloco.md#small-jobs): the paragraph
cites its row for the run's world size on the nearest task (the paper's setting, the best
measured one with its ``--sync`` flag, and no communication at all), and says plainly when the
table has no row for that world size or task: then nothing is known of the outer settings
there. The recommendation itself stays the quality table's (its rows are what was measured
with the H it recommends).
"""

import math
from collections.abc import Sequence
from typing import Any

from fastddp.link.model import Link
from fastddp.tuning import cost_model, diloco_small_table, quality, quality_table

COMM_BOUND = 0.5
MIN_GAIN = 0.2

# The quality table's row -> the DiLoCo settings it was measured with: benchmarks/quality.py
# builds its DiLoCo configurations from this table (benchmarks/common/periodic_sync.py), so
# the advice predicts, and recommends with --sync, what the table's row measured. Streaming:
# 4 fragments, so H is a multiple of 4: 48, the nearest to 50 (a fragment every 12 steps);
# overlap 2, so that quantized_sum="shards" sends its second collective inside the window too.
CONFIGS = {
    "diloco h10": {"sync_every": 10},
    "diloco h50": {"sync_every": 50},
    "diloco h100": {"sync_every": 100},
    "streaming int8 p4": {"sync_every": 48, "fragments": 4, "overlap": 2, "wire": "int8",
                          "quantized_sum": "shards"},
    "streaming int4 p4": {"sync_every": 48, "fragments": 4, "overlap": 2, "wire": "int4",
                          "quantized_sum": "shards"},
}
_SYNC_KEYS = {"sync_every": "H", "wire": "wire", "fragments": "fragments", "overlap": "overlap",
              "quantized_sum": "quantized_sum"}
# Where the table may hold a row's counted bytes a step (benchmarks/quality.py, issue 47 item 4).
BYTES_KEYS = ("bytes", "bytes_per_step")
# Rows cited for comparison, not recommended: the same algorithm in other libraries.
REFERENCES = ("torchft diloco h10", "torchft diloco h50", "torchft diloco h100",
              "torch post-local SGD")


def sync_flag(config: str) -> str:
    """The launcher's ``--sync`` argument for a CONFIGS row."""
    settings = CONFIGS[config]
    spec = ",".join(f"{_SYNC_KEYS[k]}={v}" for k, v in settings.items())
    return f"--sync diloco:{spec}"


def baseline(table: dict[str, Any], config: str) -> float:
    """fp32 allreduce's final score in the run that measured ``config``: the table's main
    run's, or for a row merged from a run of other steps or ranks, that run's (its
    ``other_runs`` entry: benchmarks/common/quality_table_merge.py)."""
    other = table.get("other_runs", {}).get(config, {})
    return other.get(quality.BASELINE, table["final"][quality.BASELINE])


def within_tolerance(table: dict[str, Any], config: str) -> bool:
    """The row's final score is within the table's tolerance of fp32 allreduce's (in the
    same run: baseline())."""
    final, base, tol = table["final"][config], baseline(table, config), table["tolerance"]
    if table["higher_is_better"]:
        return final >= base - tol
    return final <= base * (1 + tol)


def _tolerance_text(table: dict[str, Any]) -> str:
    tol = table["tolerance"]
    return f"{tol:g} {table['metric']}" if table["higher_is_better"] else f"{100 * tol:g}%"


def _gain_text(gain: float) -> str:
    return f"{100 * gain:.0f}% faster" if gain >= 0 else f"{-100 * gain:.0f}% slower"


def _row_text(table: dict[str, Any], config: str) -> str:
    """``diloco h50: bits/char 3.1500 (within 2% of fp32), 0.16 MB a step`` from the table."""
    final = table["final"][config]
    verdict = "within" if within_tolerance(table, config) else "not within"
    text = f"{config} {final:.4f} ({verdict} {_tolerance_text(table)})"
    if config in table.get("other_runs", {}):
        run = table["other_runs"][config]
        text += (f" in a run of {run['steps']} steps where {quality.BASELINE} ended at "
                 f"{run[quality.BASELINE]:.4f}")
    sent = next((table[k][config] for k in BYTES_KEYS if config in table.get(k, {})), None)
    if isinstance(sent, (int, float)):
        text += f", {sent / 1e6:.3g} MB sent a step"
    return text


def consider(per_step: Sequence[dict[str, Any]], compute_ms: float, numel: int, link: Link,
             world: int, shapes: Sequence[Sequence[Sequence[int]]]) -> dict[str, Any]:
    """Note [DiLoCo advice] on one model's advice: ``per_step`` the advice's candidate rows,
    fastest first; ``compute_ms`` the measured step without communication; ``numel`` the
    model's gradient values. Returns the options, the recommendation (or None) and the text
    (None when per-step synchronization is not the bottleneck)."""
    best = per_step[0]
    task = quality.nearest_task(shapes)
    table = quality_table.QUALITY.get(task, {"final": {}})
    options = []
    for config, settings in CONFIGS.items():
        p = cost_model.diloco(numel, compute_ms, link, world, **settings)
        measured = quality.BASELINE in table["final"] and config in table["final"]
        options.append({"config": config, "sync": sync_flag(config),
                        "predicted_step_ms": p.step_ms, "sync_ms": p.sync_ms,
                        "bytes_per_step": p.bytes_per_step,
                        "gain": 1 - p.step_ms / best["predicted_step_ms"],
                        "measured": measured,
                        "quality_ok": measured and within_tolerance(table, config)})
    options.sort(key=lambda o: o["predicted_step_ms"])
    comm, own_compute = best["comm_ms"], best["compute_ms"]
    bound = comm >= COMM_BOUND * own_compute
    faster = [o for o in options if o["gain"] >= MIN_GAIN]
    chosen = next((o for o in faster if o["quality_ok"]), None)
    pick = chosen if bound else {}
    result = {"bound": bound, "per_step": best["candidate"], "options": options,
              "recommended": (pick or {}).get("config"), "sync": (pick or {}).get("sync"),
              "predicted_step_ms": (pick or {}).get("predicted_step_ms"),
              "task": task, "text": None}
    if bound:
        result["text"] = (_why(best, options, faster, chosen, table, task) + "\n"
                          + outer_settings(task, world))
    return result


def _better(a: float, b: float, higher: bool) -> bool:
    return a > b if higher else a < b


def outer_settings(task: str, world: int) -> str:
    """The small-job table's line for ``world`` workers on ``task`` (Note [DiLoCo advice]),
    or what it does not know."""
    table = diloco_small_table.SMALL_JOBS
    entry = table["tasks"].get(task, {"worlds": {}})
    regime = f"{table['steps']} inner steps at H = {table['sync_every']}"
    where = f"{quality.TASKS.get(task, task)}"
    if world not in entry["worlds"]:
        measured = sorted({w for e in table["tasks"].values() for w in e["worlds"]})
        return (f"Outer settings: the small-job table (docs/diloco.md#small-jobs) has no row "
                f"for {world} workers on {where} (measured: "
                f"{', '.join(map(str, measured))} workers, {regime}), so how the outer "
                "learning rate and momentum train at this scale is not known here; the "
                "defaults (the paper's 0.7 and 0.9) were tuned on the paper's task over "
                "thousands of inner steps. Compare the loss after the first syncs with a run "
                "where no worker syncs.")
    rows, higher = entry["worlds"][world], entry["higher_is_better"]
    settings = {name: rows[name] for name in table["settings"] if name in rows}
    best = (max if higher else min)(settings, key=settings.get)
    lr, momentum = table["settings"][best]
    paper, alone = rows[table["paper"]], rows[table["alone"]]
    flag = f"--sync diloco:H={table['sync_every']},outer_lr={lr:g},outer_momentum={momentum:g}"
    text = (f"Outer settings on a short run ({regime}, {world} workers, {where}; "
            f"docs/diloco.md#small-jobs): {table['reference']} {rows[table['reference']]:.4f}, "
            f"no communication {alone:.4f}, the defaults ({table['paper']}) {paper:.4f}")
    text += (": the best measured." if best == table["paper"] else
             f", the best measured {best} {settings[best]:.4f} ({flag}).")
    if not _better(paper, alone, higher):
        text += (" Here the defaults trained no better than not communicating at all: on a "
                 "run like this one, lower the outer momentum.")
    return text


def _why(best: dict[str, Any], options: list[dict[str, Any]], faster: list[dict[str, Any]],
         chosen: dict[str, Any] | None, table: dict[str, Any], task: str) -> str:
    """The advice's DiLoCo paragraph (Note [DiLoCo advice])."""
    lines = [f"DiLoCo: per-step synchronization is the bottleneck: the fastest per-step hook, "
             f"{best['candidate']} ({best['predicted_step_ms']:.2f} ms a step), spends "
             f"{best['comm_ms']:.2f} ms a step on the link against {best['compute_ms']:.2f} ms "
             f"of compute (the rule: {COMM_BOUND:g} of it or more). DiLoCo predicted, "
             "amortized over its H steps:"]
    for o in options:
        lines.append(f"- {o['sync']}: {o['predicted_step_ms']:.2f} ms a step "
                     f"({_gain_text(o['gain'])}; one exchange {o['sync_ms']:.2f} ms, "
                     f"{o['bytes_per_step'] / 1e6:.3g} MB a step)")
    measured = [c for c in (*CONFIGS, *REFERENCES) if c in table["final"]]
    source = (f"the nearest measured task, {quality.TASKS.get(task, task)} "
              f"({table.get('ranks', '?')} ranks; benchmarks/results/quality.md)")
    unmeasured_all = (f"DiLoCo's quality has not been measured on real data (quality_table.py "
                      f"has no DiLoCo row for {source})")
    if not any(o["measured"] for o in options):
        lines.append(f"Not recommended: no DiLoCo configuration is predicted {100 * MIN_GAIN:g}%"
                     f" faster than {best['candidate']}, and {unmeasured_all}." if not faster else
                     f"Not recommended: {unmeasured_all}, and a change of training algorithm "
                     "is not recommended on speed alone.")
        return "\n".join(lines)
    better = "higher" if table["higher_is_better"] else "lower"
    lines.append(f"Quality on {source}, {table['metric']} ({better} is better): "
                 f"{quality.BASELINE} {table['final'][quality.BASELINE]:.4f}; "
                 + "; ".join(_row_text(table, c) for c in measured) + ".")
    unmeasured = [o["config"] for o in options if not o["measured"]]
    if unmeasured:
        lines.append(f"Not measured, so not recommended: {', '.join(unmeasured)}.")
    if chosen is not None:
        lines.append(f"Recommended: {chosen['sync']} ({chosen['predicted_step_ms']:.2f} ms a "
                     f"step against {best['predicted_step_ms']:.2f}): predicted at least "
                     f"{100 * MIN_GAIN:g}% faster, and {chosen['config']} ended within "
                     f"{_tolerance_text(table)} of {quality.BASELINE}. DiLoCo changes the "
                     "training algorithm (H local steps, then an outer Nesterov step: "
                     "docs/diloco.md): check the loss curve.")
    elif not faster:
        lines.append(f"Not recommended: no DiLoCo configuration is predicted "
                     f"{100 * MIN_GAIN:g}% faster than {best['candidate']}.")
    else:
        lines.append(f"Not recommended: the configurations predicted {100 * MIN_GAIN:g}% "
                     f"faster ({', '.join(o['config'] for o in faster)}) were not measured "
                     f"within {_tolerance_text(table)} of {quality.BASELINE}.")
    return "\n".join(lines)


def model_numel(shapes: Sequence[Sequence[Sequence[int]]]) -> int:
    """The gradient values of a model's buckets (its shapes per bucket)."""
    return sum(math.prod(s) for bucket in shapes for s in bucket)
