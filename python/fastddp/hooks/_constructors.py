"""Communication hooks for fastddp.DistributedDataParallel.

Built-ins run in C++ (no Python per bucket)::

    model.register_comm_hook(None, fastddp.hooks.bf16())
    model.register_comm_hook(None, fastddp.hooks.bf16(accumulate="fp32", error_feedback=True))
    model.register_comm_hook(None, fastddp.hooks.fp16())
    model.register_comm_hook(None, fastddp.hooks.int8())
    model.register_comm_hook(None, fastddp.hooks.fp8(format="e5m2", error_feedback=False))
    model.register_comm_hook(None, fastddp.hooks.allreduce())
    model.register_comm_hook(None, fastddp.hooks.powersgd(matrix_approximation_rank=2,
                                                          start_powerSGD_iter=10))
    model.register_comm_hook(None, fastddp.hooks.batched_powersgd(start_powerSGD_iter=10))
    model.register_comm_hook(None, fastddp.hooks.hierarchical(inter=fastddp.hooks.bf16()))

torch's own hook functions are recognized and run by the same C++ code:
``default_hooks.allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``, and
``fp16_compress_wrapper(allreduce_hook)`` / ``bf16_compress_wrapper(allreduce_hook)``, and
``powerSGD_hook`` and ``batched_powerSGD_hook`` with a ``PowerSGDState`` (its settings
are read at registration; its training state is loaded into the native hook, and read back
from it whenever Python reads the state, so torch's checkpoint recipe works: see
fastddp._powersgd_state). Any other callable ``hook(state, bucket) -> torch.futures.Future`` runs as it
would under torch DDP, on a real ``torch.distributed.GradBucket``.

A built-in hook object is also a torch-style Python hook: calling it runs the same algorithm
in plain torch ops, so ``torch_ddp.register_comm_hook(None, fastddp.hooks.bf16())`` gives the
reference that fastddp's native path is tested against, bit for bit.
"""

import inspect
from typing import Any

import torch
import torch.distributed as dist

from fastddp import _C, _hierarchical
from fastddp._powersgd_args import options_from_state, powersgd_options
from fastddp.auto import AutoHook

__all__ = ["AutoHook", "CommHook", "allreduce", "auto", "batched_powersgd", "bf16", "fp16",
           "fp8", "from_registry", "hierarchical", "hierarchical_groups", "int8",
           "native_torch_hooks", "powersgd"]

_WRAPPERS = {
    "fp16_compress_wrapper.<locals>.fp16_compress_wrapper_hook": "fp16",
    "bf16_compress_wrapper.<locals>.bf16_compress_wrapper_hook": "bf16",
}
_HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_TORCH_REFERENCES = {"powersgd": " (torch's powerSGD_hook is its reference)",
                     "powersgd_batched": " (torch's batched_powerSGD_hook is its reference)"}
# torch's PowerSGD hook functions (by name in powerSGD_hook) and the native hooks that run them.
_POWERSGD_HOOKS = {"powerSGD_hook": "powersgd", "batched_powerSGD_hook": "powersgd_batched"}


class CommHook:
    """A registered C++ comm hook (`name` in the registry) with its options.

    Pass it to ``model.register_comm_hook(state, hook)``; `state` is None (the model's
    process group) or a process group. Calling it as ``hook(state, bucket)`` runs the
    pure-torch reference of the built-ins (what torch DDP would run).
    """

    def __init__(self, name: str, **options: Any):
        self.name = name
        self.options = options
        # torch's register_comm_hook reads these.
        self.__name__ = f"fastddp_{name}_hook"
        self.__qualname__ = self.__name__
        self._residuals: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"fastddp.hooks.{self.name}({args})"

    def native(self, process_group: dist.ProcessGroup) -> "_C.CommHook":
        """The C++ hook for `process_group` (built by the registry)."""
        return _C.create_comm_hook(self.name, process_group, self.options)

    def __call__(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state if state is not None else dist.group.WORLD
        if self.name == "allreduce":
            return _reference_allreduce(group, bucket)
        if self.name in _HALF_DTYPES:
            return self._reference_half(group, bucket)
        raise NotImplementedError(f"{self!r} has no pure-torch reference"
                                  + _TORCH_REFERENCES.get(self.name, ""))

    def _reference_half(self, group: dist.ProcessGroup,
                        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The algorithm of HalfCompressHook (Note [half compression]) in torch ops."""
        dtype = _HALF_DTYPES[self.name]
        world = group.size()
        buffer = bucket.buffer()
        n = buffer.numel()
        fp32_accumulate = self.options.get("accumulate", self.name) == "fp32"
        error_feedback = self.options.get("error_feedback", False)
        wire = torch.zeros((n + world - 1) // world * world, dtype=dtype, device=buffer.device)
        if not fp32_accumulate and not error_feedback:
            # Note [torch's half rounding]: torch's _compress_hook, cast then divide.
            wire[:n] = buffer.to(dtype).div_(world)
        else:
            scaled = buffer * (1.0 / world)
            if error_feedback:
                residual = self._gather_residuals(bucket, scaled)
                scaled = scaled + residual
            wire[:n] = scaled.to(dtype)
            if error_feedback:
                self._scatter_residuals(bucket, scaled - wire[:n].to(scaled.dtype))

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(wire[:n])
            return buffer

        if self.options.get("accumulate", self.name) != "fp32":
            return dist.all_reduce(wire, group=group, async_op=True).get_future().then(decompress)
        shards = torch.empty_like(wire)
        dist.all_to_all_single(shards, wire, group=group)
        rows = shards.view(world, -1)
        total = rows[0].float()
        for r in range(1, world):
            total = total + rows[r].float()
        return _all_gather_single(wire, total.to(dtype), group=group,
                                  async_op=True).get_future().then(decompress)

    def _gather_residuals(self, bucket: dist.GradBucket, like: torch.Tensor) -> torch.Tensor:
        parts = []
        for p in bucket.parameters():
            r = self._residuals.get(id(p))
            parts.append(r if r is not None else torch.zeros(p.numel(), dtype=like.dtype,
                                                             device=like.device))
        return torch.cat(parts)

    def _scatter_residuals(self, bucket: dist.GradBucket, residual: torch.Tensor) -> None:
        # Per parameter, like the native hook: the residuals outlive a bucket rebuild.
        offset = 0
        for p in bucket.parameters():
            self._residuals[id(p)] = residual[offset:offset + p.numel()].clone()
            offset += p.numel()


# torch 2.14 renamed all_gather_into_tensor (and warns on the old name).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _reference_allreduce(group: dist.ProcessGroup,
                         bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    buffer.mul_(1.0 / group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


def allreduce() -> CommHook:
    """The default reduction: gradients scaled by 1/world_size, one float allreduce."""
    return CommHook("allreduce")


def bf16(accumulate: str = "bf16", error_feedback: bool = False) -> CommHook:
    """BF16 gradient compression, fused into the copy-in and the write-back.

    accumulate="bf16": one bfloat16 allreduce (sums in bfloat16, as torch's
    ``bf16_compress_hook``). accumulate="fp32": the same bytes on the wire (alltoall of
    bfloat16 shards, allgather of the reduced shard), but each shard is summed in float32
    and rounded once. error_feedback=True adds each parameter's rounding residual to its
    next gradient.
    """
    return CommHook("bf16", **_half_options("bf16", accumulate, error_feedback))


def fp16(accumulate: str = "fp16", error_feedback: bool = False) -> CommHook:
    """FP16 gradient compression; options as :func:`bf16` (accumulate="fp16" or "fp32")."""
    return CommHook("fp16", **_half_options("fp16", accumulate, error_feedback))


def int8(error_feedback: bool = True) -> CommHook:
    """Int8 gradient compression with float32 accumulation (Note [8-bit wire formats] in
    csrc/hooks/quant8_hook.h): symmetric int8 codes with one float32 scale per block of 256
    values; an alltoall of the 8-bit shards, a float32 sum of each shard, an allgather of
    the re-quantized sums: about 1/4 of float32's bytes on the wire, 1/2 of bf16's.
    error_feedback=True (the default) adds each parameter's quantization error to its next
    gradient. Float32 gradients only."""
    return CommHook("int8", error_feedback=_bool_option("int8", "error_feedback",
                                                        error_feedback))


def fp8(format: str = "e4m3", error_feedback: bool = True) -> CommHook:  # noqa: A002
    """FP8 gradient compression with float32 accumulation, as :func:`int8` but with fp8
    codes: ``format="e4m3"`` (float8_e4m3fn: 3 mantissa bits, largest 448) or ``"e5m2"``
    (2 mantissa bits, largest 57344), each block of 256 values scaled so its largest
    magnitude maps to the format's largest finite value."""
    if format not in ("e4m3", "e5m2"):
        raise ValueError(f"fastddp.hooks.fp8: format must be 'e4m3' or 'e5m2', got {format!r}")
    return CommHook("fp8", format=format,
                    error_feedback=_bool_option("fp8", "error_feedback", error_feedback))


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
    return CommHook("powersgd", **powersgd_options(
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
    return CommHook("powersgd_batched", **powersgd_options(
        "fastddp.hooks.batched_powersgd", matrix_approximation_rank, start_powerSGD_iter,
        min_compression_rate, use_error_feedback, warm_start, orthogonalization_epsilon,
        random_seed, batch_tensors_with_same_shape, compression_stats_logging_frequency))


class HierarchicalHook(CommHook):
    """:func:`hierarchical`'s hook: the C++ HierarchicalHook over two groups it makes (or is
    given) for the model's process group, with `inter` built on the inter-node group."""

    def __init__(self, inter: CommHook, mesh: Any = None, local_size: int | None = None,
                 groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None):
        super().__init__("hierarchical")
        self.inter = inter
        self.mesh = mesh
        self.local_size = local_size
        self.groups = groups
        # id(model group) -> (model group, intra, inter): groups are made once per model group.
        self._made: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]] = {}

    def __repr__(self) -> str:
        where = (f"mesh={self.mesh!r}" if self.mesh is not None else "groups=..."
                 if self.groups is not None else f"local_size={self.local_size}")
        return f"fastddp.hooks.hierarchical(inter={self.inter!r}, {where})"

    def node_groups(self, process_group: dist.ProcessGroup
                    ) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """(intra, inter) for a model over `process_group`; made on first use (a collective
        call: every rank registers the hook, as every rank registers any hook)."""
        made = self._made.get(id(process_group))
        if made is not None:
            return made[1], made[2]
        where = repr(self)
        if self.groups is not None:
            intra, inter = self.groups
            _hierarchical.check_groups(intra, inter, process_group, where)
        elif self.mesh is not None:
            intra, inter = _hierarchical.groups_from_mesh(self.mesh, process_group, where)
        else:
            local = (self.local_size if self.local_size is not None
                     else _hierarchical.local_size_from_env(where))
            intra, inter = _hierarchical.groups_from_local_size(local, process_group, where)
        self._made[id(process_group)] = (process_group, intra, inter)
        return intra, inter

    def native(self, process_group: dist.ProcessGroup) -> "_C.CommHook":
        intra, inter = self.node_groups(process_group)
        return _C.create_hierarchical_comm_hook(intra, inter, self.inter.native(inter))


def hierarchical(inter: CommHook | None = None, mesh: Any = None, local_size: int | None = None,
                 groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
                 ) -> HierarchicalHook:
    """Hierarchical reduction for multi-node jobs (Note [hierarchical reduction] in
    csrc/hooks/hierarchical.h): per bucket, a float reduce-scatter inside the node, the
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
        _hierarchical.check_mesh(mesh, where)
    if local_size is not None:
        _hierarchical.check_local_size(local_size, where)
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
    local = local_size if local_size is not None else _hierarchical.local_size_from_env(where)
    return _hierarchical.groups_from_local_size(local, group, where)


def auto(policy: str = "any", **settings: Any) -> AutoHook:
    """fastddp picks the hook and bucket size itself in the first steps (Note [auto tuning]
    in fastddp/auto.py). ``policy``: ``lossless`` (plain allreduce, bucket sizes only),
    ``bf16`` (also 16-bit wires) or ``any`` (also 8-bit wires and PowerSGD). ``settings``:
    AutoHook's ``warmup``, ``samples``, ``trials``, ``lossy_margin``, ``verbose``, and for
    jobs on several nodes ``local_size`` (default torchrun's LOCAL_WORLD_SIZE) or
    ``groups=(intra, inter)``, as for :func:`hierarchical`: then ``bf16`` and ``any`` also
    try hierarchical reduction (Note [auto on several nodes]). Register it with state None;
    ``model.auto_choice()`` tells what was chosen."""
    return AutoHook(policy, **settings)


def _from_powersgd_state(state: Any, name: str) -> tuple[dist.ProcessGroup | None, CommHook]:
    """torch's PowerSGDState as the native hook `name`: its settings, iteration and generator."""
    return state.process_group, CommHook(name, **options_from_state(state))


def from_registry(name: str, **options: Any) -> CommHook:
    """Any hook in the C++ registry, built-in or added by another extension."""
    if name not in _C.comm_hook_names():
        raise ValueError(f"no comm hook named {name!r}; registered: {_C.comm_hook_names()}")
    return CommHook(name, **options)


def _half_options(name: str, accumulate: str, error_feedback: bool) -> dict[str, Any]:
    if accumulate not in (name, "fp32"):
        raise ValueError(f"fastddp.hooks.{name}: accumulate must be {name!r} or 'fp32', "
                         f"got {accumulate!r}")
    if not isinstance(error_feedback, bool):
        raise TypeError(f"fastddp.hooks.{name}: error_feedback must be a bool, "
                        f"got {type(error_feedback).__name__}")
    return {"accumulate": accumulate, "error_feedback": error_feedback}


def _bool_option(name: str, option: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"fastddp.hooks.{name}: {option} must be a bool, "
                        f"got {type(value).__name__}")
    return value


def native_torch_hooks() -> dict[str, str]:
    """torch hook functions that fastddp runs natively, and the built-in that runs them."""
    return {
        "default_hooks.allreduce_hook": "allreduce",
        "default_hooks.fp16_compress_hook": "fp16",
        "default_hooks.bf16_compress_hook": "bf16",
        "default_hooks.fp16_compress_wrapper(allreduce_hook)": "fp16",
        "default_hooks.bf16_compress_wrapper(allreduce_hook)": "bf16",
        "powerSGD_hook.powerSGD_hook (with a PowerSGDState)": "powersgd",
        "powerSGD_hook.batched_powerSGD_hook (with a PowerSGDState)": "powersgd_batched",
    }


def _torch_builtin(hook: Any) -> str | None:
    """The fastddp built-in equivalent to one of torch's default hooks, or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

    direct = {dh.allreduce_hook: "allreduce", dh.fp16_compress_hook: "fp16",
              dh.bf16_compress_hook: "bf16"}
    if not inspect.isfunction(hook):
        return None
    if hook in direct:
        return direct[hook]
    half = _WRAPPERS.get(hook.__qualname__)
    if half is None or hook.__module__ != dh.__name__ or hook.__closure__ is None:
        return None
    # The wrapper's closure holds the hook it wraps; only allreduce_hook is equivalent.
    cells = dict(zip(hook.__code__.co_freevars, hook.__closure__))
    wrapped = cells.get("hook")
    try:
        return half if wrapped is not None and wrapped.cell_contents is dh.allreduce_hook else None
    except ValueError:  # an empty cell
        return None


def check_comm_hook(hook: Any) -> None:
    """torch DDP's checks of a hook's signature, with torch's exceptions and messages.
    (torch's extra "BF16 ... required CUDA 11+ and NCCL 2.10+" check does not apply:
    fastddp runs bf16 hooks on gloo too.)"""
    if isinstance(hook, (CommHook, AutoHook)):
        return
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    sig = inspect.signature(hook)
    if (sig.parameters["bucket"].annotation != inspect._empty
            and sig.parameters["bucket"].annotation != dist.GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if (sig.return_annotation != inspect._empty
            and sig.return_annotation != torch.futures.Future[torch.Tensor]):
        raise ValueError("Communication hook: return annotation should be "
                         "torch.futures.Future[torch.Tensor].")


def resolve(state: object, hook: Any, process_group: dist.ProcessGroup,
            params: list[torch.Tensor]) -> "_C.CommHook":
    """The C++ hook that runs `hook(state, ...)` for a model over `process_group`."""
    if isinstance(hook, AutoHook):
        raise TypeError(f"{hook!r} is resolved by the model it is registered on")
    if isinstance(hook, CommHook):
        if state is not None and not isinstance(state, dist.ProcessGroup):
            raise ValueError(f"{hook!r}: state must be None (the model's process group) or a "
                             f"ProcessGroup, got {type(state).__name__}")
        return hook.native(state if state is not None else process_group)
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    native_name = next((n for f, n in _POWERSGD_HOOKS.items() if hook is getattr(psgd, f)), None)
    if native_name is not None and isinstance(state, psgd.PowerSGDState):
        group, native = _from_powersgd_state(state, native_name)
        # torch's hook reduces over state.process_group, or WORLD when it is None.
        return native.native(group if group is not None else dist.group.WORLD)
    builtin = _torch_builtin(hook)
    if builtin is not None and (state is None or isinstance(state, dist.ProcessGroup)):
        # torch's hooks reduce over `state`, or WORLD when it is None.
        group = state if state is not None else dist.group.WORLD
        return CommHook(builtin).native(group)
    name = getattr(hook, "__qualname__", type(hook).__name__)
    return _C.PythonCommHook(state, hook, params, name)


def builtin_for_type(comm_hook_type: Any) -> CommHook:
    """torch's dist.BuiltinCommHookType as a fastddp built-in."""
    if comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
        return allreduce()
    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
        return fp16()
    raise NotImplementedError(f"fastddp: built-in comm hook type {comm_hook_type} is not supported")
