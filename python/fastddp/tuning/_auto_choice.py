"""Note [auto tuning]'s decision rule, on figures alone: the link the training saw, the cost
model's ranking, which candidates get a trial (step 2) and which measured one wins (step 4).
The tuner (auto.py) collects the figures, runs the trials and installs the choice."""

import statistics
from typing import Any

from fastddp.tuning import candidates
from fastddp.tuning.candidates import HIER, LOSSLESS, lossy
from fastddp.link.model import Link, bus_factor
from fastddp.tuning import advise

MIN_PREDICTED_GAIN = 0.02
BLOCK_SAMPLES = 4  # measured steps per trial block; each trial runs two blocks


def family(name: str) -> str:
    """The candidate's family (candidates.py), of which the best predicted gets a trial."""
    if not lossy(name):
        return "bucket size"
    if name in HIER:
        return "hierarchical"
    return candidates.by_name(name)[0].family


def training_link(probed: Link, samples: list[dict[str, Any]], n: int) -> Link:
    """The probed link, slowed to what the baseline's large collectives saw in training
    where that was slower: on a shared CPU the transport competes with the backward for
    the cores, which is what compression would then save. Only buckets whose transfer
    takes at least twice the latency at the probed bandwidth count (in a small one,
    rank skew and latency dominate, and no compression shortens those). ``samples``: the
    baseline's, ``n``: the model group's size."""
    bus_bytes = served_ms = 0.0
    for sample in samples:
        previous_done = 0.0
        for b in sorted(sample["stats"]["buckets"], key=lambda b: b["launched_ms"]):
            start = max(b["launched_ms"], previous_done)
            previous_done = max(previous_done, b["done_ms"])
            nbytes = bus_factor("allreduce", n) * b["wire_bytes"]
            if probed.ms("allreduce", b["wire_bytes"], n) < 3 * probed.latency_us * 1e-3:
                continue
            bus_bytes += nbytes
            served_ms += max(0.0, b["done_ms"] - start - probed.latency_us * 1e-3)
    if bus_bytes <= 0 or served_ms <= 0:
        return probed
    return Link(min(probed.bus_gbs, bus_bytes / served_ms / 1e6), probed.latency_us)


def predict(samples: list[dict[str, Any]], names: list[str], n: int, device: str,
            probed: Link, hier_probed: tuple[int, Link, Link] | None
            ) -> tuple[dict[str, float], str, list[str], dict[str, Any]]:
    """The cost model's predicted step per candidate of ``names``, the link it used (as
    text), the candidates best first, and the advice's DiLoCo verdict (Note [DiLoCo
    advice]; never a candidate: auto only reports it). ``hier_probed``: (local size,
    intra-node link, inter-node link) on several nodes."""
    link = training_link(probed, samples, n)
    hier = None
    if hier_probed is not None:
        # The transport's slowdown in training (shared cores) hits every group's.
        slow = link.bus_gbs / probed.bus_gbs
        local, intra_probed, inter_probed = hier_probed
        intra, inter = (Link(x.bus_gbs * slow, x.latency_us) for x in (intra_probed,
                                                                       inter_probed))
        hier = (local, intra, inter)
    costs = advise.kernel_costs([s for b in samples[-1]["shapes"] for s in b], device)
    caps = [c for name in names if (c := advise.variant_cap(name)) is not None]
    result = advise.advise(samples, link, LOSSLESS, costs, caps_mb=caps, hier=hier)
    rows = [r for r in result["candidates"] if r["candidate"] in names]
    predicted = {r["candidate"]: r["predicted_step_ms"] for r in rows}
    link_text = str(link) + ("" if hier is None else f"; intra-node {hier[1]}, inter-node "
                             f"{hier[2]}")
    return predicted, link_text, [r["candidate"] for r in rows], result["diloco"]


def worth_trying(ranked: list[str], predicted: dict[str, float]) -> list[str]:
    """The best predicted of each family (other bucket sizes, 16-bit wires, PowerSGD
    ranks), best first, among those predicted to beat the baseline by 2%. The model ranks
    within a family better than across families: on a CPU the transport takes the
    backward's cores, which it does not see, and PowerSGD costs more than its bytes
    (benchmarks/results/auto.md: PowerSGD predicted first, measured slower than bf16).
    So each family that qualifies gets a real trial, and the measured lossy_margin
    decides. On a compute-bound step none qualifies."""
    baseline = predicted[LOSSLESS]
    families: dict[str, str] = {}
    for name in ranked:
        if name != LOSSLESS and predicted[name] <= baseline * (1 - MIN_PREDICTED_GAIN):
            families.setdefault(family(name), name)
    return list(families.values())


def best_measured(measured: dict[str, float], times: dict[str, list[float]],
                  lossy_margin: float) -> str:
    """The fastest median; a lossy one only if its median and each of its blocks' medians
    beat the fastest lossless median by the margin. A win in one block and not in the
    other is load, not the hook: on a compute-bound step (communication hidden) a loaded
    CPU had measured PowerSGD 5% faster than plain allreduce over its two blocks together."""
    lossless = min((n for n in measured if not lossy(n)), key=measured.get)
    best = min(measured, key=measured.get)
    if not lossy(best):
        return best
    best_times = times.get(best, [])
    blocks = [best_times[i:i + BLOCK_SAMPLES] for i in range(0, len(best_times), BLOCK_SAMPLES)]
    bound = (1 - lossy_margin) * measured[lossless]
    if max([measured[best], *map(statistics.median, blocks)]) > bound:
        return lossless
    return best


def diloco_line(diloco: dict[str, Any] | None) -> str | None:
    """Rank 0's one DiLoCo message (the --advise paragraph), when per-step synchronization
    bounds the step; None otherwise. auto never switches to DiLoCo itself (docs/auto.md)."""
    if not diloco or not diloco.get("text"):
        return None
    return ("[fastddp] auto: the choice above stays a per-step hook; --hook auto never "
            "switches to DiLoCo (it changes the training algorithm: restart with --sync "
            "to use it).\n" + diloco["text"])


def log_line(policy: str, choice: str, chosen_at_step: int, measured: dict[str, float],
             predicted: dict[str, float], error: str | None) -> str:
    """Rank 0's one line: the choice, its predicted and measured step times, and those of
    every candidate tried."""
    def figures(name: str) -> str:
        guess = predicted.get(name)
        return (f"{measured[name]:.2f} ms measured"
                + ("" if guess is None else f", {guess:.2f} predicted"))
    others = "; ".join(f"{n} {figures(n)}" for n in sorted(measured, key=measured.get)
                       if n != choice)
    tried = (f"; also tried {others}" if others else
             "; no other candidate was predicted to beat it by its margin")
    note = f" (cost model failed: {error})" if error else ""
    return (f"[fastddp] auto:{policy} chose {choice} from step "
            f"{chosen_at_step}: {figures(choice)} a step{tried}{note}")
