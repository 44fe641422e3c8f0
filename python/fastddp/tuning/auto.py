"""``--hook auto[:lossless|bf16|any]`` / ``fastddp.hooks.auto(policy)``: fastddp picks the
communication hook and bucket size itself, in the first steps of the run. Here: the tuner,
which measures, schedules the trials and installs the hooks; its decision rule is
_auto_choice.py's, the candidates' names candidates.py's, and ``AutoHook``
fastddp/hooks/auto_hook.py's.

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
   (fastddp/tuning/cost_model.py, as ``--advise`` does) and ranks the policy's candidates:
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
   of every candidate tried. When per-step synchronization bounds the step (Note [DiLoCo
   advice] in diloco_advice.py), it also prints, once, --advise's DiLoCo paragraph: auto
   never switches to DiLoCo itself (it changes the training algorithm), it says whether
   ``--sync diloco:H=...`` is predicted faster and whether the quality table supports it.

All ranks run the same state machine on the same step counts; rank 0 alone measures and
decides, and its decisions reach the others as one small broadcast on the model's process
group (the trial list, then the choice). No step is lost or doubled: a switch happens
between two steps, each step is reduced by exactly one configuration. While tuning, reading
``comm_stats()`` never waits (on a GPU the reducer then times every step, and the figures
are those of the latest step the device finished, Note [device timeline]); once chosen, a
forward costs one attribute check. While tuning, the reducer also checks each
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
from typing import Any

import torch
import torch.distributed as dist

from fastddp import _group_ops, hooks
from fastddp.hooks import node_groups
from fastddp.hooks.auto_hook import AutoHook
from fastddp.tuning import candidates
# lossy: the tests read it as auto.lossy.
from fastddp.tuning.candidates import HIER, LOSSLESS, LOW_RANK, lossy  # noqa: F401
from fastddp.link.emulator import EmulatedLinkGroup
from fastddp.link.model import Link, bus_factor
from fastddp.tuning import advise
from fastddp.tuning._auto_choice import (BLOCK_SAMPLES, best_measured, diloco_line, log_line,
                                         predict, worth_trying)

_MIB = 1024 * 1024
_POWERSGD_START_ITER = 2  # the least torch allows with error feedback
_LATENCY_PROBES = 5
_BANDWIDTH_PROBES = 3
_PROBE_MAX_NUMEL = 4 * 1024 * 1024  # 16 MB of fp32
_UNBOUNDED_GBS = 1e4  # a link whose transfer time is lost in its latency
_SWITCH_WARMUP = 1


def hook_for(name: str, groups: tuple | None = None) -> Any:
    """The fastddp.hooks built-in a candidate name stands for; hierarchical ones reduce over
    ``groups`` = (intra, inter)."""
    if name in HIER:
        if groups is None:
            raise ValueError(f"auto: candidate {name} needs the (intra, inter) groups")
        return hooks.hierarchical(inter=hook_for(name.removeprefix(candidates.HIER_PREFIX)),
                                  groups=groups)
    # The catalog's configuration (a bucket-cap variant, allreduce_fp32@16MB, is allreduce).
    candidate, rank = candidates.by_name(name.partition("@")[0])
    config = candidate.config
    options = dict(config.options)
    if rank is not None:
        options.update(matrix_approximation_rank=rank, **{config.start: _POWERSGD_START_ITER})
    return getattr(hooks, config.hook)(**options)


class AutoTuner:
    """Note [auto tuning], for one model. ``before_forward`` is its one entry point."""

    def __init__(self, model: Any, spec: AutoHook, install: Any):
        # model: the tuned model's TunerHandle (fastddp/ddp/_tuner_handle.py), what the
        # tuner may read and set of it.
        self.model, self.spec, self._install = model, spec, install
        self.group = model.process_group
        self.cap_mb = model.bucket_bytes_cap / _MIB
        self.hier_groups = self._hier_groups() if self.group.size() > 1 else None
        self.names = candidates.for_auto(spec, self.cap_mb, self.hier_groups is not None)
        self.rank0 = self.group.rank() == 0
        self.queue: list[str] = []  # the trial blocks still to run, after the current one
        self._planned = False
        self.current = LOSSLESS
        self.times: dict[str, list[float]] = {}  # rank 0: measured step ms per candidate
        self.measured: dict[str, float] = {}
        self.predicted: dict[str, float] = {}
        self.choice: str | None = None if self.group.size() > 1 else LOSSLESS
        self.chosen_at_step: int | None = None
        # (first step, configuration, installed afresh): what replays this run's numbers.
        self.history: list[tuple[int, str, bool]] = [(0, LOSSLESS, True)]
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
        self.diloco: dict[str, Any] | None = None  # rank 0: Note [DiLoCo advice]'s verdict

    def initial_hook(self) -> Any:
        return hook_for(LOSSLESS)

    def summary(self) -> dict[str, Any]:
        """What was decided (``model.auto_choice()``)."""
        return {"policy": self.spec.policy, "choice": self.choice,
                "chosen_at_step": self.chosen_at_step, "current": self.current,
                "history": list(self.history), "error": self.error, "link": self.link,
                "measured_step_ms": dict(self.measured),
                "trial_step_ms": {n: list(t) for n, t in self.times.items()},
                "predicted_step_ms": dict(self.predicted),
                "diloco": None if self.diloco is None else self.diloco["text"]}

    def before_forward(self) -> None:
        if self.choice is not None:
            return
        now = time.perf_counter()
        stats = self.model.comm_stats()
        reducer = self.model.reducer_id()
        if self._checked_reducer != reducer:  # a new reducer (a rebuild) checks too
            self._checked_reducer = reducer
            self.model.check_each_step(True)  # NaN/Inf checks, device figures of each step
        last, self._last = self._last, (reducer, stats["steps"], now)
        if last is None or last[:2] != (reducer, stats["steps"] - 1):
            return  # no synchronized step completed since the last forward seen
        self.step += 1
        if self.model.last_step_finite() is False:
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
        self._wanted = BLOCK_SAMPLES
        if not self.queue:
            self._choose()
        elif (name := self.queue.pop(0)) != self.current:
            self._switch(name, fresh=False)
        # else: a second block in a row of the same configuration; measure on

    def _shapes(self) -> list[list[tuple[int, ...]]]:
        params = self.model.params
        return [[tuple(params[i].shape) for i in b] for b in self.model.bucket_plan()]

    def _plan_trials(self) -> None:
        """Rank 0 ranks the candidates with the cost model; every rank gets the trial list.
        Trials run in blocks ordered A B .. Z Z .. B A (Z: the baseline), so that load
        drifting linearly over the trials biases no candidate."""
        order = [-1] * self.spec.trials
        link, hier_links = self._probe_links()
        if self.rank0:
            self.measured[LOSSLESS] = statistics.median(s["step_ms"] for s in self._samples)
            try:
                hier = None if hier_links is None else (self.hier_groups[0].size(), *hier_links)
                self.predicted, self.link, ranked, self.diloco = predict(
                    self._samples, self.names, self.group.size(),
                    str(self.model.params[0].device), link, hier)
                tries = self._worth_trying(ranked)[: self.spec.trials]
                order[: len(tries)] = [self.names.index(n) for n in tries]
            except Exception as e:  # noqa: BLE001 -- a failed model keeps the baseline
                self.error = f"{type(e).__name__}: {e}"
        tries = [self.names[i] for i in self._broadcast(order) if i >= 0]
        self.queue = [*tries, LOSSLESS, LOSSLESS, *reversed(tries)] if tries else []

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
            node_groups.check_groups(intra, inter, base, where)
            return intra, inter
        local = self.spec.local_size
        if local is None and (local := _local_size_from_env(base)) is None:
            return None
        intra, inter = node_groups.groups_from_local_size(local, base, where)
        if emulated:  # the launcher's --emulate-link: one link for every group
            return EmulatedLinkGroup(intra, self.group.link), EmulatedLinkGroup(
                inter, self.group.link)
        return intra, inter

    def _probe_links(self) -> tuple[Link, tuple[Link, Link] | None]:
        """The model group's link and, on several nodes, the intra- and inter-node links."""
        params = self.model.params
        device = params[0].device
        largest = max(sum(params[i].numel() for i in b) for b in self.model.bucket_plan())
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

    def _worth_trying(self, ranked: list[str]) -> list[str]:
        return worth_trying(ranked, self.predicted)

    def _choose(self) -> None:
        index = -1
        if self.rank0:
            self.measured.update({n: statistics.median(t) for n, t in self.times.items()})
            index = self.names.index(self._best_measured())
        self.choice = self.names[self._broadcast([index])[0]]
        self.chosen_at_step = self.step
        self._switch(self.choice, fresh=True)
        self.model.check_each_step(False)  # tuned: no check per step, the logger's sampling
        self._natives.clear()
        if self.rank0 and self.spec.verbose:
            print(self.log_line(), flush=True)
            # Once: _choose runs once per tuner. The choice above is not affected by it.
            if (line := diloco_line(self.diloco)) is not None:
                print(line, flush=True)

    def _best_measured(self) -> str:
        return best_measured(self.measured, self.times, self.spec.lossy_margin)

    def log_line(self) -> str:
        return log_line(self.spec.policy, self.choice, self.chosen_at_step, self.measured,
                        self.predicted, self.error)

    def _switch(self, name: str, fresh: bool) -> None:
        """Installs ``name`` between two steps: its hook from its earlier block (PowerSGD
        keeps its warm-up count and error feedback) unless ``fresh``. The steps right after
        a switch (and a PowerSGD hook's plain warm-up steps) are not measured."""
        cap = advise.variant_cap(name)
        cap_bytes = int((cap if cap is not None else self.cap_mb) * _MIB)
        rebuilt = cap_bytes != self.model.bucket_bytes_cap
        native = None if fresh else self._natives.get(name)
        first = native is None
        if first:
            native = hooks.resolve(None, hook_for(name, self.hier_groups), self.group,
                                   self.model.params)
            self._natives[name] = native
        self._install(native, cap_bytes)
        self.current, self._samples = name, []
        self.history.append((self.step, name, first))
        self._last = (self.model.reducer_id(), self.model.comm_stats()["steps"],
                      time.perf_counter())
        # After a rebuild, the first step runs on the not yet reordered buckets.
        self._skip = _SWITCH_WARMUP + (1 if rebuilt else 0) + (
            _POWERSGD_START_ITER if first and name in LOW_RANK else 0)

    def _broadcast(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (one small broadcast on the model's group)."""
        device = self.model.params[0].device
        t = torch.tensor(values, dtype=torch.int64, device=device)
        _group_ops.broadcast(self.group, t, src=0)
        return t.tolist()


def _time_allreduce(group: dist.ProcessGroup, t: torch.Tensor) -> float:
    t0 = time.perf_counter()
    _group_ops.all_reduce(group, t)  # waited on as C++ waits (a Python Work's wait(timeout))
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
