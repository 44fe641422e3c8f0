"""``--advise`` / ``patch(advise=True)``: which gradient-communication hook to use, predicted
from this run's own measurements by the cost model (fastddp/tuning/cost_model.py).

The run itself is not changed: no hook is registered, no collective is issued, no number is
touched. Rank 0 reads ``model.comm_stats()`` at the start of a few forwards (after
``WARMUP_STEPS`` steps, for at most ``MAX_SAMPLES`` steps; outside that window a forward
costs one counter increment). On a GPU the reducer records its timing events in every step
while samples are taken, and that read never waits: it gives the latest step the device has
finished (``timed_iteration``, Note [device timeline]), and a read that finds no newer one
than the last sample's is no sample. At exit rank 0 times the candidates'
kernels on a scratch tensor (no collective), feeds the median measured step (bucket ready
times, backward end, the rest of the step) with the link to the cost model, and writes the
table (``fastddp_advice.md`` / ``.json``).

The link: the ``--emulate-link`` one if given, else estimated from this run's own
collectives: each bucket's bus bytes (2(n-1)/n of its wire bytes, as an allreduce) over the
time the link served it (done minus the later of its launch and the previous bucket's done).
Latency is not estimated (taken as 0).

Table columns: the predicted step time (cost model, including the rest of the step as
measured); the measured step time, for the configuration that ran only (median time from
one synchronized forward to the next); the bytes each rank puts on the link per step (bus
factor times payload, Note [collective cost] in fastddp/link/model.py); and compute-to-
communication, the step's non-communication time (rest of the step plus backward with the
candidate's compression) over the link time of its collectives: far above 1, communication
hides behind backward and compressing more buys nothing; below 1, the link sets the pace.
When even the fastest candidate is link-bound, a paragraph under the table weighs DiLoCo
(``--sync diloco:H=...``) against it, citing the quality table (Note [DiLoCo advice] in
diloco_advice.py).
"""

import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fastddp.hooks import catalog
from fastddp.link.model import Link, bus_factor
from fastddp.tuning import candidates, cost_model, diloco_advice, quality
from fastddp.tuning.candidates import HIER, HIER_INNERS, cap_variant, variant_cap

WARMUP_STEPS = 3
MAX_SAMPLES = 10
# The tuner's candidates (candidates.py's, and the hierarchical ones).
_CANDIDATES = candidates.under("any")
# Candidate (cost model name) -> the launcher's --hook spelling ("" = no --hook, the default).
HOOK_SPELLING = {name: candidates.flag_of(name)
                 for name in [n for _, n in _CANDIDATES] + list(HIER)}
_MIB = 1024 * 1024
_SCRATCH_NUMEL = 1 << 22  # kernels are timed on at most 16 MB of fp32


class Advisor:
    """The samples rank 0 collected, one record per wrapped model."""

    def __init__(self, warmup: int = WARMUP_STEPS, max_samples: int = MAX_SAMPLES):
        self.warmup, self.max_samples = warmup, max_samples
        self.records: list[dict[str, Any]] = []

    def before_forward(self, model: Any, handle: Any) -> None:
        """Called at the start of every forward of a wrapped model (rank 0 only); ``handle``:
        the model's TunerHandle (fastddp/ddp/_tuner_handle.py), what sampling reads."""
        state = getattr(model, "_fastddp_advice", None)
        if state is None:
            state = {"forwards": 0, "steps": None, "at": 0.0, "samples": [],
                     "device": str(next(iter(model.parameters()), torch.empty(0)).device)}
            self.records.append(state)
            model._fastddp_advice = state
        state["forwards"] += 1
        if (not self.warmup < state["forwards"] or len(state["samples"]) >= self.max_samples
                or "error" in state):
            return
        try:
            self._sample(handle, state)
        except Exception as e:  # noqa: BLE001 -- observing must never fail the training run
            state["error"] = f"{type(e).__name__}: {e}"

    @staticmethod
    def _sample(handle: Any, state: dict[str, Any]) -> None:
        now = time.perf_counter()
        stats = handle.comm_stats()
        # A sample is one synchronized step between two forwards (no no_sync, no eval), with
        # figures of a step not sampled yet (on a GPU they trail the host).
        timed = stats.get("timed_iteration", 0)
        if (state["steps"] is not None and stats["steps"] == state["steps"] + 1
                and stats["buckets"] and timed > state.get("timed", 0)):
            params = handle.params
            shapes = [[tuple(params[i].shape) for i in b] for b in handle.bucket_plan()]
            state["samples"].append({"step_ms": (now - state["at"]) * 1e3, "stats": stats,
                                     "shapes": shapes})
            state["timed"] = timed
        state["steps"], state["at"] = stats["steps"], now
        # Every step timed on a GPU while sampling, then torch's rate.
        handle.time_every_step(len(state["samples"]) < MAX_SAMPLES)


def estimate_link(stats: dict[str, Any]) -> Link | None:
    """The bus bandwidth the buckets' collectives saw (module docstring); None if unknown."""
    n = stats.get("world_size", 1)
    bus_bytes = served_ms = 0.0
    previous_done = 0.0
    for b in sorted(stats["buckets"], key=lambda b: b["launched_ms"]):
        start = max(b["launched_ms"], previous_done)
        if b["done_ms"] > start:
            served_ms += b["done_ms"] - start
            bus_bytes += bus_factor("allreduce", n) * b["wire_bytes"]
        previous_done = max(previous_done, b["done_ms"])
    if served_ms <= 0 or bus_bytes <= 0:
        return None
    return Link(bus_gbs=bus_bytes / served_ms / 1e6)  # bytes per ms / 1e6 = GB/s


def _time_ms(fn: Any, device: torch.device, repeats: int = 7) -> float:
    """The fastest of ``repeats`` runs: other processes only ever slow a kernel down."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def kernel_costs(shapes: Sequence[tuple[int, ...]], device: str) -> dict[str, dict[str, float]]:
    """Per candidate, cost model kernel costs (ms per MB of fp32 gradient), timed here on
    scratch tensors: casts for bf16, the fp32 sum for bf16-fp32acc, and for PowerSGD the
    error-feedback add, the two matmuls with orthogonalization, and decompression, on the
    model's largest matrix (rows cut so it has at most 4M elements)."""
    dev = torch.device(device)
    numel = max(1, min(_SCRATCH_NUMEL, sum(math.prod(s) for s in shapes)))
    g, other = torch.randn(numel, device=dev), torch.randn(numel, device=dev)
    half = g.to(torch.bfloat16)
    mb = numel * 4 / 1e6
    cast = _time_ms(lambda: g.to(torch.bfloat16), dev) / mb
    upcast = _time_ms(lambda: half.float(), dev) / mb
    add = _time_ms(lambda: other.add_(g), dev) / mb
    # Per cost-model function (a candidate's ``cost``), its kernels' costs.
    by_cost = {"allreduce_fp32": {},
               "bf16": {"compress_ms_per_mb": cast, "writeback_ms_per_mb": upcast},
               "bf16_fp32_accumulate": {"compress_ms_per_mb": cast,
                                        "between_ms_per_mb": upcast + add,
                                        "writeback_ms_per_mb": upcast}}
    costs = {name: (_quant8_costs(g, c.wire, dev, mb) if c.cost[0] == "quant8"
                    else by_cost[c.cost[0]])
             for c, name in _CANDIDATES if not c.low_rank}
    costs["hier"] = {"sum_ms_per_mb": add}
    matrices = [s for s in shapes if len(s) > 1]
    rows, cols = max(((s[0], math.prod(s[1:])) for s in matrices), key=math.prod,
                     default=(1024, 1024))
    rows = max(1, min(rows, _SCRATCH_NUMEL // cols))
    m, error = torch.randn(rows, cols, device=dev), torch.zeros(rows, cols, device=dev)
    mb = rows * cols * 4 / 1e6
    for r in candidates.RANKS:
        q = torch.randn(cols, r, device=dev)

        def between(q: torch.Tensor = q) -> None:
            p, _ = torch.linalg.qr(m @ q)
            m.t() @ p

        p = m @ q
        low_rank = {
            "compress_ms_per_mb": _time_ms(lambda: error.add_(m), dev) / mb,
            "between_ms_per_mb": _time_ms(between, dev) / mb,
            "writeback_ms_per_mb": _time_ms(lambda p=p, q=q: p @ q.t(), dev) / mb}
        # ACP-SGD: one orthogonalization and one product per step, all before its one
        # collective; about half of PowerSGD's work between its two.
        low_rank_by_cost = {"powersgd": low_rank, "acpsgd": {
            "compress_ms_per_mb": low_rank["compress_ms_per_mb"]
            + low_rank["between_ms_per_mb"] / 2,
            "writeback_ms_per_mb": low_rank["writeback_ms_per_mb"]}}
        for c, _ in _CANDIDATES:
            if c.low_rank:
                costs[candidates.name_of(c.flag, r)] = low_rank_by_cost[c.cost[0]]
    return costs


def _quant8_costs(g: torch.Tensor, fmt: str, dev: torch.device, mb: float) -> dict[str, float]:
    """The 8-bit hooks' kernels: quantization (with its error, for error feedback) on the
    compute path; between the collectives a dequantization, an add and a quantization per
    shard (taken as the whole bucket's: n shards of 1/n); dequantization at write-back."""
    from fastddp import _C

    codes, scales = _C._quantize8(g, fmt)
    quantize = _time_ms(lambda: _C._quantize8(g, fmt, error=True), dev) / mb
    dequantize = _time_ms(lambda: _C._dequantize8(codes, scales, fmt), dev) / mb
    plain = _time_ms(lambda: _C._quantize8(g, fmt), dev) / mb
    return {"compress_ms_per_mb": quantize, "between_ms_per_mb": dequantize + plain,
            "writeback_ms_per_mb": dequantize}


def _candidates(costs: dict[str, dict[str, float]], local_size: int | None = None
                ) -> list[cost_model.Candidate]:
    # Each candidate modelled by its cost_model function: a low-rank one with its rank, the
    # others with the candidate's arguments (quant8's name).
    flat = []
    for c, name in _CANDIDATES:
        model, *args = c.cost
        rank = candidates.by_name(name)[1]
        modelled = getattr(cost_model, model)(*([rank] if rank is not None else args),
                                              **costs[name])
        flat.append(dataclasses.replace(modelled, name=name))  # candidates.py's spelling
    if local_size is None:
        return flat
    inners = {c.name: c for c in flat}
    return flat + [dataclasses.replace(
        cost_model.hierarchical(inners[name], local_size, **costs.get("hier", {})),
        name=candidates.HIER_PREFIX + name) for name in HIER_INNERS]


def current_candidate(hook_spec: Any, hook_name: str) -> str | None:
    """The candidate the run used: the launcher's --hook, else the script's, if known."""
    if hook_spec is None:
        return candidates.LOSSLESS if hook_name == "allreduce" else None
    if hook_spec.name not in [c.flag for c, _ in _CANDIDATES]:
        return None  # fp16, auto, hier: not modelled
    config = catalog.config(hook_spec.name)
    if config.argument not in ("", "rank") and hook_spec.format not in (
            None, catalog.hook(config.hook).option(config.argument).default):
        return None  # modelled with its default format (fp8: e4m3; e5m2 costs the same bytes)
    return candidates.name_of(hook_spec.name, hook_spec.rank)


def advise(samples: Sequence[dict[str, Any]], link: Link | None, current: str | None,
           costs: dict[str, dict[str, float]], caps_mb: Sequence[float] = (),
           hier: tuple[int, Link, Link] | None = None) -> dict[str, Any]:
    """The advice (a JSON-able dict) from one model's samples (Advisor records); ``caps_mb``
    adds plain allreduce at those bucket caps (cost_model.rebucket) to the candidates;
    ``hier`` = (local size, intra-node link, inter-node link) adds hierarchical reduction
    with each of HIER_INNERS between the nodes."""
    samples = [s for s in samples if s["shapes"] == samples[-1]["shapes"]]
    stats = [s["stats"] for s in samples]
    world = stats[-1]["world_size"]
    link_source = "--emulate-link"
    if link is None:
        links = [x for x in map(estimate_link, stats) if x is not None]
        if not links:
            raise ValueError("advise: no collective took measurable time; cannot estimate "
                             "the link (give --emulate-link)")
        # Three significant digits: an estimate, printed as one.
        link = Link(bus_gbs=float(f"{statistics.median(x.bus_gbs for x in links):.3g}"))
        link_source = "estimated from this run's collectives"
    nb = len(stats[-1]["buckets"])
    ready = [statistics.median(s["buckets"][i]["ready_ms"] for s in stats) for i in range(nb)]
    backward_ms = statistics.median(max(b["ready_ms"] for b in s["buckets"]) for s in stats)
    exposed_ms = statistics.median(s["exposed_comm_ms"] for s in stats)
    step_ms = statistics.median(s["step_ms"] for s in samples)
    fixed_ms = max(0.0, step_ms - backward_ms - exposed_ms)
    shapes = samples[-1]["shapes"]
    order = sorted(range(nb), key=lambda i: ready[i])
    buckets = [cost_model.Bucket(min(ready[i], backward_ms), shapes=tuple(map(tuple, shapes[i])))
               for i in order]
    local_size, links = (None, None) if hier is None else (
        hier[0], {"intra": hier[1], "inter": hier[2]})
    predictions = cost_model.predict_all(buckets, backward_ms, link, world,
                                         _candidates(costs, local_size), fixed_ms, links)
    plain = cost_model.allreduce_fp32(**costs["allreduce_fp32"])
    for cap in caps_mb:
        variant = cost_model.Candidate(cap_variant(cap), plain.collectives)
        predictions.append(cost_model.predict(cost_model.rebucket(buckets, cap * _MIB),
                                              backward_ms, link, world, variant, fixed_ms))
    predictions.sort(key=lambda p: p.step_ms)
    rows = []
    for p in predictions:
        comm_ms = sum(end - start for *_, start, end in p.timeline)
        compute_ms = fixed_ms + p.backward_end_ms
        rows.append({"candidate": p.name, "hook": HOOK_SPELLING.get(p.name, ""),
                     "bucket_cap_mb": variant_cap(p.name),
                     "predicted_step_ms": p.step_ms,
                     "measured_step_ms": step_ms if p.name == current else None,
                     "wire_bytes_per_step": sum(p.link_bytes.values()),
                     "compute_ms": compute_ms, "comm_ms": comm_ms,
                     "compute_to_comm": compute_ms / comm_ms if comm_ms > 0 else None})
    # Note [DiLoCo advice]: DiLoCo's inner step is the measured step without communication.
    # An aside: its failure must cost neither the table nor auto's choice (auto.py's
    # _plan_trials keeps the baseline when this function raises).
    try:
        diloco = diloco_advice.consider(rows, fixed_ms + backward_ms,
                                        diloco_advice.model_numel(shapes), link, world, shapes)
    except Exception as e:  # noqa: BLE001
        diloco = {"error": f"{type(e).__name__}: {e}", "recommended": None, "text": None}
    if hier is not None:
        link_source += f"; hierarchical: {hier[0]} ranks a node, intra {hier[1]}, inter {hier[2]}"
    return {"world_size": world, "link": str(link), "link_source": link_source,
            "steps_sampled": len(samples), "current": current, "measured_step_ms": step_ms,
            "fixed_ms": fixed_ms, "backward_ms": backward_ms, "candidates": rows,
            "best": rows[0]["candidate"], "best_hook": rows[0]["hook"],
            "quality": quality.quality_note(rows[0]["candidate"], shapes), "diloco": diloco}


def format_markdown(advice: dict[str, Any], command: str | None = None) -> str:
    """The table rank 0 prints and fastddp_advice.md holds."""
    lines = [f"## fastddp advice (world size {advice['world_size']}, link {advice['link']}, "
             f"{advice['link_source']}; {advice['steps_sampled']} steps sampled)", "",
             "| candidate | --hook | predicted step ms | measured step ms "
             "| MB sent per rank per step | compute:comm |", "|---|---|---|---|---|---|"]
    for r in advice["candidates"]:
        measured = "-" if r["measured_step_ms"] is None else f"{r['measured_step_ms']:.2f}"
        mark = " (this run)" if r["candidate"] == advice["current"] else ""
        ratio = "-" if r["compute_to_comm"] is None else f"{r['compute_to_comm']:.2f}"
        lines.append(f"| {r['candidate']}{mark} | {r['hook'] or '(default)'} | "
                     f"{r['predicted_step_ms']:.2f} | {measured} | "
                     f"{r['wire_bytes_per_step'] / 1e6:.3f} | {ratio} |")
    best = advice["best_hook"]
    ran = [r for r in advice["candidates"] if r["measured_step_ms"] is not None]
    if ran and abs(ran[0]["predicted_step_ms"] / ran[0]["measured_step_ms"] - 1) > 0.25:
        # E.g. an emulated link faster than the real transport: the emulator only delays.
        lines += ["", f"Note: this run measured {ran[0]['measured_step_ms']:.2f} ms a step, "
                  f"{ran[0]['predicted_step_ms']:.2f} ms predicted on link {advice['link']}: "
                  "the link the run really had differs from it; rank with care."]
    lines += ["", f"Best predicted: {advice['best']} "
              f"({'--hook ' + best if best else 'no --hook: the default allreduce'})."]
    if command:
        lines.append(f"Command: `{command}`")
    if advice.get("quality"):
        lines.append(advice["quality"])
    if best:
        lines.append("Compression changes the gradients: check the loss curve before keeping it.")
    if (advice.get("diloco") or {}).get("text"):
        lines += ["", advice["diloco"]["text"]]
    return "\n".join(lines)


def write_advice(advices: list[dict[str, Any]], text: str, out_dir: str) -> list[str]:
    """Writes fastddp_advice.md and fastddp_advice.json into ``out_dir``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    md, js = Path(out_dir) / "fastddp_advice.md", Path(out_dir) / "fastddp_advice.json"
    md.write_text(text + "\n")
    js.write_text(json.dumps({"models": advices}, indent=1, default=str) + "\n")
    return [str(md), str(js)]
