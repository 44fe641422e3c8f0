"""The two process groups of a hierarchical reduction (Note [hierarchical reduction] in
csrc/hooks/hierarchical/hierarchical.h): ``intra``, this rank's node, and ``inter``, the ranks with this
rank's local index on every node. From a 2-D DeviceMesh with dims ("node", "local"), from
a local size (torchrun's LOCAL_WORLD_SIZE by default), or given as two groups.

Ranks are node-major, as torchrun numbers them: node k holds ranks k*local .. k*local+local-1.
"""

import os
from typing import Any

import torch
import torch.distributed as dist

from fastddp import _group_ops

MESH_DIMS = ("node", "local")


def check_mesh(mesh: Any, where: str) -> None:
    """Raises ValueError naming what is wrong with a hierarchical mesh (no group needed)."""
    names = getattr(mesh, "mesh_dim_names", None)
    if getattr(mesh, "ndim", None) != 2:
        raise ValueError(f"{where}: mesh must be a 2-D DeviceMesh with dims {MESH_DIMS}, got "
                         f"{getattr(mesh, 'ndim', type(mesh).__name__)} dims")
    if tuple(names or ()) != MESH_DIMS:
        raise ValueError(f"{where}: mesh dims must be named {MESH_DIMS} (node-major), got "
                         f"{names}; build it with init_device_mesh(device, (nodes, local), "
                         f"mesh_dim_names={MESH_DIMS})")
    nodes, local = mesh.size(0), mesh.size(1)
    if nodes < 2:
        raise ValueError(f"{where}: the mesh's 'node' dimension is 1 (shape {tuple(mesh.shape)}):"
                         " with one node there is no inter-node link; use the inner hook "
                         "directly")
    if local < 2:
        raise ValueError(f"{where}: the mesh's 'local' dimension is 1 (shape "
                         f"{tuple(mesh.shape)}): with one rank per node there is nothing to "
                         "reduce inside a node; use the inner hook directly")


def check_local_size(local_size: int, where: str) -> None:
    if isinstance(local_size, bool) or not isinstance(local_size, int):
        raise TypeError(f"{where}: local_size must be an int, got {type(local_size).__name__}")
    if local_size < 2:
        raise ValueError(f"{where}: local_size={local_size}: with fewer than 2 ranks per node "
                         "there is nothing to reduce inside a node; use the inner hook directly")


def local_size_from_env(where: str) -> int:
    """torchrun's LOCAL_WORLD_SIZE, checked."""
    text = os.environ.get("LOCAL_WORLD_SIZE")
    if text is None:
        raise ValueError(f"{where}: LOCAL_WORLD_SIZE is not set (not started by torchrun?); "
                         "pass local_size= or mesh=")
    if not text.strip().isdigit():
        raise ValueError(f"{where}: LOCAL_WORLD_SIZE={text!r} is not a positive integer")
    return int(text)


def groups_from_mesh(mesh: Any, process_group: dist.ProcessGroup,
                     where: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(intra, inter) of a checked mesh that must tile ``process_group``'s ranks."""
    check_mesh(mesh, where)
    mesh_ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    group_ranks = sorted(_model_group_ranks(process_group))
    if mesh_ranks != group_ranks:
        raise ValueError(f"{where}: the mesh (shape {tuple(mesh.shape)}, ranks "
                         f"{_short(mesh_ranks)}) does not tile the model's process group "
                         f"({len(group_ranks)} ranks: {_short(group_ranks)})")
    return mesh.get_group("local"), mesh.get_group("node")


def groups_from_local_size(local_size: int, process_group: dist.ProcessGroup,
                           where: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(intra, inter) for node-major ranks of ``process_group``, which must span the world
    (every rank creates every group, in the same order)."""
    check_local_size(local_size, where)
    world = process_group.size()
    if world != dist.get_world_size():
        raise NotImplementedError(f"{where}: the model's process group has {world} of "
                                  f"{dist.get_world_size()} ranks; pass mesh= or groups= for a "
                                  "hierarchical reduction over part of the world")
    if world % local_size != 0:
        raise ValueError(f"{where}: local_size={local_size} does not divide the world size "
                         f"{world}")
    if world // local_size < 2:
        raise ValueError(f"{where}: local_size={local_size} makes one node of the {world} "
                         "ranks: there is no inter-node link; use the inner hook directly")
    ranks = _model_group_ranks(process_group)
    nodes = world // local_size
    intra_ranks = [ranks[k * local_size:(k + 1) * local_size] for k in range(nodes)]
    inter_ranks = [ranks[j::local_size] for j in range(local_size)]
    intra, _ = dist.new_subgroups_by_enumeration(intra_ranks)
    inter, _ = dist.new_subgroups_by_enumeration(inter_ranks)
    return intra, inter


def _model_group_ranks(process_group: dist.ProcessGroup) -> list[int]:
    """The world ranks of the model's group, in its rank order. A group written in Python
    need not be in c10d's group map, where dist.get_process_group_ranks looks: then every
    rank's world rank is gathered through the group itself (_group_ops.global_ranks), on the
    device the world's backend carries (NCCL: this rank's GPU)."""
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    return _group_ops.global_ranks(process_group, device)


def check_groups(intra: Any, inter: Any, process_group: dist.ProcessGroup, where: str) -> None:
    for name, group in (("intra", intra), ("inter", inter)):
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{where}: the {name} group must be a ProcessGroup, got "
                            f"{type(group).__name__}")
        if group.size() < 2:
            raise ValueError(f"{where}: the {name} group has {group.size()} rank; a "
                             "hierarchical reduction needs at least 2 in each")
    if intra.size() * inter.size() != process_group.size():
        raise ValueError(f"{where}: intra ({intra.size()} ranks) x inter ({inter.size()} ranks) "
                         f"does not tile the model's process group of {process_group.size()}")


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 16 else f"[{ranks[0]}, ..., {ranks[-1]}]"
