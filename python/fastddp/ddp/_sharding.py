"""The model's side of the sharded optimizer (fastddp.optim.ShardedOptimizer): its buckets cut
into one equal shard per rank, their gradients reduce-scattered into those shards in
backward, and the parameters of each bucket moved into one flat buffer of the bucket's
layout, so that a rank's shard of the parameters is one contiguous range and the all-gather
after the step writes straight into the parameters.

Note [sharded buckets, Python side]
C++ owns the layout (Note [sharded buckets] in csrc/reducer/bucket.h): ``shard_buckets``
pads every bucket to ``world`` equal shards and keeps the plan (no rebuild from the first
step's order); this module reads the result (``bucket_layout``) and never re-derives it.
Per bucket it makes two tensors: ``grad``, this rank's shard of the averaged gradient (the
reduce-scatter's output, ``_C.create_reduce_scatter_comm_hook``), and ``params``, the flat
parameter buffer that every parameter of the bucket is now a view of (``p.data`` swapped
for the view, as torch's own mixed precision swaps it; the Parameter objects, their hooks
and the reducer's grad accumulators stay). Element e of a slot is the same element of the
parameter in both buffers: views are laid out with the strides of the bucket's views,
which ``bucket_layout`` hands back.

What the model refuses once sharded, and why: another comm hook (the shard would not be
reduce-scattered), find_unused_parameters and static_graph (a parameter unused on every
rank would be stepped with a zero gradient where torch's optimizer skips it),
mixed_precision (its master weights are a second copy the shard does not hold), the
overlapped optimizer, delay_all_reduce_named_params, and the Python reducer of compiled
autograd. Each raises NotImplementedError naming itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fastddp import _C
from fastddp.ddp.distributed import DistributedDataParallel

_WHO = "fastddp.optim.ShardedOptimizer"


@dataclass
class BucketShard:
    """One bucket as the sharded optimizer sees it (Note [sharded buckets, Python side])."""
    params: list[torch.Tensor]   # the bucket's parameters, in buffer order
    offsets: list[int]           # each parameter's first element in the buffers
    numels: list[int]
    flat: torch.Tensor           # the parameters' flat buffer, the bucket's whole length
    grad: torch.Tensor           # this rank's shard of the averaged gradient
    start: int                   # where this rank's shard begins in `flat`

    @property
    def shard(self) -> torch.Tensor:
        """This rank's shard of the parameters: a view of ``flat``."""
        return self.flat.narrow(0, self.start, self.grad.numel())

    def all_gather(self, group: Any) -> Any:
        """Every rank's updated shard of ``flat`` into ``flat``, in place, launched: a Work
        to ``wait()`` on. C++ makes the shard views (collectives.h says why they never reach
        Python: a gloo worker may release them, and must not need the GIL to)."""
        return _C.all_gather_in_place(group, self.flat)


def _refuse(ddp: Any) -> None:
    def no(what: str, why: str) -> None:
        message = f"{_WHO}: not with {what}: {why}"
        ddp.logger.set_error_and_log(message)
        raise NotImplementedError(message)

    if getattr(ddp, "_sharded", None) is not None:
        raise RuntimeError(f"{_WHO}: this model's gradients are sharded already, for another "
                           "ShardedOptimizer; one optimizer holds all of a model's shards")
    if ddp._use_python_reducer:
        no("compiled autograd's Python reducer (optimize_ddp='python_reducer')",
           "it reduces per parameter, outside the buckets that are sharded")
    if ddp._comm_hooks:
        hook = ddp._comm_hooks[0][0]
        no(f"the registered comm hook {getattr(hook, '__qualname__', repr(hook))}",
           "the sharded optimizer reduce-scatters each bucket itself, and a hook that needs "
           "the whole gradient (PowerSGD, ACP-SGD) cannot run on a shard")
    if ddp.mixed_precision is not None:
        no("mixed_precision", "its full-precision master weights are a second copy of the "
           "parameters that the shards do not hold")
    if ddp.find_unused_parameters or ddp.static_graph:
        no("find_unused_parameters or static_graph", "a parameter unused on every rank "
           "would be stepped with a zero gradient, where torch's optimizer skips it")
    if ddp._overlap is not None:
        no("overlap_optimizer", "the model already steps another optimizer in backward")
    if ddp._delayed is not None:
        no("delay_all_reduce_named_params", "those parameters are averaged outside the "
           "buckets")
    if any(p.is_sparse or getattr(p, "_is_sparse_grad", False) for p in ddp._reducer_params) \
            or any(ddp._expect_sparse):
        no("sparse gradients", "a sparse gradient has no contiguous shard")


def shard_gradients(ddp: Any, release_buckets: bool = False, wire: str = "fp32",
                    grad_dtype: torch.dtype | None = None) -> list[BucketShard]:
    """Cuts ``ddp``'s buckets into one shard per rank, reduce-scatters their gradients from
    the next backward on (``.grad`` stays None; the shards hold the average), and makes each
    bucket's parameters views of one flat buffer. ``release_buckets`` (ZeRO-2): the
    buckets' buffers exist only while a backward reduces. ``wire``: the reduce-scatter's
    ("fp32", or "bf16" / "fp16" for float32 gradients). ``grad_dtype``: the averaged
    shards' dtype, float32 for 16-bit parameters (summed in float32, never rounded to 16
    bits); default the parameters'. Raises NotImplementedError, before anything changes,
    for what it cannot shard."""
    _refuse(ddp)
    if not ddp._reducer_params:
        raise ValueError(f"{_WHO}: the model has no parameter that requires grad")
    if wire != "fp32":
        other = sorted({str(p.dtype) for p in ddp._reducer_params} - {"torch.float32"})
        if other:
            raise NotImplementedError(f"{_WHO}: gradient_wire={wire!r} carries float32 "
                                      f"gradients; the model has {', '.join(other)} ones")
    if ddp._reducer is None:  # world size 1: the reducer is what reduce-scatters
        ddp._build_reducer()
    group = ddp.process_group
    world, rank = group.size(), group.rank()
    ddp._reducer.shard_buckets(world, release_buckets)
    buckets = []
    with torch.no_grad():
        for indices, offsets, numels, strides, length in ddp._reducer.bucket_layout():
            params = [ddp._reducer_params[i] for i in indices]
            like = params[0]
            flat = torch.zeros(length, dtype=like.dtype, device=like.device)
            for p, offset, stride in zip(params, offsets, strides):
                view = flat.as_strided(p.shape, stride, offset)  # the bucket view's layout
                view.copy_(p)
                p.data = view
            shard = length // world
            buckets.append(BucketShard(
                params=params, offsets=list(offsets),
                numels=list(numels), flat=flat,
                grad=torch.zeros(shard, dtype=grad_dtype or like.dtype, device=like.device),
                start=rank * shard))
    hook = _C.create_reduce_scatter_comm_hook(group, [b.grad for b in buckets], wire,
                                              release_buckets)
    ddp._reducer.set_comm_hook(hook)
    ddp._native_hook = hook
    ddp._sharded = buckets
    return buckets


def averaged_parameters(ddp: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters ``ddp`` averages (its reducer's, in its order), with their names;
    TypeError for anything but a fastddp.DistributedDataParallel."""
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"{_WHO}: expected a fastddp.DistributedDataParallel, got "
                        f"{type(ddp).__name__}")
    return list(zip(ddp._reducer_param_names, ddp._reducer_params))


def synchronized_backwards(ddp: Any) -> int:
    """How many synchronized backwards the model has reduced: a step reads its shards only
    after a new one."""
    return ddp._reducer.num_backward_syncs
