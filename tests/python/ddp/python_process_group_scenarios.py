"""A process group written in Python (a ``dist.ProcessGroup`` subclass whose collectives
return Python ``Work`` objects, as fault-tolerance and tracing libraries write them),
under torch DDP and under fastddp. Modelled on torch's own test_c10d_pypg.py
(LonelyRankProcessGroup, MyWork): torch DDP waits on those Works and reads their futures,
and so must fastddp. Run on every rank of a harness world (see harness.py)."""

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp


class CountingWork(dist._Work):
    """A Work whose future is a Python ``torch.futures.Future`` completed from Python with
    the tensors (torch's MyWork), after the wrapped c10d Work (if any) finished."""

    def __init__(self, tensors: list[torch.Tensor], group: "WrappedGroup",
                 inner: dist._Work | None = None) -> None:
        super().__init__()
        self.inner, self.tensors = inner, tensors
        self.group = weakref.ref(group)

    def wait(self, timeout=None) -> bool:
        self.group().waits += 1
        if self.inner is not None:
            self.inner.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        self.group().futures += 1
        if self.inner is not None:
            self.inner.wait()
        future = torch.futures.Future()
        future.set_result(self.tensors)
        return future


class WrappedGroup(dist.ProcessGroup):
    """The world's gloo group behind a Python ProcessGroup, counting the Works' waits and
    futures read. At world size 1 (torch's LonelyRankProcessGroup) the collectives are the
    identity."""

    def __init__(self) -> None:
        super().__init__(dist.get_rank(), dist.get_world_size())
        self.inner = dist.group.WORLD
        self.waits = self.futures = 0

    def _run(self, tensors: list, launch) -> CountingWork:
        return CountingWork(tensors, self, launch() if self.size() > 1 else None)

    def allreduce(self, tensor_list, opts=None):
        return self._run(tensor_list, lambda: self.inner.allreduce(tensor_list))

    def broadcast(self, tensor_list, opts):
        return self._run(tensor_list, lambda: self.inner.broadcast(tensor_list, opts))

    def allgather(self, output_tensors, input_tensor, opts=None):
        if self.size() == 1:
            for outs, x in zip(output_tensors, input_tensor):
                outs[0].copy_(x)
        return self._run(output_tensors[0],
                         lambda: self.inner.allgather(output_tensors, input_tensor))

    def getBackendName(self) -> str:
        return "python-wrapped"


def _model() -> nn.Module:
    torch.manual_seed(123)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def trains_through_python_works(steps: int = 3) -> dict:
    """torch DDP and fastddp, each over its own WrappedGroup: the grads of every step and
    how many of the group's Work waits and futures each read."""
    counts, grads = {}, {}
    for name, wrap in (("torch", TorchDDP), ("fastddp", fastddp.DistributedDataParallel)):
        group = WrappedGroup()
        model = wrap(_model(), process_group=group, bucket_cap_mb=0.0001)
        gen = torch.Generator().manual_seed(10 + dist.get_rank())
        grads[name] = []
        for _ in range(steps):
            model.zero_grad()
            model(torch.randn(5, 8, generator=gen)).square().sum().backward()
            grads[name].append([p.grad.clone() for p in model.parameters()])
        counts[name] = {"waits": group.waits, "futures": group.futures}
    # The same gloo sums in the same order, divided by the world size alike: bitwise.
    identical = all(torch.equal(a, b) for ref, got in zip(grads["torch"], grads["fastddp"])
                    for a, b in zip(ref, got))
    return {"identical": identical, **counts}
