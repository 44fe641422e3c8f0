"""PyTorch's own DDP tests, shipped in the torch wheel, run against fastddp.

Modelled on pytorch's test/distributed/test_distributed_spawn.py (the DDP tests of
``distributed_test._DistTestBase``, gloo, 2 ranks) and test/distributed/rpc/
test_tensorpipe_agent.py (the DDP-under-RPC suites of ``ddp_under_dist_autograd_test``).
Also the cases of pytorch's test/distributed/test_c10d_pypg.py (DDP over a process group
written in Python), which the wheel does not ship: python_group_tests.py has them, under
torch's names, as fastddp's own code.

Column: fastddp by default; ``FASTDDP_DISABLE=1`` runs the same tests on stock torch DDP.
fastddp must replace torch's class before torch's test modules are imported (they do
``from torch.nn.parallel import DistributedDataParallel``). Every rank is forked from a fork
server that imported this module, or a spawned process that re-imports it (in the
Python-group cases, as in torch's, a thread of this process), so patching here at the top
covers the test process and all ranks. Each rank
also checks, before the test body runs, that the names it will use are the column's class,
and in the fastddp column constructing torch's own class raises: a run that silently tested
torch's DDP cannot pass.

Selection, xfail marks for known failures and deselection of stock failures: conftest.py.
Both columns side by side: compare_columns.py (make test-torch-ddp-suite).

Environment: FASTDDP_DISABLE=1 (stock column), FASTDDP_TORCH_DDP_TIMEOUT (seconds before a
hung test is killed, 120), FASTDDP_TORCH_DDP_START (forkserver; or spawn, as pytorch),
FASTDDP_TORCH_DDP_ALL=1 (also the tests stock torch skips here), FASTDDP_TORCH_DDP_RAW=1 (no
xfail marks), FASTDDP_TORCH_DDP_RECORD (a file that gets one JSON line per test: DDP
constructor calls).
"""
# Imports below the environment set-up and the patch: torch's test modules read both.
# ruff: noqa: E402

import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# Read by torch's test modules at import time; TestDistBackend.setUp points TEMP_DIR at a
# fresh directory per test, which the spawned ranks inherit.
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())
# A hung test is killed after this many seconds (torch's default is 300).
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT",
                      os.environ.get("FASTDDP_TORCH_DDP_TIMEOUT", "120"))

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from selection import column

COLUMN = column()
if COLUMN == "fastddp":
    import fastddp
    from fastddp.ddp import DistributedDataParallel as FastDDP
else:  # the reference column needs no fastddp build
    fastddp = FastDDP = None
# torch's class, before patching. In a tuple: fastddp.patch() rebinds module globals that hold
# torch's class (Patch.rebound), and this must stay torch's.
TORCH_DDP_CLASS = (torch.nn.parallel.distributed.DistributedDataParallel,)
_ddp_calls = 0  # DDP constructor calls in this process, failed ones included


def _counted(init: Any, guard: bool) -> Any:
    """``init`` (a DDP constructor) counting its calls; with ``guard`` it admits only
    fastddp instances (fastddp's constructor does not call torch's, so this raises for
    torch's class only)."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        global _ddp_calls
        if guard and not isinstance(self, FastDDP):
            raise RuntimeError(
                f"[torch_ddp suite] stock torch DistributedDataParallel ({type(self).__module__}"
                f".{type(self).__qualname__}) constructed in the fastddp column: this code path "
                "holds torch's class from before fastddp.patch()")
        _ddp_calls += 1
        init(self, *args, **kwargs)

    return wrapper


if COLUMN == "fastddp":
    TORCH_DDP_CLASS[0].__init__ = _counted(TORCH_DDP_CLASS[0].__init__, guard=True)
    FastDDP.__init__ = _counted(FastDDP.__init__, guard=False)
    fastddp.patch(disable=False)
else:
    TORCH_DDP_CLASS[0].__init__ = _counted(TORCH_DDP_CLASS[0].__init__, guard=False)

torch.backends.cuda.matmul.allow_tf32 = False

from torch.testing._internal import common_distributed
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.distributed import distributed_test
from torch.testing._internal.distributed import ddp_under_dist_autograd_test as rpc_ddp
from torch.testing._internal.distributed.distributed_test import (
    DistributedTest,
    TestDistBackend,
)
from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
    TensorPipeRpcAgentTestFixture,
)

import python_group_tests as pypg  # imports torch's DDP name after the patch, as torch's do

# torch raises the limit for two slow tests to 400 and 500 s; one limit for all here.
for _name in common_distributed.TIMEOUT_OVERRIDE:
    common_distributed.TIMEOUT_OVERRIDE[_name] = common_distributed.TIMEOUT_DEFAULT


def ddp_names_in_use() -> dict[str, type]:
    """Every name under which torch's tests reach the DDP class."""
    return {
        "torch.nn.parallel.DistributedDataParallel": torch.nn.parallel.DistributedDataParallel,
        "torch.nn.parallel.distributed.DistributedDataParallel":
            torch.nn.parallel.distributed.DistributedDataParallel,
        "distributed_test.DistributedDataParallel": distributed_test.DistributedDataParallel,
        "ddp_under_dist_autograd_test.DistributedDataParallel":
            rpc_ddp.DistributedDataParallel,
        "python_group_tests.DDP": pypg.DDP,
    }


def check_ddp_names() -> None:
    """Raises unless every DDP name is this column's class."""
    for where, cls in ddp_names_in_use().items():
        ok = issubclass(cls, FastDDP) if COLUMN == "fastddp" else cls is TORCH_DDP_CLASS[0]
        if not ok:
            raise AssertionError(f"[torch_ddp suite] {where} is {cls.__module__}."
                                 f"{cls.__qualname__}, not the {COLUMN} column's class")


check_ddp_names()


# How ranks start: "forkserver" (ranks fork from a server that imported this module once) or
# "spawn" (pytorch's runners: every rank imports torch and this module, ~5 s of CPU each).
# The ranks run the same code either way (the patch is made at import, and each rank checks
# its DDP class); forked, the 26 tests took 100 s instead of 131 quiet and 178 s instead of
# 227 with both cores busy (benchmarks/results/suite.md).
START_METHOD = os.environ.get("FASTDDP_TORCH_DDP_START", "forkserver")
if START_METHOD not in ("spawn", "forkserver"):
    raise ValueError(f"FASTDDP_TORCH_DDP_START={START_METHOD!r}: use spawn or forkserver")


def _run_with_env(env: dict[str, str], run: Any, *args: Any, **kwargs: Any) -> None:
    """A rank forked from the fork server: the server's environment is that of its start, so
    take the test process's environment of now (setUp sets TEMP_DIR, INIT_METHOD per test)."""
    os.environ.clear()
    os.environ.update(env)
    run(*args, **kwargs)


def _record(test: Any, ddp_calls: int, ranks_reported: int) -> None:
    """One JSON line for ``test`` in FASTDDP_TORCH_DDP_RECORD's file, when it is set."""
    record = os.environ.get("FASTDDP_TORCH_DDP_RECORD")
    if record:
        name = f"{type(test).__name__}::{test._testMethodName}"
        with open(record, "a") as f:
            f.write(json.dumps({"test": name, "column": COLUMN, "ddp_calls": ddp_calls,
                                "ranks_reported": ranks_reported}) + "\n")


class ColumnChecked:
    """Mixed in before torch's test classes: spawns the ranks (as pytorch's spawn runners
    do), checks the DDP class in every rank and records how many DDP constructor calls each
    made."""

    def setUp(self) -> None:
        super().setUp()  # type: ignore[misc]
        self._counts_dir = tempfile.mkdtemp(prefix="torch_ddp_counts_")
        os.environ["FASTDDP_TORCH_DDP_COUNTS"] = self._counts_dir  # inherited by the ranks
        if START_METHOD == "spawn":
            self._spawn_processes()  # type: ignore[attr-defined]
            return
        context = torch.multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])

        def process(target: Any, name: str, args: tuple, kwargs: dict) -> Any:
            return context.Process(target=_run_with_env, name=name,
                                   args=(dict(os.environ), target, *args), kwargs=kwargs)

        self._start_processes(process)  # type: ignore[attr-defined]

    def tearDown(self) -> None:
        super().tearDown()  # type: ignore[misc]
        counts = [int(p.read_text()) for p in Path(self._counts_dir).iterdir()]
        shutil.rmtree(self._counts_dir, ignore_errors=True)
        _record(self, sum(counts), len(counts))

    def run_test(self, test_name: str, parent_pipe: Any) -> None:
        """In a rank: the test body runs after the class check; failures of either go
        back to the test process with their traceback."""
        body = getattr(self, test_name)

        def checked() -> Any:
            try:
                check_ddp_names()
                return body()
            finally:
                counts_dir = Path(os.environ["FASTDDP_TORCH_DDP_COUNTS"])
                (counts_dir / str(self.rank)).write_text(str(_ddp_calls))  # type: ignore

        setattr(self, test_name, checked)
        super().run_test(test_name, parent_pipe)  # type: ignore[misc]


class TestDistBackendWithSpawn(ColumnChecked, TestDistBackend, DistributedTest._DistTestBase):
    """distributed_test's suite, as test_distributed_spawn.py builds it (gloo, 2 ranks)."""


# The DDP-under-RPC suites, as rpc_utils.generate_tests mixes them for the TensorPipe agent.
class TensorPipeDdpUnderDistAutogradTest(ColumnChecked, rpc_ddp.DdpUnderDistAutogradTest,
                                         TensorPipeRpcAgentTestFixture, MultiProcessTestCase):
    pass


class TensorPipeDdpComparisonTest(ColumnChecked, rpc_ddp.DdpComparisonTest,
                                  TensorPipeRpcAgentTestFixture, MultiProcessTestCase):
    pass


class TensorPipeCudaDdpComparisonTest(ColumnChecked, rpc_ddp.CudaDdpComparisonTest,
                                      TensorPipeRpcAgentTestFixture, MultiProcessTestCase):
    pass


class ThreadColumnChecked:
    """ColumnChecked for torch's thread-per-rank tests (MultiThreadedTestCase): every rank is
    a thread of this process, which the patch at the top already covers; each checks the DDP
    class before the test body runs, and the process's constructor count gives the record."""

    def setUp(self) -> None:
        self._calls_before = _ddp_calls
        super().setUp()  # type: ignore[misc]  (spawns the rank threads)

    def tearDown(self) -> None:
        super().tearDown()  # type: ignore[misc]
        _record(self, _ddp_calls - self._calls_before, self.world_size)  # type: ignore

    def run_test_with_threaded_pg(self, test_name: str, rank: int, world_size: int) -> None:
        body = getattr(self, test_name)

        def checked() -> Any:
            check_ddp_names()
            return body()

        setattr(self, test_name, checked)
        super().run_test_with_threaded_pg(test_name, rank, world_size)  # type: ignore[misc]


# test_c10d_pypg.py's DDP classes (python_group_tests.py): one rank, a Python ProcessGroup.
class TestDDPWithWorkSubclass(ThreadColumnChecked, pypg.TestDDPWithWorkSubclass):
    pass


class TestDDPWithWorkWrapper(ThreadColumnChecked, pypg.TestDDPWithWorkWrapper):
    pass
