"""The object a fastddp built-in hook is: ``CommHook``, a hook of the C++ registry with its
options, whose call runs the same algorithm in torch ops (the reference fastddp's native path
is tested against, bit for bit, under torch DDP); and ``HierarchicalHook``, the C++
HierarchicalHook over the two process groups it makes for a model."""

from typing import Any

import torch
import torch.distributed as dist

from fastddp import _C, _group_ops
from fastddp.hooks import node_groups

_HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_TORCH_REFERENCES = {"powersgd": " (torch's powerSGD_hook is its reference)",
                     "powersgd_batched": " (torch's batched_powerSGD_hook is its reference)"}


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

        # On the group object, as torch DDP's reducer calls it (a group written in Python
        # need not be in c10d's group map: fastddp/_group_ops.py).
        if self.options.get("accumulate", self.name) != "fp32":
            return _group_ops.all_reduce(group, wire, async_op=True).get_future().then(decompress)
        shards = torch.empty_like(wire)
        _group_ops.all_to_all_single(group, shards, wire)
        rows = shards.view(world, -1)
        total = rows[0].float()
        for r in range(1, world):
            total = total + rows[r].float()
        return _group_ops.all_gather_single(group, wire, total.to(dtype)).get_future().then(
            decompress)

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


def _reference_allreduce(group: dist.ProcessGroup,
                         bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    buffer.mul_(1.0 / group.size())
    return _group_ops.all_reduce(group, buffer, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


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
            node_groups.check_groups(intra, inter, process_group, where)
        elif self.mesh is not None:
            intra, inter = node_groups.groups_from_mesh(self.mesh, process_group, where)
        else:
            local = (self.local_size if self.local_size is not None
                     else node_groups.local_size_from_env(where))
            intra, inter = node_groups.groups_from_local_size(local, process_group, where)
        self._made[id(process_group)] = (process_group, intra, inter)
        return intra, inter

    def native(self, process_group: dist.ProcessGroup) -> "_C.CommHook":
        intra, inter = self.node_groups(process_group)
        return _C.create_hierarchical_comm_hook(intra, inter, self.inter.native(inter))
