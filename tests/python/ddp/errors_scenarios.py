"""Misuse scenarios, run on every rank of a harness world: each must raise a clear
Python exception on every rank, at the same point, so that no rank hangs in a
collective that another rank never reaches."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.scenarios import mlp, vector_batch


class SplitAcrossDevices(nn.Module):
    def __init__(self):
        super().__init__()
        self.local = nn.Linear(4, 4)
        self.remote = nn.Parameter(torch.zeros(4, device="meta"))


def several_devices() -> None:
    fastddp.DistributedDataParallel(SplitAcrossDevices())


def shapes_differ() -> None:
    # Rank 1 builds a wider hidden layer than the other ranks.
    width = 16 if dist.get_rank() == 1 else 8
    fastddp.DistributedDataParallel(nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2)))


def second_backward() -> None:
    model = fastddp.DistributedDataParallel(mlp())
    inputs, _ = vector_batch(0)
    loss = model(inputs).sum()
    loss.backward(retain_graph=True)
    loss.backward()


def sparse_embedding_with_bf16() -> None:
    model = fastddp.DistributedDataParallel(nn.Sequential(nn.Embedding(10, 4, sparse=True),
                                                          nn.Linear(4, 2)))
    model.register_comm_hook(None, fastddp.hooks.bf16())


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.used = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.used(h), self.unused(h)


def forward_after_partial_backward(implementation: str) -> None:
    """The loss ignores one head, so its parameters never get a grad and the reduction
    never finishes; the next forward must say so (torch DDP does, with this text)."""
    wrap = TorchDDP if implementation == "torch" else fastddp.DistributedDataParallel
    torch.manual_seed(0)
    model = wrap(TwoHeads())
    inputs, _ = vector_batch(0)
    model(inputs)[0].sum().backward()
    model(inputs)


def _wrap(implementation: str):
    return TorchDDP if implementation == "torch" else fastddp.DistributedDataParallel


def static_graph_changed(implementation: str) -> None:
    torch.manual_seed(0)
    model = _wrap(implementation)(TwoHeads(), static_graph=True)
    inputs, _ = vector_batch(0)
    for step in range(3):
        outputs = model(inputs)
        loss = outputs[0].sum() + (outputs[1].sum() if step < 2 else 0)
        loss.backward()
    model(inputs)


def marked_ready_twice(implementation: str) -> None:
    from tests.python.ddp.contract_scenarios import Checkpointed

    torch.manual_seed(0)
    # A group of its own: the backward stops with collectives in flight, which must not
    # meet the next scenario's.
    group = dist.new_group(backend="gloo")
    model = _wrap(implementation)(Checkpointed(), process_group=group)
    inputs, _ = vector_batch(0)
    model(inputs).sum().backward()


def static_graph_too_late() -> None:
    model = fastddp.DistributedDataParallel(mlp())
    inputs, _ = vector_batch(0)
    model(inputs).sum().backward()
    model._set_static_graph()


def peer_fails_before_backward() -> None:
    """Rank 1 raises before its backward; rank 0's reduction must fail with an error
    naming the bucket instead of waiting forever (a group with a 3 s timeout)."""
    import datetime

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    model = fastddp.DistributedDataParallel(mlp(), process_group=group)
    inputs, _ = vector_batch(0)
    loss = model(inputs).sum()
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up on purpose")
    loss.backward()
