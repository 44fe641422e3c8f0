"""``ShardedOptimizer``: the optimizer's state sharded over the ranks on fastddp's buckets
(ZeRO-1), for scripts that keep their DistributedDataParallel.

Note [sharded optimizer]
Each bucket is cut into one equal, aligned shard per rank (Note [sharded buckets] in
csrc/reducer/bucket.h). In backward the bucket's gradients are reduce-scattered as soon as
it is full, so each rank receives the average of its shard only, overlapping backward as
the allreduce does. ``step()`` runs torch's own optimizer (its for-loop, foreach or fused
implementation, as the user asks) on this rank's shard of every bucket: one tensor per run
of consecutive parameters of one param group, a view of the bucket's flat parameter buffer,
with the shard of the averaged gradient as its ``.grad``. The optimizer's state exists for
those views only: 1/world of it per rank. Then the updated shards are all-gathered, bucket
by bucket, straight into the parameters (each parameter is a view of its bucket's flat
buffer, fastddp/ddp/_sharding.py).

Why the numbers are torch's: SGD, Adam and AdamW update every element from that element's
parameter, gradient and state, and per-tensor scalars (the step count) that every run
shares, so stepping runs of a flat buffer gives the numbers of stepping whole parameters.
The average itself is torch DDP's copy-in (divided by the world size in the same pass) and
a sum over ranks; on 2 ranks a sum of two numbers is exact in any order, so the parameters
match torch DDP's bit for bit; on 3 or more the reduce-scatter may add in another order than
the allreduce (tests/python/optim/test_sharded.py bounds it). The padding between and after
slots is zero in the parameters and the gradients, and stays zero under these updates.

What a script sees: after a synchronized backward every parameter's ``.grad`` is None (no
rank holds a whole gradient); ``clip_grad_norm_`` is this object's method, which gives torch's
global norm from the shards (``torch.nn.utils.clip_grad_norm_(model.parameters())`` would
find no gradient). Under ``no_sync()`` the gradients accumulate in ``.grad`` as usual and the
next synchronized backward reduces the sum. ``param_groups`` are the user's, so learning-rate
schedulers work; their hyperparameters reach the shards' optimizer at every step.

Not yet, and refused rather than silently different: optimizers other than SGD, Adam and
AdamW (a whole-tensor optimizer needs shards cut on whole parameters:
ParameterShardedOptimizer, by_parameter.py),
``scaler.unscale_(optimizer)`` before ``scaler.step`` (GradScaler unscales ``.grad``, which
the shards are not; ``scaler.step(optimizer)`` itself unscales the shards and skips the step
on every rank when any rank finds an inf).
``state_dict()`` is torch's format, gathered onto one rank; ``sharded_state_dict()`` is each
rank's share for torch.distributed.checkpoint (sharded_state.py).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from fastddp import _group_ops
from fastddp.ddp import surface
from fastddp.optim import sharded_state

_WHO = "fastddp.optim.ShardedOptimizer"
# Elementwise updates: an element's new value depends on that element and on per-tensor
# scalars only, so a run of a flat buffer steps as the whole parameters would.
_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
# The reduce-scatter's wires (csrc/hooks/sharded/reduce_scatter.h).
# "fp8" is the fp8 hook's default format, e4m3.
_WIRES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "int8": "int8", "fp8": "e4m3",
          "e4m3": "e4m3", "e5m2": "e5m2"}


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` (torch's SGD, Adam or AdamW) over ``model``'s parameters, its
    state sharded over the ranks (Note [sharded optimizer])::

        model = fastddp.DistributedDataParallel(module)
        optimizer = fastddp.optim.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)

    ``params``: the parameters or param groups, as torch's optimizers take them (default:
    all of ``model``'s); they must be exactly the parameters the model averages.
    ``overlap_all_gather``: step() returns before the parameters are whole; each module's
    next forward waits for its own buckets (call ``wait()`` before reading them elsewhere).
    ``zero_stage=2``: the full gradient buffers exist only while a backward reduces; between
    steps a rank holds its shard of the averaged gradient alone.
    ``gradient_wire``: what the reduce-scatter sends: ``"fp32"`` (the gradients' dtype),
    ``"bf16"`` / ``"fp16"`` (float32 gradients at half the bytes, each rank's divided
    gradient rounded once, the sum over ranks in float32 rounded once; the shard stays
    float32), or ``"int8"`` / ``"fp8"`` (``"e4m3"``) / ``"e5m2"`` (about a quarter of the
    bytes: each rank's divided gradient block-quantized once as the int8 / fp8 hooks' wire,
    the ranks' rows dequantized and summed in float32, never re-quantized).
    ``main_weights="fp32"``, for bf16 or fp16 parameters (Megatron's mixed precision): each
    rank keeps a float32 copy of its shard of the parameters, which torch's
    optimizer steps with float32 state, from a float32 shard of the gradient (the ranks'
    16-bit gradients summed in float32); after the step the shard is rounded once into the
    16-bit parameters, which are all-gathered. The other keywords are ``optimizer_class``'s
    (``foreach=True`` and ``fused=True`` included).
    """

    def __init__(self, model: Any, optimizer_class: type, params: Iterable | None = None, *,
                 overlap_all_gather: bool = False, zero_stage: int = 1,
                 gradient_wire: str = "fp32", main_weights: str | None = None,
                 **defaults: Any):
        if main_weights not in (None, "fp32"):
            raise NotImplementedError(f"{_WHO}: main_weights={main_weights!r}: None (the "
                                      "parameters themselves) or 'fp32'")
        if main_weights is not None and gradient_wire != "fp32":
            raise NotImplementedError(
                f"{_WHO}: main_weights with gradient_wire={gradient_wire!r}: the 16-bit "
                "parameters' gradients already travel in their own format")
        if gradient_wire not in _WIRES:
            raise NotImplementedError(
                f"{_WHO}: gradient_wire={gradient_wire!r}: one of {', '.join(_WIRES)}")
        if optimizer_class not in _ELEMENTWISE:  # a subclass may step otherwise
            raise NotImplementedError(
                f"{_WHO}: {getattr(optimizer_class, '__name__', optimizer_class)!s} is not "
                "supported; the shards of a bucket cut parameters in pieces, which only an "
                "elementwise update (torch.optim.SGD, Adam, AdamW) steps as whole parameters; "
                "fastddp.optim.ParameterShardedOptimizer shards by whole parameters")
        averaged, groups = _checked_groups(model, params, _WHO)

        if zero_stage not in (1, 2):
            raise NotImplementedError(f"{_WHO}: zero_stage={zero_stage!r}: 1 (the optimizer's "
                                      "state sharded) or 2 (and the gradient buffers freed "
                                      "between backwards); 3 shards the parameters: FSDP")
        if main_weights is not None:
            other = sorted({str(p.dtype) for _, p in averaged}
                           - {"torch.bfloat16", "torch.float16"})
            if other:
                raise ValueError(f"{_WHO}: main_weights='fp32' keeps float32 copies of bf16 "
                                 f"or fp16 parameters; the model has {', '.join(other)} ones")
        self._model = model
        self._buckets = surface.shard_gradients(
            model, release_buckets=zero_stage == 2, wire=_WIRES[gradient_wire],
            grad_dtype=torch.float32 if main_weights is not None else None)
        # Per bucket, main_weights: the float32 copy of this rank's shard the optimizer steps.
        self._mains = [bucket.shard.float() if main_weights is not None else None
                       for bucket in self._buckets]
        self._group = model.process_group
        group_of = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
        # torch's optimizer per bucket over its runs, a param group per user group (maybe
        # empty here): a bucket steps, and its all-gather starts, while the next one steps.
        self._inners = [
            optimizer_class([{**{k: v for k, v in group.items() if k != "params"},
                              "params": runs[g]} for g, group in enumerate(groups)],
                            **defaults)
            for runs in (_runs(bucket, group_of, len(groups), main)
                         for bucket, main in zip(self._buckets, self._mains))]
        super().__init__(groups, self._inners[0].defaults)
        self._synced = surface.synchronized_backwards(model)
        self._gathers: list = [None] * len(self._buckets)  # pending all-gathers, by bucket
        self._overlap = overlap_all_gather
        self._hooks = (_wait_before_use(model.module, self._buckets, self._gathers)
                       if overlap_all_gather else [])

    # The user's param groups, with every hyperparameter: what LR schedulers change.
    def _sync_groups(self, inner: torch.optim.Optimizer) -> None:
        for mine, theirs in zip(self.param_groups, inner.param_groups):
            for key, value in mine.items():
                if key != "params":
                    theirs[key] = value

    def _check_gradients(self) -> None:
        synced = surface.synchronized_backwards(self._model)
        if synced == self._synced:
            raise RuntimeError(
                f"{_WHO}: step() without a synchronized backward since the last step; the "
                "shards hold no new gradient (under no_sync(), gradients wait in .grad for "
                "the next synchronized backward)")
        self._synced = synced
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    raise RuntimeError(
                        f"{_WHO}: a parameter of shape {tuple(p.shape)} has a .grad at step(): "
                        "a backward under no_sync() after the synchronized one; its "
                        "gradients would not be averaged. Run the synchronized backward last")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None,
             grad_scaler: Any = None) -> Any:
        """Steps this rank's shards with the user's hyperparameters, then all-gathers the
        updated parameters (Note [sharded optimizer])."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait()  # the last step's all-gathers (overlap_all_gather): done by now
        self._check_gradients()
        if grad_scaler is not None and self._unscale(grad_scaler):
            return loss  # an overflow on some rank: no rank steps, as GradScaler skips
        for b, (bucket, inner, main) in enumerate(zip(self._buckets, self._inners,
                                                      self._mains)):
            self._sync_groups(inner)
            inner.step()
            if main is not None:
                bucket.shard.copy_(main)  # rounded once into the 16-bit parameters
            self._gathers[b] = bucket.all_gather(self._group)
        if not self._overlap:
            self.wait()
        return loss

    def _unscale(self, scaler: Any) -> bool:
        """GradScaler's unscale and inf check on the shards, the inf found on any rank: every
        rank then skips the step alike (a rank's shards hold one part of each gradient, so a
        rank's own check is not the model's). Records the check where ``scaler.update()``
        reads it. Returns whether the step is skipped (one host read of the flag, as
        GradScaler's own step makes)."""
        state = scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.UNSCALED:
            raise NotImplementedError(
                f"{_WHO}: scaler.unscale_(optimizer) before scaler.step(optimizer) is not "
                "supported yet: GradScaler unscales the .grad of param_groups, which the "
                "shards are not; let scaler.step() unscale (clip_grad_norm_ then sees scaled "
                "gradients: scale max_norm by scaler.get_scale())")
        grads = [b.grad for b in self._buckets]
        found_inf = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
        inv_scale = scaler._scale.double().reciprocal().float().to(grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        _group_ops.all_reduce(self._group, found_inf, dist.ReduceOp.MAX)
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.UNSCALED
        return bool(found_inf.item())

    def wait(self) -> None:
        """Waits for the all-gathers of the last step: the parameters are whole again. With
        ``overlap_all_gather=True`` a module's forward waits for its own buckets; call this
        before reading the parameters outside a forward (an EMA copy, a checkpoint)."""
        for b, work in enumerate(self._gathers):
            if work is not None:
                work.wait()
                self._gathers[b] = None

    # GradScaler calls step(grad_scaler=...) for optimizers that say so: _unscale().
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the model's averaged gradients, from the
        shards: the global norm (one small allreduce), and every shard scaled by torch's
        factor. Returns the norm, as torch's does."""
        norm_type = float(norm_type)
        grads = [run.grad for inner in self._inners for group in inner.param_groups
                 for run in group["params"]]
        first = self._buckets[0].grad
        if norm_type == float("inf"):
            local = (torch.stack(torch._foreach_norm(grads, norm_type)).max() if grads
                     else first.new_zeros(()))
            _group_ops.all_reduce(self._group, local, dist.ReduceOp.MAX)
            total = local
        else:
            local = (torch.stack(torch._foreach_norm(grads, norm_type)).pow(norm_type).sum()
                     if grads else first.new_zeros(()))
            _group_ops.all_reduce(self._group, local)
            total = local.pow(1.0 / norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_coef_clamped
        if grads:
            torch._foreach_mul_(grads, coef)
        return total

    def _no_main_weights(self, what: str) -> None:
        if any(main is not None for main in self._mains):
            raise NotImplementedError(
                f"{_WHO}.{what}() with main_weights: torch's format has no place for the "
                "float32 main weights, and a checkpoint without them would resume from the "
                "16-bit parameters (a silently different number)")

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the shards' state onto rank ``to`` of the model's group, in torch's format
        (Note [sharded optimizer state]); every rank must call it. Then ``state_dict()`` on
        that rank returns it, as torch's ZeroRedundancyOptimizer does."""
        self._no_main_weights("consolidate_state_dict")
        self.wait()
        self._consolidated = sharded_state.consolidate(self, to)

    def state_dict(self) -> dict:
        """The state consolidated by ``consolidate_state_dict()``: what torch's optimizer over
        the same parameters and param groups would return, loadable into one."""
        return sharded_state.take_consolidated(self, _WHO, "1/world of the state")

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a whole state dict in torch's format (a consolidated one, or a plain torch
        optimizer's over the same parameters and groups) on every rank: each keeps its
        shards' part."""
        self._no_main_weights("load_state_dict")
        sharded_state.load(self, state_dict)

    def sharded_state_dict(self) -> dict:
        """This rank's share of the state for torch.distributed.checkpoint, under keys of its
        own (Note [sharded checkpoint]): ``dcp.save({"optimizer": opt.sharded_state_dict(),
        ...})``; to resume, ``sd = opt.sharded_state_dict()``, ``dcp.load({"optimizer": sd,
        ...})`` (it fills the optimizer's tensors in place), then
        ``opt.load_sharded_state_dict(sd)``. Same world size and layout only."""
        self._no_main_weights("sharded_state_dict")
        self.wait()
        return {"state": sharded_state.sharded(self),
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.param_groups]}

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        """After DCP filled ``state_dict`` (from ``sharded_state_dict()``): checks the layout
        and takes the param groups' hyperparameters."""
        self._no_main_weights("load_sharded_state_dict")
        sharded_state.check_layout(self, state_dict["state"]["layout"])
        for mine, theirs in zip(self.param_groups, state_dict["param_groups"]):
            mine.update(theirs)

    def save_sharded(self, checkpoint_id: str) -> None:
        """``dcp.save`` of this optimizer's shards alone, every rank its own."""
        import torch.distributed.checkpoint as dcp  # only for checkpoints: 0.3 s of imports
        dcp.save({"optimizer": self.sharded_state_dict()}, checkpoint_id=checkpoint_id)

    def load_sharded(self, checkpoint_id: str) -> None:
        """``dcp.load`` of ``save_sharded``'s checkpoint; a clear ValueError, before anything
        changes, when it was saved at another world size or layout."""
        import torch.distributed.checkpoint as dcp  # see save_sharded
        # The layout as saved, of its saved size (the bucket count may differ).
        entry = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata[
            "optimizer.state.layout"]
        saved = {"optimizer": {"state": {"layout": torch.zeros(entry.size, dtype=torch.long)}}}
        dcp.load(saved, checkpoint_id=checkpoint_id)
        sharded_state.check_layout(self, saved["optimizer"]["state"]["layout"])
        state = self.sharded_state_dict()
        dcp.load({"optimizer": state}, checkpoint_id=checkpoint_id)
        self.load_sharded_state_dict(state)

    def shard_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its shards' only)."""
        return sum(t.numel() * t.element_size() for inner in self._inners
                   for state in inner.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


def _checked_groups(model: Any, params: Iterable | None,
                    who: str) -> tuple[list, list[dict]]:
    """The model's averaged (name, parameter) pairs and the optimizer's param groups
    (default: all of the model's), checked to hold exactly the parameters the model
    averages, each once; ``who`` names the optimizer in errors."""
    averaged = surface.averaged_parameters(model)  # raises for another model
    owned = {id(p): name for name, p in averaged}
    groups = _param_groups(model if params is None else params)
    seen: dict[int, str] = {}
    for group in groups:
        for p in group["params"]:
            if id(p) not in owned:
                raise ValueError(
                    f"{who}: a parameter of shape {tuple(p.shape)} is not one the model "
                    "averages (another module's, one DistributedDataParallel ignores, or "
                    "one that does not require grad); every parameter must be the "
                    "model's")
            name = owned[id(p)]
            if id(p) in seen:
                raise ValueError(f"{who}: parameter '{name}' is in more than one param "
                                 "group")
            seen[id(p)] = name
    missing = [name for name, p in averaged if id(p) not in seen]
    if missing:
        raise NotImplementedError(
            f"{who}: the model averages parameter(s) {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''} that the optimizer does not hold; "
            "their gradients would be averaged for no optimizer to step (a second "
            "optimizer over part of one model is not supported)")
    return averaged, groups


def _param_groups(params: Any) -> list[dict]:
    """torch's optimizer argument as a list of groups, each with its own 'params' list."""
    if hasattr(params, "parameters") and callable(params.parameters):
        params = params.parameters()
    params = list(params)
    if not params:
        raise ValueError(f"{_WHO}: got an empty parameter list")
    if not isinstance(params[0], dict):
        params = [{"params": params}]
    groups = []
    for group in params:
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"{_WHO}: a param group must be a dict with 'params', got "
                            f"{type(group).__name__}")
        members = group["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        groups.append({**group, "params": members})
    return groups


def _runs(bucket: Any, group_of: dict[int, int], count: int,
          main: torch.Tensor | None) -> list[list[torch.Tensor]]:
    """Per param group, the runs of this rank's shard of ``bucket``: views of its flat
    parameter buffer (or of ``main``, the shard's float32 main weights) over consecutive
    slots of the group (with the zero padding between them), each with its shard of the
    averaged gradient as ``.grad``."""
    runs: list[list[torch.Tensor]] = [[] for _ in range(count)]
    lo, hi = bucket.start, bucket.start + bucket.grad.numel()
    current: list = []  # [group, start, end] of the run being extended
    for p, offset, numel in zip(bucket.params, bucket.offsets, bucket.numels):
        a, c = max(offset, lo), min(offset + numel, hi)
        if a >= c:
            continue
        g = group_of[id(p)]
        if current and current[0] == g:
            current[2] = c
            continue
        if current:
            runs[current[0]].append(_run(bucket, *current[1:], lo, main))
        current = [g, a, c]
    if current:
        runs[current[0]].append(_run(bucket, *current[1:], lo, main))
    return runs


def _wait_before_use(module: torch.nn.Module, buckets: list, gathers: list) -> list:
    """overlap_all_gather: a forward pre-hook on every module that holds parameters, waiting
    for the all-gathers of its parameters' buckets only (the first module to run waits for
    its buckets; later ones find theirs done or wait for them then). Returns the handles."""
    bucket_of = {id(p): b for b, bucket in enumerate(buckets) for p in bucket.params}
    handles = []
    for sub in module.modules():
        mine = sorted({bucket_of[id(p)] for p in sub.parameters(recurse=False)
                       if id(p) in bucket_of})
        if not mine:
            continue

        def wait(_module, _inputs, mine=mine):
            for b in mine:
                work = gathers[b]
                if work is not None:
                    work.wait()
                    gathers[b] = None
        handles.append(sub.register_forward_pre_hook(wait))
    return handles


def _run(bucket: Any, start: int, end: int, lo: int,
         main: torch.Tensor | None) -> torch.Tensor:
    run = (bucket.flat.narrow(0, start, end - start) if main is None
           else main.narrow(0, start - lo, end - start))
    run.grad = bucket.grad.narrow(0, start - lo, end - start)
    return run
