"""DDP over a process group written in Python, as PyTorch's test/distributed/test_c10d_pypg.py
tests it (its classes TestDDPWithWorkSubclass and TestDDPWithWorkWrapper), for the torch-DDP
stage (test_torch_ddp.py runs these with fastddp substituted, or on stock torch).

torch's file is not in the torch wheel, and its code is not copied into this repository:
these are fastddp's own tests of the same cases, under torch's class and test names so that
the stage's lists (stock_excluded.txt, known_failures.txt) read alike. Each case, as torch
runs it: one rank (a thread of MultiThreadedTestCase, whose default group is torch's
threaded one) and a ``dist.ProcessGroup`` subclass that c10d never registered, whose
collectives return either

- a ``dist._Work`` subclass written in Python ("Subclass"), whose ``wait`` takes the
  ``timeout`` torch's C++ passes as a required argument and which counts the waits and
  the futures read, or
- a C++ Work made from a completed Future by ``_create_work_from_future`` ("Wrapper").

At one rank every collective is the identity (an allgather copies), so DDP's result is
the local model's, exactly.
"""

import copy
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import _create_work_from_future
# Imported after the stage's patch: in the fastddp column this is fastddp's class.
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.common_distributed import MultiThreadedTestCase


class CountedWork(dist._Work):
    """A finished collective whose ``wait`` requires its timeout (torch declares
    ``Work.wait(timeout)``; C++ callers pass c10d's kNoTimeout), counting on its group."""

    def __init__(self, tensors: list, group: "OneRankPythonGroup") -> None:
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(tensors)
        self._group = weakref.ref(group)  # the group keeps its Works: no cycle

    def wait(self, timeout: timedelta) -> bool:
        self._group().waits += 1
        return True

    def get_future(self) -> torch.futures.Future:
        self._group().futures += 1
        return self._future


class OneRankPythonGroup(dist.ProcessGroup):
    """World size 1, collectives answered from Python; never registered with c10d. Its
    ``repr`` names it in errors, as a user's group would be named."""

    def __init__(self, wrapper: bool) -> None:
        super().__init__(0, 1)
        self.wrapper = wrapper
        self.collectives = self.waits = self.futures = 0
        self.works: list = []  # the subclass's Works stay alive with the group, as torch's

    def _done(self, tensors: list) -> dist.Work:
        self.collectives += 1
        if self.wrapper:
            future = torch.futures.Future()
            future.set_result(tensors)
            return _create_work_from_future(future)
        work = CountedWork(tensors, self)
        self.works.append(work)
        return work

    # The options are required arguments here, as a group written against c10d's
    # signatures may declare them: a caller that leaves them out fails.
    def allreduce(self, tensors, opts):
        return self._done(tensors)

    def broadcast(self, tensors, opts):
        return self._done(tensors)

    def allgather(self, outputs, inputs, opts):
        for out, tensor in zip(outputs[0], inputs):
            out.copy_(tensor)
        return self._done(outputs)

    def getBackendName(self) -> str:
        return "one-rank-python"

    def __repr__(self) -> str:
        return f"OneRankPythonGroup(wrapper={self.wrapper})"


class ThreeLayers(nn.Module):
    """Three bias-free layers of different sizes, so that bucket_cap_mb=0.001 (1048 bytes)
    puts them in separate buckets: several collectives per backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 10, bias=False)
        self.b = nn.Linear(10, 50, bias=False)
        self.c = nn.Linear(50, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.c(F.relu(self.b(F.relu(self.a(x))))), dim=1)


class PythonGroupCases:
    """The cases; mixed into MultiThreadedTestCase with ``wrapper`` set."""

    wrapper = False

    def setUp(self) -> None:
        super().setUp()
        self._spawn_threads()

    @property
    def world_size(self) -> int:
        return 1

    def _group(self) -> OneRankPythonGroup:
        return OneRankPythonGroup(self.wrapper)

    def _trains_as_the_local_model(self, **ddp_kwargs) -> None:
        """Two steps of plain gradient descent: DDP over the group and the local model end
        each step with identical parameters (one rank: the collectives change nothing and
        the gradients are divided by 1)."""
        torch.manual_seed(5)
        local = ThreeLayers()
        model = DDP(copy.deepcopy(local), process_group=self._group(), bucket_cap_mb=0.001,
                    **ddp_kwargs)
        self.assertFalse(model._get_ddp_logging_data().get("is_multi_device_module"))
        inputs, target = torch.randn(3, 2), torch.randn(3, 4)
        for step in range(2):
            for m in (local, model):
                F.mse_loss(m(inputs), target).backward()
                with torch.no_grad():
                    for p in m.parameters():
                        p -= p.grad
                        p.grad = None
            for a, b in zip(local.parameters(), model.module.parameters(), strict=True):
                self.assertTrue(torch.equal(a, b), f"step {step}")
            inputs = inputs[torch.randperm(3)]

    def test_ddp_with_pypg(self) -> None:
        self._trains_as_the_local_model()

    def test_ddp_with_pypg_with_grad_views(self) -> None:
        self._trains_as_the_local_model(gradient_as_bucket_view=True)

    def test_ddp_invoke_work_object(self) -> None:
        """DDP reads the group's Works: the subclass's waits and futures are counted. Then
        a backward through the bare module (not through DDP) gives the gradient DDP gave."""
        group = self._group()
        torch.manual_seed(11)
        inner = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        x = torch.rand(2)
        model = DDP(inner, process_group=group)  # held: its reducer must outlive backward
        model(x).sum().backward()
        through_ddp = inner[0].bias.grad.clone()
        inner.zero_grad()
        inner(x).sum().backward()
        self.assertTrue(torch.equal(inner[0].bias.grad, through_ddp))  # one rank: exact
        if not self.wrapper:
            self.assertGreater(group.waits, 0)
            self.assertGreater(group.futures, 0)

    def test_ddp_no_init_sync(self) -> None:
        """init_sync=False: construction sends nothing through the group."""
        group = self._group()
        DDP(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), process_group=group, init_sync=False)
        self.assertEqual((group.collectives, group.waits, group.futures), (0, 0, 0))


class TestDDPWithWorkSubclass(PythonGroupCases, MultiThreadedTestCase):
    wrapper = False


class TestDDPWithWorkWrapper(PythonGroupCases, MultiThreadedTestCase):
    wrapper = True
