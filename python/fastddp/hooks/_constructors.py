"""The constructors of fastddp's built-in hooks (``fastddp.hooks.bf16()``, ``powersgd()``,
``hierarchical()``, ``auto()``, ...): each checks its arguments, naming the culprit, and
returns the hook object to register."""

from typing import Any

import torch.distributed as dist

from fastddp import _C
from fastddp.hooks import catalog, node_groups
from fastddp.hooks.auto_hook import AutoHook
from fastddp.hooks._comm_hook import CommHook, HierarchicalHook
from fastddp.hooks._powersgd_args import powersgd_options


def allreduce() -> CommHook:
    """The default reduction: gradients scaled by 1/world_size, one float allreduce."""
    return _checked("allreduce")


def bf16(accumulate: str = "bf16", error_feedback: bool = False) -> CommHook:
    """BF16 gradient compression, fused into the copy-in and the write-back.

    accumulate="bf16": one bfloat16 allreduce (sums in bfloat16, as torch's
    ``bf16_compress_hook``). accumulate="fp32": the same bytes on the wire (alltoall of
    bfloat16 shards, allgather of the reduced shard), but each shard is summed in float32
    and rounded once. error_feedback=True adds each parameter's rounding residual to its
    next gradient.
    """
    return _checked("bf16", accumulate=accumulate, error_feedback=error_feedback)


def fp16(accumulate: str = "fp16", error_feedback: bool = False) -> CommHook:
    """FP16 gradient compression; options as :func:`bf16` (accumulate="fp16" or "fp32")."""
    return _checked("fp16", accumulate=accumulate, error_feedback=error_feedback)


def noop() -> CommHook:
    """No communication, as torch's ``debugging_hooks.noop_hook``: each rank keeps its own
    gradients. For timing a step without DDP's averaging, not for training."""
    return _checked("noop")


def int8(error_feedback: bool = True) -> CommHook:
    """Int8 gradient compression with float32 accumulation (Note [8-bit wire formats] in
    csrc/hooks/quant8/quant8_hook.h): symmetric int8 codes with one float32 scale per block of 256
    values; an alltoall of the 8-bit shards, a float32 sum of each shard, an allgather of
    the re-quantized sums: about 1/4 of float32's bytes on the wire, 1/2 of bf16's.
    error_feedback=True (the default) adds each parameter's quantization error to its next
    gradient. Float32 gradients only."""
    return _checked("int8", error_feedback=error_feedback)


def fp8(format: str = "e4m3", error_feedback: bool = True) -> CommHook:  # noqa: A002
    """FP8 gradient compression with float32 accumulation, as :func:`int8` but with fp8
    codes: ``format="e4m3"`` (float8_e4m3fn: 3 mantissa bits, largest 448) or ``"e5m2"``
    (2 mantissa bits, largest 57344), each block of 256 values scaled so its largest
    magnitude maps to the format's largest finite value."""
    return _checked("fp8", format=format, error_feedback=error_feedback)


def powersgd(matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
             min_compression_rate: float = 2, use_error_feedback: bool = True,
             warm_start: bool = True, orthogonalization_epsilon: float = 0,
             random_seed: int = 0, batch_tensors_with_same_shape: bool = False,
             compression_stats_logging_frequency: int = 10_000) -> CommHook:
    """PowerSGD low-rank compression, torch's ``powerSGD_hook`` run in C++.

    The arguments are ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState``'s
    (without the process group, which is the model's), and the
    gradients are torch's for the same arguments (within float rounding): allreduce for the
    first `start_powerSGD_iter` steps, then rank-`matrix_approximation_rank` P Q^T
    approximations of the matrices worth compressing, with error feedback and warm start.
    """
    return CommHook(catalog.hook("powersgd").factory, **powersgd_options(
        "fastddp.hooks.powersgd", matrix_approximation_rank, start_powerSGD_iter,
        min_compression_rate, use_error_feedback, warm_start, orthogonalization_epsilon,
        random_seed, batch_tensors_with_same_shape, compression_stats_logging_frequency))


def batched_powersgd(matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                     min_compression_rate: float = 2, use_error_feedback: bool = True,
                     warm_start: bool = True, orthogonalization_epsilon: float = 0,
                     random_seed: int = 0, batch_tensors_with_same_shape: bool = False,
                     compression_stats_logging_frequency: int = 10_000) -> CommHook:
    """Batched PowerSGD, torch's ``batched_powerSGD_hook`` run in C++: each bucket's flat
    gradient, zero-padded to a square, as one rank-`matrix_approximation_rank` P Q^T.

    Arguments and checks are :func:`powersgd`'s (torch's ``PowerSGDState``);
    `min_compression_rate`, `orthogonalization_epsilon` and `batch_tensors_with_same_shape`
    are accepted and unused, as by torch's batched hook.
    """
    return CommHook(catalog.hook("batched_powersgd").factory, **powersgd_options(
        "fastddp.hooks.batched_powersgd", matrix_approximation_rank, start_powerSGD_iter,
        min_compression_rate, use_error_feedback, warm_start, orthogonalization_epsilon,
        random_seed, batch_tensors_with_same_shape, compression_stats_logging_frequency))


def acpsgd(matrix_approximation_rank: int = 4, start_iter: int = 1_000,
           min_compression_rate: float = 2, orthogonalization_epsilon: float = 0,
           random_seed: int = 0) -> CommHook:
    """ACP-SGD (Zhang et al., ICDCS 2023): PowerSGD's rank-`matrix_approximation_rank`
    compression with error feedback and warm start, sending P on one step and Q on the next,
    so that each bucket takes one allreduce per step instead of PowerSGD's two (Note
    [acpsgd] in csrc/hooks/powersgd/acpsgd.h). Plain allreduce for the first `start_iter`
    steps. Which matrices are compressed, the first Q and the orthogonalization are
    :func:`powersgd`'s, with the same arguments.
    """
    return CommHook(catalog.hook("acpsgd").factory, **powersgd_options(
        "fastddp.hooks.acpsgd", matrix_approximation_rank, start_iter, min_compression_rate,
        True, True, orthogonalization_epsilon, random_seed, False, 10_000, "start_iter"))


def hierarchical(inter: CommHook | None = None, mesh: Any = None, local_size: int | None = None,
                 groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
                 ) -> HierarchicalHook:
    """Hierarchical reduction for multi-node jobs (Note [hierarchical reduction] in
    csrc/hooks/hierarchical/hierarchical.h): per bucket, a float reduce-scatter inside the node, the
    inter-node reduction of this rank's shard through `inter` (any fastddp built-in or
    registry hook: ``allreduce()``, ``bf16()``, ``bf16(accumulate="fp32")``, ...; default
    ``bf16()``), then an allgather inside the node. Only 1/local_size of each bucket (times
    `inter`'s compression) crosses the inter-node link per rank.

    The nodes come from, in this order: ``groups=(intra_group, inter_group)``; a 2-D
    ``mesh`` (``init_device_mesh(device, (nodes, local), mesh_dim_names=("node", "local"))``);
    ``local_size`` ranks per node; torchrun's ``LOCAL_WORLD_SIZE``. Ranks are node-major.
    Register with state None (the model's process group, which must span the world unless
    `mesh` or `groups` are given).
    """
    where = "fastddp.hooks.hierarchical"
    inter = bf16() if inter is None else inter
    if not isinstance(inter, CommHook) or isinstance(inter, HierarchicalHook):
        raise TypeError(f"{where}: inter must be a fastddp.hooks built-in such as "
                        f"fastddp.hooks.bf16(), got {inter!r}")
    if sum(x is not None for x in (mesh, local_size, groups)) > 1:
        raise ValueError(f"{where}: give at most one of mesh=, local_size= and groups=")
    if mesh is not None:
        node_groups.check_mesh(mesh, where)
    if local_size is not None:
        node_groups.check_local_size(local_size, where)
    if groups is not None and (not isinstance(groups, (tuple, list)) or len(groups) != 2):
        raise TypeError(f"{where}: groups must be (intra_group, inter_group)")
    return HierarchicalHook(inter, mesh=mesh, local_size=local_size,
                            groups=None if groups is None else tuple(groups))


def hierarchical_groups(local_size: int | None = None, process_group: dist.ProcessGroup | None
                        = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(intra, inter) process groups for node-major ranks, `local_size` (default torchrun's
    LOCAL_WORLD_SIZE) per node: for ``hierarchical(groups=...)``, e.g. wrapped in
    EmulatedLinkGroup's. A collective call: every rank calls it, in the same order."""
    where = "fastddp.hooks.hierarchical_groups"
    group = process_group if process_group is not None else dist.group.WORLD
    local = local_size if local_size is not None else node_groups.local_size_from_env(where)
    return node_groups.groups_from_local_size(local, group, where)


def auto(policy: str = "any", **settings: Any) -> AutoHook:
    """fastddp picks the hook and bucket size itself in the first steps (Note [auto tuning]
    in fastddp/tuning/auto.py). ``policy``: ``lossless`` (plain allreduce, bucket sizes only),
    ``bf16`` (also 16-bit wires) or ``any`` (also 8-bit wires and PowerSGD). ``settings``:
    AutoHook's ``warmup``, ``samples``, ``trials``, ``lossy_margin``, ``verbose``, and for
    jobs on several nodes ``local_size`` (default torchrun's LOCAL_WORLD_SIZE) or
    ``groups=(intra, inter)``, as for :func:`hierarchical`: then ``bf16`` and ``any`` also
    try hierarchical reduction (Note [auto on several nodes]). Register it with state None;
    ``model.auto_choice()`` tells what was chosen."""
    return AutoHook(policy, **settings)


def from_registry(name: str, **options: Any) -> CommHook:
    """Any hook in the C++ registry, built-in or added by another extension."""
    if name not in _C.comm_hook_names():
        raise ValueError(f"no comm hook named {name!r}; registered: {_C.comm_hook_names()}")
    return CommHook(name, **options)


def _checked(name: str, **options: Any) -> CommHook:
    """The registry hook of catalog entry `name` with `options` checked by the catalog."""
    entry = catalog.hook(name)
    return CommHook(entry.factory, **entry.checked(**options))
