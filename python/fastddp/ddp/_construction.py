"""What fastddp.DistributedDataParallel checks and resolves when it is constructed: the
process group, the parameters the reducer takes (and which get sparse gradients), the
module's devices, and the inputs' device; and, later, the conversions (model.to(),
.double(), ...) that would leave the reducer behind."""

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn


def _not_yet(argument: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"fastddp.DistributedDataParallel: {argument} is not supported yet ({why})")


def _resolve_group(process_group, device_mesh, module: nn.Module) -> dist.ProcessGroup:
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        if device_mesh._get_root_mesh() != device_mesh:
            # A slice of a larger mesh: DDP over the data-parallel dimension, composed with
            # tensor parallel on another. As torch, before the parameters are collected: each
            # DTensor parameter becomes a plain local-shard parameter for the reducer, and
            # forward hooks rebuild the DTensors around every forward, so the gradients
            # reach the reducer as local shards (torch.distributed.tensor.parallel.ddp).
            from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

            _pre_dp_module_transform(module)
        return device_mesh.get_group(mesh_dim=0)
    if process_group is not None:
        return process_group
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fastddp.DistributedDataParallel needs a process group, but none is initialized: "
            "call torch.distributed.init_process_group() first (torchrun sets up its "
            "environment), or pass process_group=."
        )
    return dist.distributed_c10d._get_default_group()


def _params_for_reducer(module: nn.Module, ignore: set[str]) -> tuple[list[str], list[torch.Tensor]]:
    """Parameters that require grad, in registration order, each once (a tied
    parameter under its first name), as torch DDP orders them."""
    names, params, seen = [], [], set()
    for module_name, sub in module.named_modules():
        for param_name, p in sub.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if not p.requires_grad or name in ignore or id(p) in seen:
                continue
            seen.add(id(p))
            names.append(name)
            params.append(p)
    return names, params


def _expect_sparse_gradients(module: nn.Module, params: list[torch.Tensor]) -> list[bool]:
    """Which parameters get sparse gradients: the weights of nn.Embedding and
    nn.EmbeddingBag with sparse=True, as torch DDP decides."""
    sparse = {id(sub.weight) for sub in module.modules()
              if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse}
    return [id(p) in sparse for p in params]


def _check_module(module: nn.Module, all_params: list[torch.Tensor], params: list[torch.Tensor]) -> None:
    if not params:
        raise RuntimeError(
            "DistributedDataParallel is not needed when a module doesn't have any parameter "
            "that requires a gradient."
        )
    first_on: dict[torch.device, str] = {}
    for name, p in module.named_parameters():
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise RuntimeError(
                f"fastddp: parameter {name!r} is uninitialized (a lazy module). Run a dummy "
                "forward pass to initialize it before wrapping the module."
            )
        first_on.setdefault(p.device, name)
    if len(first_on) > 1:
        where = ", ".join(f"{name!r} on {dev}" for dev, name in first_on.items())
        raise ValueError(
            f"fastddp: the module's parameters are on several devices ({where}). "
            "fastddp.DistributedDataParallel needs every parameter on one device per process; "
            "move the module with module.to(device) first."
        )
    # As torch DDP (_passing_sync_batchnorm_handle): SyncBatchNorm's synchronized forward
    # needs a GPU, so a CPU module holding one is refused here rather than at its forward.
    if next(iter(first_on)).type == "cpu" and any(
            isinstance(sub, nn.SyncBatchNorm) for sub in module.modules()):
        raise ValueError("SyncBatchNorm layers only work with GPU modules")


def _resolve_device_ids(device_ids, output_device, device_type: str):
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    if not device_ids or device_type == "cpu":
        if device_ids or output_device:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with "
                f"single-device GPU modules or CPU modules, but got device_ids {device_ids}, "
                f"output_device {output_device}, and module parameters on {device_type}."
            )
        return None, None
    from torch._utils import _get_device_index

    ids = [_get_device_index(x, True) for x in device_ids]
    out = _get_device_index(output_device if output_device is not None else device_ids[0], True)
    return ids, out


def _move_inputs(inputs: tuple, kwargs: dict, device_type: str, index: int) -> tuple[tuple, dict]:
    from torch.distributed.utils import _to_kwargs

    moved, moved_kwargs = _to_kwargs(inputs, kwargs, torch.device(device_type, index), True)
    return moved[0], moved_kwargs[0]


def check_conversion(fn: Callable[[torch.Tensor], torch.Tensor], names: Sequence[str],
                     params: Sequence[torch.Tensor]) -> None:
    """Raises RuntimeError, before anything is converted, when `fn` (what nn.Module.to(),
    .double(), .half(), .cuda(), ... apply to each tensor) would change the dtype or device
    of a parameter the reducer holds.

    Changing a parameter's dtype or device (``param.data = ...``, which is what those do)
    drops its gradient accumulator, and with it the reducer's hook: the next backward makes
    a new accumulator and the parameter's gradients are silently no longer averaged (torch
    DDP does just that). `fn` is tried on an empty tensor of each dtype and device.
    """
    seen: set[tuple[torch.dtype, torch.device]] = set()
    for name, p in zip(names, params):
        if (p.dtype, p.device) in seen:
            continue
        seen.add((p.dtype, p.device))
        out = fn(torch.empty(0, dtype=p.dtype, device=p.device))
        if out.dtype != p.dtype or out.device != p.device:
            raise RuntimeError(
                f"fastddp: this conversion would make parameter {name!r} {out.dtype} on "
                f"{out.device} (it is {p.dtype} on {p.device}) after DistributedDataParallel "
                "was built, and its gradients would then no longer be averaged. Nothing was "
                "converted. Convert or move the module before wrapping it: module.to(...), "
                "then DistributedDataParallel(module)."
            )


# Initial buckets when gradients arrive in an unknown order (torch does the same:
# one bucket per dtype/device until the first backward shows the real order).
_NO_LIMIT = 2**63 - 1


def bucket_limits(caps: list[int], first: int, cap: int, rebuilt: bool
                  ) -> tuple[list[int], list[int]]:
    """The reducer's (initial, rebuild) bucket size limits: ``caps`` (bucket_cap_mb_list)
    when given; else one unlimited bucket until the rebuild by ready order into [first, cap]
    when ``rebuilt`` (static graph or no unused parameters); else torch's [first, cap]
    layout from the start, never rebuilt (the ready order changes with the used set)."""
    if caps:
        return caps, caps
    if rebuilt:
        return [_NO_LIMIT], [first, cap]
    initial = [first, cap] if first < cap else [cap]
    return initial, initial
