"""DDP over one dimension of a 2-D device mesh, composed with tensor parallel on the
other, as torch composes them: fastddp against torch DDP on the same data. Run on every
rank of a 4-rank harness world (see harness.py): a 2 x 2 mesh, ("dp", "tp")."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.scenarios import agree, assert_close_ulps


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different on each data-parallel rank; the same on the two ranks of a TP pair (tensor
    parallel needs one input per pair)."""
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _compare(ref: list[torch.Tensor], fast: list[torch.Tensor], what: str, where: str) -> None:
    # Bit for bit: the same TP collectives and a 2-rank dp allreduce (a + b, exact in
    # either order) run in both, so nothing may differ.
    assert len(ref) == len(fast) == 4, f"{where}: {len(ref)} and {len(fast)} shards"
    for i, (p, q) in enumerate(zip(ref, fast)):
        assert not isinstance(q, DTensor), f"{where}: shard {i} is a DTensor"
        a, b = (p.grad, q.grad) if what == "grad" else (p.detach(), q.detach())
        assert_close_ulps(b, a, 0, msg=lambda m, i=i: f"{where}: shard {i} {what}: {m}")


def dp_over_tp_mesh(steps: int = 4, **ddp_kwargs) -> None:
    """torch DDP and fastddp over mesh["dp"], each on a model parallelized over mesh["tp"]
    (column-parallel first layer, row-parallel second): the local-shard gradients after
    every backward and the shards after every SGD step are torch's. Also checks that the
    gradients really were averaged over dp: the two dp ranks hold the same gradient.

    The local shards are taken before the first forward: as in torch, the forward hooks
    leave the module holding DTensor attributes rather than parameters afterwards (torch's
    own workaround, torch.distributed.tensor.parallel.ddp), while the reducer and the
    optimizer keep the shards."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    base = _model()
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    ref_module = parallelize_module(copy.deepcopy(base), mesh["tp"], plan)
    fast_module = parallelize_module(copy.deepcopy(base), mesh["tp"], plan)
    ref = TorchDDP(ref_module, device_mesh=mesh["dp"], **ddp_kwargs)
    fast = fastddp.DistributedDataParallel(fast_module, device_mesh=mesh["dp"], **ddp_kwargs)
    assert fast.process_group.size() == 2
    shards = [list(m.parameters()) for m in (ref, fast)]
    opts = [torch.optim.SGD(p, lr=0.1, momentum=0.9) for p in shards]
    for step in range(steps):
        inputs, target = _batch(step, dp_rank)
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad()
            F.mse_loss(model(inputs), target).backward()
        agree(lambda s=step: _compare(*shards, "grad", f"step {s}"))
        grads = torch.cat([p.grad.flatten() for p in shards[1]])
        peers = [torch.empty_like(grads) for _ in range(2)]
        dist.all_gather(peers, grads, group=mesh["dp"].get_group())
        agree(lambda s=step: assert_close_ulps(peers[1], peers[0], 0,
                                               msg=f"step {s}: dp ranks' grads differ"))
        for opt in opts:
            opt.step()
        agree(lambda s=step: _compare(*shards, "param", f"step {s}"))
