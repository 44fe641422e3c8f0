"""``--hook auto[:lossless|bf16|any]`` / ``fastddp.hooks.auto(policy)``: fastddp picks the
communication hook and bucket size itself, in the first steps of the run.

Note [auto tuning]: the tuner runs at the start of each synchronized forward (a forward
with gradients on, outside no_sync), from the model's own ``comm_stats()``. In order:

1. **Baseline.** Plain allreduce at the model's bucket cap. After ``warmup`` steps (the
   first step rebuilds the buckets), ``samples`` steps are measured: the time from one
   synchronized forward to the next, per-bucket ready/launch/done times, bytes.
2. **Model.** Every rank times allreduces of one element and of the largest bucket's bytes
   (at most 16 MB): the link's latency and bus bandwidth, real transport and emulation
   included, without the rank skew that a training step's collectives also wait for; the
   bandwidth is lowered to what the baseline's large buckets saw, if less (a CPU transport
   shares the cores with the backward). Rank 0 feeds the median step, that link and each
   candidate's kernel cost (timed on scratch tensors) to the cost model
   (fastddp/cost_model.py, as ``--advise`` does) and ranks the policy's candidates:
   ``lossless`` plain allreduce at bucket caps x1/4, x1 and x4; ``bf16`` also bf16 on the
   wire (summed in bf16, or in fp32); ``any`` also 8-bit wires (int8, fp8 e4m3: block
   scales, fp32 sums, error feedback) and PowerSGD of rank 1, 2, 4 and 8. On more than one
   node (Note [auto on several nodes]) ``bf16`` and ``any`` add hierarchical reduction. The
   best predicted of each family (bucket sizes, 16-bit wires, 8-bit wires, PowerSGD,
   hierarchical) is tried if predicted to beat the baseline by 2%; none on a
   compute-bound step.
3. **Trials.** Each runs for real, in two blocks of 4 measured steps, ordered A B .. Z Z .. B
   A with the baseline Z, so that load drifting over the trials biases none. A switch
   happens between two steps; the step after it is not measured (nor a rebuild's first
   step, nor a PowerSGD hook's plain warm-up steps). A trial's hook is kept across its two
   blocks.
4. **Choice.** The fastest measured median wins; a lossy candidate must beat the fastest
   lossless one by ``lossy_margin`` (5%), in its median and in each of its two blocks:
   compression changes the gradients, so it has to buy something, every time it is tried.
   The choice is installed afresh: PowerSGD's warm-up and error feedback start at that
   step. Rank 0 logs one line: the choice, its predicted and measured step times, and those
   of every candidate tried.

All ranks run the same state machine on the same step counts; rank 0 alone measures and
decides, and its decisions reach the others as one small broadcast on the model's process
group (the trial list, then the choice). No step is lost or doubled: a switch happens
between two steps, each step is reduced by exactly one configuration. While tuning, reading
``comm_stats()`` waits for the previous step's reduction (on a GPU, a host sync per step);
once chosen, a forward costs one attribute check. While tuning, the reducer also checks each
step's averaged gradients for NaN/Inf (a max-norm per gradient): a step that overflowed
(GradScaler skips it) gives no figure, as its hooks keep no trace of it (Note [a bad step
leaves no trace]); the tuning then takes one step more.

Note [auto on several nodes]: with ranks on two or more nodes (torchrun's LOCAL_WORLD_SIZE,
or ``local_size=`` / ``groups=(intra, inter)`` as for fastddp.hooks.hierarchical), the
policies ``bf16`` and ``any`` also offer hierarchical reduction: fp32 inside the node, and
between nodes plain allreduce (``hier_allreduce_fp32``), bf16 (``hier_bf16``) or, for
``any``, int8 (``hier_int8``). Its groups are made once, when auto is registered (a
collective call: every rank registers it). The intra- and inter-node links are probed like
the model's and slowed by the same factor the training showed; the cost model gives each
collective its link. ``lossless`` never offers them: they sum in another order, so they are
not bit for bit torch DDP's numbers (and count as lossy for the margin). Under the
launcher's ``--emulate-link`` both groups get the one emulated link.
"""

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fastddp import _hierarchical, advise
from fastddp.link import Link, bus_factor
from fastddp.link_emulator import EmulatedLinkGroup

POLICIES = ("lossless", "bf16", "any")
_MIB = 1024 * 1024
_LOSSLESS = "allreduce_fp32"
_BF16 = ("bf16", "bf16_fp32_accumulate")
_QUANT8 = ("int8", "fp8")
_POWERSGD = tuple(f"powersgd_r{r}" for r in (1, 2, 4, 8))
_HIER = tuple(f"hier_{inner}" for inner in advise.HIER_INNERS)
_HIER_16 = _HIER[:2]  # fp32 or bf16 between the nodes: the bf16 policy's
_CAP_FACTORS = (0.25, 4.0)
_POWERSGD_START_ITER = 2  # the least torch allows with error feedback
_MIN_PREDICTED_GAIN = 0.02
_LATENCY_PROBES = 5
_BANDWIDTH_PROBES = 3
_PROBE_MAX_NUMEL = 4 * 1024 * 1024  # 16 MB of fp32
_UNBOUNDED_GBS = 1e4  # a link whose transfer time is lost in its latency
_BLOCK_SAMPLES = 4  # measured steps per trial block; each trial runs two blocks
_SWITCH_WARMUP = 1


@dataclass(frozen=True)
class AutoHook:
    """What ``fastddp.hooks.auto()`` returns: register it like any hook."""

    policy: str = "any"
    warmup: int = 2
    samples: int = 5
    trials: int = 3
    lossy_margin: float = 0.05
    verbose: bool = True
    local_size: int | None = None  # ranks per node (default: torchrun's LOCAL_WORLD_SIZE)
    groups: Any = field(default=None, compare=False, repr=False)  # (intra, inter) groups

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"fastddp.hooks.auto: policy {self.policy!r} is not one of "
                             f"{', '.join(POLICIES)}")
        for name in ("warmup", "samples", "trials"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "warmup" else 1):
                raise ValueError(f"fastddp.hooks.auto: {name} must be a positive int, got "
                                 f"{value!r}")
        if not 0 <= self.lossy_margin < 1:
            raise ValueError(f"fastddp.hooks.auto: lossy_margin must be in [0, 1), got "
                             f"{self.lossy_margin!r}")
        if self.local_size is not None and self.groups is not None:
            raise ValueError("fastddp.hooks.auto: give at most one of local_size= and groups=")
        if self.local_size is not None:
            _hierarchical.check_local_size(self.local_size, "fastddp.hooks.auto")
        if self.groups is not None and (not isinstance(self.groups, (tuple, list))
                                        or len(self.groups) != 2):
            raise TypeError("fastddp.hooks.auto: groups must be (intra_group, inter_group)")

    @property
    def __name__(self) -> str:  # torch's register_comm_hook and our logs read it
        return f"fastddp_auto_{self.policy}_hook"

    def __call__(self, state: object, bucket: Any) -> Any:
        raise NotImplementedError(
            "fastddp.hooks.auto() chooses among fastddp's native hooks while training and "
            "runs only on fastddp.DistributedDataParallel, not under stock torch DDP")

    def candidates(self, cap_mb: float, hierarchical: bool = False) -> list[str]:
        """The policy's candidate names, in a fixed order every rank agrees on;
        ``hierarchical``: the ranks span several nodes (Note [auto on several nodes])."""
        names = [_LOSSLESS, *(advise.cap_variant(cap_mb * f) for f in _CAP_FACTORS)]
        if self.policy in ("bf16", "any"):
            names += _BF16
        if self.policy == "any":
            names += _QUANT8 + _POWERSGD
        if hierarchical and self.policy != "lossless":
            names += _HIER if self.policy == "any" else _HIER_16
        return names


def lossy(name: str) -> bool:
    return not name.startswith(_LOSSLESS)


def _family(name: str) -> str:
    if not lossy(name):
        return "bucket size"
    if name in _HIER:
        return "hierarchical"
    return "bf16" if name in _BF16 else "8-bit" if name in _QUANT8 else "powersgd"


def hook_for(name: str, groups: tuple | None = None) -> Any:
    """The fastddp.hooks built-in a candidate name stands for; hierarchical ones reduce over
    ``groups`` = (intra, inter)."""
    from fastddp import hooks

    if name in _HIER:
        if groups is None:
            raise ValueError(f"auto: candidate {name} needs the (intra, inter) groups")
        return hooks.hierarchical(inter=hook_for(name.removeprefix("hier_")), groups=groups)
    if not lossy(name):
        return hooks.allreduce()
    if name in _BF16:
        return hooks.bf16(accumulate="fp32" if name == "bf16_fp32_accumulate" else "bf16")
    if name == "int8":
        return hooks.int8()
    if name == "fp8":
        return hooks.fp8()
    rank = int(name.removeprefix("powersgd_r"))
    return hooks.powersgd(matrix_approximation_rank=rank,
                          start_powerSGD_iter=_POWERSGD_START_ITER)


class AutoTuner:
    """Note [auto tuning], for one model. ``before_forward`` is its one entry point."""

    def __init__(self, ddp: Any, spec: AutoHook, install: Any):
        self.ddp, self.spec, self._install = ddp, spec, install
        self.group = ddp.process_group
        self.cap_mb = ddp.bucket_bytes_cap / _MIB
        self.hier_groups = self._hier_groups() if self.group.size() > 1 else None
        self.names = spec.candidates(self.cap_mb, self.hier_groups is not None)
        self.rank0 = self.group.rank() == 0
        self.queue: list[str] = []  # the trial blocks still to run, after the current one
        self._planned = False
        self.current = _LOSSLESS
        self.times: dict[str, list[float]] = {}  # rank 0: measured step ms per candidate
        self.measured: dict[str, float] = {}
        self.predicted: dict[str, float] = {}
        self.choice: str | None = None if self.group.size() > 1 else _LOSSLESS
        self.chosen_at_step: int | None = None
        # (first step, configuration, installed afresh): what replays this run's numbers.
        self.history: list[tuple[int, str, bool]] = [(0, _LOSSLESS, True)]
        self.step = 0  # synchronized steps seen, over all configurations
        self._natives: dict[str, Any] = {}  # trial hooks, kept across their blocks
        self._samples: list[dict[str, Any]] = []
        self._wanted = spec.samples
        self._skip = spec.warmup
        self._last: tuple[int, int, float] | None = None  # (reducer id, its steps, time)
        # The reducer told to check each step's gradients for NaN/Inf while tuning.
        self._checked_reducer: int | None = None
        self.error: str | None = None
        self.link: str | None = None  # rank 0: the link the model used

    def initial_hook(self) -> Any:
        return hook_for(_LOSSLESS)

    def summary(self) -> dict[str, Any]:
        """What was decided (``model.auto_choice()``)."""
        return {"policy": self.spec.policy, "choice": self.choice,
                "chosen_at_step": self.chosen_at_step, "current": self.current,
                "history": list(self.history), "error": self.error, "link": self.link,
                "measured_step_ms": dict(self.measured),
                "trial_step_ms": {n: list(t) for n, t in self.times.items()},
                "predicted_step_ms": dict(self.predicted)}

    def before_forward(self) -> None:
        if self.choice is not None:
            return
        now = time.perf_counter()
        stats = self.ddp.comm_stats()
        reducer = id(self.ddp._reducer)
        if self._checked_reducer != reducer:  # a new reducer (a rebuild) checks too
            self._checked_reducer = reducer
            self.ddp._reducer.set_track_finite(True)
        last, self._last = self._last, (reducer, stats["steps"], now)
        if last is None or last[:2] != (reducer, stats["steps"] - 1):
            return  # no synchronized step completed since the last forward seen
        self.step += 1
        if self.ddp._reducer.last_step_finite() is False:
            return  # an overflow (GradScaler skips that step): no figure from it
        if self._skip > 0:
            self._skip -= 1
            return
        step_ms = (now - last[2]) * 1e3
        if self._planned:
            self.times.setdefault(self.current, []).append(step_ms)
        else:
            self._samples.append({"step_ms": step_ms, "stats": stats, "shapes": self._shapes()})
        self._wanted -= 1
        if self._wanted > 0:
            return
        if not self._planned:
            self._planned = True
            self._plan_trials()
        self._next_block()

    def _next_block(self) -> None:
        """The next trial block (the same configuration again just goes on), or the choice."""
        self._wanted = _BLOCK_SAMPLES
        if not self.queue:
            self._choose()
        elif (name := self.queue.pop(0)) != self.current:
            self._switch(name, fresh=False)
        # else: a second block in a row of the same configuration; measure on

    def _shapes(self) -> list[list[tuple[int, ...]]]:
        params = self.ddp._reducer_params
        return [[tuple(params[i].shape) for i in b] for b in self.ddp._reducer.bucket_plan()]

    def _plan_trials(self) -> None:
        """Rank 0 ranks the candidates with the cost model; every rank gets the trial list.
        Trials run in blocks ordered A B .. Z Z .. B A (Z: the baseline), so that load
        drifting linearly over the trials biases no candidate."""
        order = [-1] * self.spec.trials
        link, hier_links = self._probe_links()
        if self.rank0:
            self.measured[_LOSSLESS] = statistics.median(s["step_ms"] for s in self._samples)
            try:
                tries = self._worth_trying(self._predict(link, hier_links))[: self.spec.trials]
                order[: len(tries)] = [self.names.index(n) for n in tries]
            except Exception as e:  # noqa: BLE001 -- a failed model keeps the baseline
                self.error = f"{type(e).__name__}: {e}"
        tries = [self.names[i] for i in self._broadcast(order) if i >= 0]
        self.queue = [*tries, _LOSSLESS, _LOSSLESS, *reversed(tries)] if tries else []

    def _hier_groups(self) -> tuple | None:
        """(intra, inter) groups where the ranks span several nodes (Note [auto on several
        nodes]), else None. Every rank makes them here, in the same order."""
        where = "fastddp.hooks.auto"
        if self.spec.policy == "lossless":
            return None
        emulated = isinstance(self.group, EmulatedLinkGroup)
        base = self.group.inner if emulated else self.group
        if self.spec.groups is not None:
            intra, inter = self.spec.groups
            _hierarchical.check_groups(intra, inter, base, where)
            return intra, inter
        local = self.spec.local_size
        if local is None and (local := _local_size_from_env(base)) is None:
            return None
        intra, inter = _hierarchical.groups_from_local_size(local, base, where)
        if emulated:  # the launcher's --emulate-link: one link for every group
            return EmulatedLinkGroup(intra, self.group.link), EmulatedLinkGroup(
                inter, self.group.link)
        return intra, inter

    def _probe_links(self) -> tuple[Link, tuple[Link, Link] | None]:
        """The model group's link and, on several nodes, the intra- and inter-node links."""
        params = self.ddp._reducer_params
        device = params[0].device
        largest = max(sum(params[i].numel() for i in b) for b in self.ddp._reducer.bucket_plan())
        link = self._probe(self.group, largest, device)
        if self.hier_groups is None:
            return link, None
        intra, inter = self.hier_groups
        # The inter-node collectives carry a shard: 1/local of the bucket.
        return link, (self._probe(intra, largest, device),
                      self._probe(inter, -(-largest // intra.size()), device))

    def _probe(self, group: dist.ProcessGroup, numel: int, device: torch.device) -> Link:
        """The link as ``group`` serves it (every rank takes part, aligned by the first
        probe, so rank skew does not count as transfer time): the latency is the median time
        of a one-element allreduce, the bus bandwidth that of an allreduce of ``numel``
        elements (at most 16 MB) less the latency. Emulation and the real transport are
        both in it: the candidates will get exactly this link."""
        tiny = torch.zeros(1, device=device)
        big = torch.zeros(min(numel, _PROBE_MAX_NUMEL), device=device)
        latency_s = statistics.median(_time_allreduce(group, tiny)
                                      for _ in range(_LATENCY_PROBES))
        big_s = statistics.median(_time_allreduce(group, big) for _ in range(_BANDWIDTH_PROBES))
        bus_bytes = bus_factor("allreduce", group.size()) * big.numel() * 4
        transfer_s = big_s - latency_s
        bus_gbs = _UNBOUNDED_GBS if transfer_s <= 0 else min(
            _UNBOUNDED_GBS, bus_bytes / transfer_s / 1e9)
        return Link(bus_gbs, latency_s * 1e6)

    def _training_link(self, probed: Link) -> Link:
        """The probed link, slowed to what the baseline's large collectives saw in training
        where that was slower: on a shared CPU the transport competes with the backward for
        the cores, which is what compression would then save. Only buckets whose transfer
        takes at least twice the latency at the probed bandwidth count (in a small one,
        rank skew and latency dominate, and no compression shortens those)."""
        n = self.group.size()
        bus_bytes = served_ms = 0.0
        for sample in self._samples:
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

    def _predict(self, probed: Link, hier_probed: tuple[Link, Link] | None) -> list[str]:
        link = self._training_link(probed)
        hier = None
        if hier_probed is not None:
            # The transport's slowdown in training (shared cores) hits every group's.
            slow = link.bus_gbs / probed.bus_gbs
            intra, inter = (Link(x.bus_gbs * slow, x.latency_us) for x in hier_probed)
            hier = (self.hier_groups[0].size(), intra, inter)
        costs = advise.kernel_costs([s for b in self._samples[-1]["shapes"] for s in b],
                                    str(self.ddp._reducer_params[0].device))
        caps = [c for n in self.names if (c := advise.variant_cap(n)) is not None]
        result = advise.advise(self._samples, link, _LOSSLESS, costs, caps_mb=caps, hier=hier)
        rows = [r for r in result["candidates"] if r["candidate"] in self.names]
        self.predicted = {r["candidate"]: r["predicted_step_ms"] for r in rows}
        self.link = str(link) + ("" if hier is None else f"; intra-node {hier[1]}, inter-node "
                                 f"{hier[2]}")
        return [r["candidate"] for r in rows]

    def _worth_trying(self, ranked: list[str]) -> list[str]:
        """The best predicted of each family (other bucket sizes, 16-bit wires, PowerSGD
        ranks), best first, among those predicted to beat the baseline by 2%. The model ranks
        within a family better than across families: on a CPU the transport takes the
        backward's cores, which it does not see, and PowerSGD costs more than its bytes
        (benchmarks/results/auto.md: PowerSGD predicted first, measured slower than bf16).
        So each family that qualifies gets a real trial, and the measured lossy_margin
        decides. On a compute-bound step none qualifies."""
        baseline = self.predicted[_LOSSLESS]
        families: dict[str, str] = {}
        for name in ranked:
            if name != _LOSSLESS and self.predicted[name] <= baseline * (1 - _MIN_PREDICTED_GAIN):
                families.setdefault(_family(name), name)
        return list(families.values())

    def _choose(self) -> None:
        index = -1
        if self.rank0:
            self.measured.update({n: statistics.median(t) for n, t in self.times.items()})
            index = self.names.index(self._best_measured())
        self.choice = self.names[self._broadcast([index])[0]]
        self.chosen_at_step = self.step
        self._switch(self.choice, fresh=True)
        self.ddp._reducer.set_track_finite(False)  # tuned: no check per step from here
        self._natives.clear()
        if self.rank0 and self.spec.verbose:
            print(self.log_line(), flush=True)

    def _best_measured(self) -> str:
        """The fastest median; a lossy one only if its median and each of its blocks' medians
        beat the fastest lossless median by the margin. A win in one block and not in the
        other is load, not the hook: on a compute-bound step (communication hidden) a loaded
        CPU had measured PowerSGD 5% faster than plain allreduce over its two blocks together."""
        lossless = min((n for n in self.measured if not lossy(n)), key=self.measured.get)
        best = min(self.measured, key=self.measured.get)
        if not lossy(best):
            return best
        times = self.times.get(best, [])
        blocks = [times[i:i + _BLOCK_SAMPLES] for i in range(0, len(times), _BLOCK_SAMPLES)]
        bound = (1 - self.spec.lossy_margin) * self.measured[lossless]
        if max([self.measured[best], *map(statistics.median, blocks)]) > bound:
            return lossless
        return best

    def log_line(self) -> str:
        def figures(name: str) -> str:
            predicted = self.predicted.get(name)
            return (f"{self.measured[name]:.2f} ms measured"
                    + ("" if predicted is None else f", {predicted:.2f} predicted"))
        others = "; ".join(f"{n} {figures(n)}" for n in sorted(self.measured, key=self.measured.get)
                           if n != self.choice)
        tried = (f"; also tried {others}" if others else
                 "; no other candidate was predicted to beat it by its margin")
        note = f" (cost model failed: {self.error})" if self.error else ""
        return (f"[fastddp] auto:{self.spec.policy} chose {self.choice} from step "
                f"{self.chosen_at_step}: {figures(self.choice)} a step{tried}{note}")

    def _switch(self, name: str, fresh: bool) -> None:
        """Installs ``name`` between two steps: its hook from its earlier block (PowerSGD
        keeps its warm-up count and error feedback) unless ``fresh``. The steps right after
        a switch (and a PowerSGD hook's plain warm-up steps) are not measured."""
        from fastddp import hooks

        cap = advise.variant_cap(name)
        cap_bytes = int((cap if cap is not None else self.cap_mb) * _MIB)
        rebuilt = cap_bytes != self.ddp.bucket_bytes_cap
        native = None if fresh else self._natives.get(name)
        first = native is None
        if first:
            native = hooks.resolve(None, hook_for(name, self.hier_groups), self.group,
                                   self.ddp._reducer_params)
            self._natives[name] = native
        self._install(native, cap_bytes)
        self.current, self._samples = name, []
        self.history.append((self.step, name, first))
        self._last = (id(self.ddp._reducer), self.ddp.comm_stats()["steps"], time.perf_counter())
        # After a rebuild, the first step runs on the not yet reordered buckets.
        self._skip = _SWITCH_WARMUP + (1 if rebuilt else 0) + (
            _POWERSGD_START_ITER if first and name in _POWERSGD else 0)

    def _broadcast(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (one small broadcast on the model's group)."""
        device = self.ddp._reducer_params[0].device
        t = torch.tensor(values, dtype=torch.int64, device=device)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()
        return t.tolist()


def _time_allreduce(group: dist.ProcessGroup, t: torch.Tensor) -> float:
    t0 = time.perf_counter()
    group.allreduce([t]).wait()
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
    return time.perf_counter() - t0


def _local_size_from_env(group: dist.ProcessGroup) -> int | None:
    """torchrun's LOCAL_WORLD_SIZE where it makes 2 or more nodes of 2 or more ranks of
    ``group`` (which must span the world), else None: one node, nothing hierarchical."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not text.strip().isdigit():
        return None
    local, world = int(text), group.size()
    if local < 2 or world % local or world // local < 2 or world != dist.get_world_size():
        return None
    return local
