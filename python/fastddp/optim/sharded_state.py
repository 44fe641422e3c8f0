"""The sharded optimizer's state in torch's format: gathered from the shards onto one rank
(``ShardedOptimizer.consolidate_state_dict``), and cut back into shards from a whole state
dict (``ShardedOptimizer.load_state_dict``).

Note [sharded optimizer state]
A rank holds, per bucket and param group, the state of its runs (views of the bucket's flat
parameter buffer, Note [sharded optimizer]). A state tensor of a run's size (exp_avg,
momentum_buffer, ...) is elementwise: laid side by side at the runs' offsets it is a flat
buffer of the bucket's layout, so a parameter's state is that buffer seen with the
parameter's own view (its offset and strides in the bucket), exactly as the parameter is a
view of the flat parameter buffer. A state of no size (Adam's step) is the same for every
run: each rank steps all of its runs at every step. The format is what torch's optimizer
over ``model.parameters()`` (and the same param groups) would give: state keyed by the
parameter's position in the param groups, and the groups' hyperparameters with ``params``
as those positions; a plain torch optimizer loads it, and this one loads a plain one's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fastddp import _group_ops


def _run_start(run: torch.Tensor, bucket: Any) -> int:
    return run.storage_offset() - bucket.flat.storage_offset()


def _param_view(flat: torch.Tensor, p: torch.Tensor, bucket: Any) -> torch.Tensor:
    """``flat`` (a buffer of the bucket's layout) seen as parameter ``p`` is seen in the
    bucket's flat parameter buffer."""
    return flat.as_strided(p.shape, p.stride(), p.storage_offset() - bucket.flat.storage_offset())


def _runs(opt: Any, b: int) -> list[torch.Tensor]:
    return [run for group in opt._inners[b].param_groups for run in group["params"]]


def _keys(opt: Any) -> tuple[dict[str, torch.dtype], dict[str, torch.Tensor]]:
    """The state's elementwise keys (with their dtypes) and its scalar state, from whichever
    rank holds a run (a rank may hold none of a small bucket)."""
    elementwise: dict[str, torch.dtype] = {}
    scalars: dict[str, torch.Tensor] = {}
    for b in range(len(opt._buckets)):
        for run in _runs(opt, b):
            for key, value in opt._inners[b].state.get(run, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    elementwise[key] = value.dtype
                else:
                    scalars[key] = value
    everyone: list = [None] * opt._group.size()
    dist.all_gather_object(everyone, (elementwise, {k: v.cpu() if torch.is_tensor(v) else v
                                                    for k, v in scalars.items()}),
                           group=opt._group)
    for theirs, their_scalars in everyone:
        elementwise.update(theirs)
        for key, value in their_scalars.items():
            scalars.setdefault(key, value)
    return elementwise, scalars


def consolidate(opt: Any, to: int) -> dict | None:
    """The whole state dict on rank ``to`` (None elsewhere); every rank must call it."""
    elementwise, scalars = _keys(opt)
    rank, world = opt._group.rank(), opt._group.size()
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    state: dict[int, dict] = {}
    for b, bucket in enumerate(opt._buckets):
        lo, size = bucket.start, bucket.grad.numel()
        for key, dtype in sorted(elementwise.items()):
            mine = torch.zeros(size, dtype=dtype, device=bucket.flat.device)
            for run in _runs(opt, b):
                value = opt._inners[b].state.get(run, {}).get(key)
                if value is not None:
                    mine.narrow(0, _run_start(run, bucket) - lo, run.numel()).copy_(value)
            whole = [torch.empty_like(mine) for _ in range(world)] if rank == to else []
            # Consolidating is often the last thing before exit: C++ aliases (_group_ops).
            _group_ops.gather(opt._group, mine, whole, to)
            if rank != to:
                continue
            flat = torch.cat(whole)
            for p in bucket.params:
                entry = state.setdefault(index[id(p)], {})
                entry[key] = _param_view(flat, p, bucket).clone(memory_format=torch.preserve_format)
        if rank == to:
            for p in bucket.params:
                entry = state.setdefault(index[id(p)], {})
                for key, value in scalars.items():
                    entry[key] = value.clone().to(p.device) if torch.is_tensor(value) else value
    if rank != to:
        return None
    # torch's order: the state by parameter position
    return {"state": {i: state[i] for i in sorted(state)},
            "param_groups": indexed_groups(opt.param_groups)}


def indexed_groups(param_groups: list[dict]) -> list[dict]:
    """``param_groups`` as torch's ``state_dict()`` writes them: every hyperparameter, and
    in place of the parameters their positions, counted across the groups."""
    groups, start = [], 0
    for group in param_groups:
        count = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(start, start + count))})
        start += count
    return groups


def take_consolidated(opt: Any, who: str, each_rank_holds: str) -> dict:
    """``state_dict()`` of a sharded optimizer: what its ``consolidate_state_dict()`` left
    on this rank, handed out once; a RuntimeError naming the call where there is none."""
    if getattr(opt, "_consolidated", None) is None:
        raise RuntimeError(
            f"{who}.state_dict(): each rank holds {each_rank_holds}; call "
            "consolidate_state_dict(to=rank) on every rank first, then state_dict() on "
            "that rank (as with torch's ZeroRedundancyOptimizer)")
    state, opt._consolidated = opt._consolidated, None
    return state


def load(opt: Any, state_dict: dict) -> None:
    """Every rank: its runs' state cut from the whole ``state_dict`` (torch's format)."""
    groups = state_dict["param_groups"]
    if len(groups) != len(opt.param_groups) or any(
            len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, opt.param_groups)):
        raise ValueError(
            "fastddp.optim.ShardedOptimizer.load_state_dict: the state dict's param groups "
            f"({[len(g['params']) for g in groups]} parameters) do not match this "
            f"optimizer's ({[len(g['params']) for g in opt.param_groups]})")
    position = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    saved = state_dict["state"]
    for b, bucket in enumerate(opt._buckets):
        inner = opt._inners[b]
        inner.state.clear()
        entries = {id(p): saved.get(position[id(p)]) for p in bucket.params}
        keys = {k for e in entries.values() if e for k, v in e.items()
                if torch.is_tensor(v) and v.dim() > 0}
        flats = {}
        for key in keys:
            like = next(e[key] for e in entries.values() if e and key in e)
            flat = torch.zeros(bucket.flat.numel(), dtype=like.dtype, device=bucket.flat.device)
            for p in bucket.params:
                entry = entries[id(p)]
                if entry and key in entry:
                    _param_view(flat, p, bucket).copy_(entry[key])
            flats[key] = flat
        scalars = next(({k: v for k, v in e.items() if not (torch.is_tensor(v) and v.dim() > 0)}
                        for e in entries.values() if e), {})
        for run in _runs(opt, b):
            start = _run_start(run, bucket)
            state = {key: flat.narrow(0, start, run.numel()).clone() for key, flat in flats.items()}
            for key, value in scalars.items():
                state[key] = value.clone().to(run.device) if torch.is_tensor(value) else value
            if state:
                inner.state[run] = state
    for mine, theirs in zip(opt.param_groups, groups):
        mine.update({k: v for k, v in theirs.items() if k != "params"})



# Note [sharded checkpoint]
# torch.distributed.checkpoint (DCP) writes each key once: a plain tensor under the same key on
# every rank is taken as replicated. So each rank's state goes under keys of its own,
# "rank<r>.b<b>.g<g>.r<i>.<state key>" (bucket, param group, run), and the layout (the world
# size and every bucket's length) under "layout", the same on every rank. The state dict's
# tensors are the optimizer's own: DCP's load writes into them in place. A fresh optimizer has
# no state yet; it is made first (torch's own initialization, by a step with a learning rate
# of 0 whose parameters and gradients are put back), so that the state dict names every
# tensor the checkpoint holds. Loading needs the same world size and layout; at another,
# consolidate_state_dict() / load_state_dict() move the state instead.

def _materialize(opt: Any) -> None:
    """Makes the state of every run that has none, as its first step would, changing no
    parameter, gradient or hyperparameter."""
    for b, inner in enumerate(opt._inners):
        runs = _runs(opt, b)
        if not runs or all(run in inner.state for run in runs):
            continue
        bucket = opt._buckets[b]
        kept = (bucket.flat.clone(), bucket.grad.clone())
        lrs = [group["lr"] for group in inner.param_groups]
        bucket.grad.zero_()  # a finite gradient: lr 0 times it is 0
        try:
            for group in inner.param_groups:
                group["lr"] = 0.0 if not torch.is_tensor(group["lr"]) else group["lr"] * 0
            inner.step()
        finally:
            for group, lr in zip(inner.param_groups, lrs):
                group["lr"] = lr
            bucket.flat.copy_(kept[0])
            bucket.grad.copy_(kept[1])
        for run in runs:  # a step count of 0, as before any step
            for key, value in inner.state.get(run, {}).items():
                if torch.is_tensor(value) and value.dim() == 0:
                    value.zero_()


def layout(opt: Any) -> torch.Tensor:
    return torch.tensor([opt._group.size()] + [b.flat.numel() for b in opt._buckets])


def sharded(opt: Any) -> dict:
    """This rank's state for DCP (Note [sharded checkpoint])."""
    _materialize(opt)
    rank = opt._group.rank()
    out: dict[str, Any] = {"layout": layout(opt)}
    for b, inner in enumerate(opt._inners):
        for g, group in enumerate(inner.param_groups):
            for i, run in enumerate(group["params"]):
                for key, value in inner.state.get(run, {}).items():
                    out[f"rank{rank}.b{b}.g{g}.r{i}.{key}"] = value
    return out


def check_layout(opt: Any, saved: torch.Tensor) -> None:
    mine = layout(opt)
    if not torch.equal(saved.cpu(), mine):
        raise ValueError(
            "fastddp.optim.ShardedOptimizer: this sharded checkpoint was saved by "
            f"{int(saved[0])} ranks with buckets of {saved[1:].tolist()} elements; this run "
            f"has {int(mine[0])} ranks and buckets of {mine[1:].tolist()}. Resume at another "
            "world size or layout through a consolidated state dict "
            "(consolidate_state_dict() / load_state_dict())")
