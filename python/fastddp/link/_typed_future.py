"""Typed futures from Python, for process groups written in Python.

Note [typed futures]: fastddp's C++ hooks read a collective's result as a Tensor or a list
of Tensors (csrc/reducer/comm_hook.cpp: hook_result_tensor), but a Future made in Python
holds a PyObject. So the Work's future is made by TorchScript: a scripted function forks a
task that waits on a Python "done" future and returns the output tensors, which gives a
``Future[List[Tensor]]`` that completes when "done" does, without holding a thread or the GIL.
Callbacks on it run on TorchScript's inter-op threads (on a real group: its worker threads).
Were hook_result_tensor to accept PyObject results, as torch's parseCppCommHookResult does,
a plain Python Future would do.
"""

import atexit
import threading
import time
import warnings
from collections import deque
from typing import Any

import torch


def _complete_after(done: torch.jit.Future[int], failed: torch.Tensor,
                    outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    torch.jit.wait(done)
    if bool(failed):
        raise RuntimeError("fastddp.EmulatedLinkGroup: the collective failed on the wrapped "
                           "process group (this rank printed its error)")
    return outputs


def _typed_future_when(done: torch.jit.Future[int], failed: torch.Tensor,
                       outputs: list[torch.Tensor]) -> torch.jit.Future[list[torch.Tensor]]:
    return torch.jit.fork(_complete_after, done, failed, outputs)


_scripted: Any = None
_script_lock = threading.Lock()
# Note [exit with forked tasks]: a forked task (Note [typed futures]) holds its "done"
# future, whose value is a Python object, until it returns, which is just after it completes
# the typed future. Were the task's reference the last one and the interpreter already
# finalizing, freeing that value would take the GIL of a dead interpreter: std::terminate
# (seen in 5 of 30 runs of a script that exits right after a wait()). So Python keeps the
# recent "done" futures (not the typed ones, which hold the output tensors), and at exit
# waits for them to complete and for their tasks to return before it lets them go.
_recent: deque = deque(maxlen=4096)
_EXIT_WAIT_S = 10.0
_TASK_UNWIND_S = 0.05


def remember_done(done: torch.futures.Future) -> None:
    """Keeps ``done`` until exit (Note [exit with forked tasks])."""
    _recent.append(done)


@atexit.register
def _wait_for_forked_tasks() -> None:
    deadline = time.monotonic() + _EXIT_WAIT_S
    pending = list(_recent)
    for done in pending:
        while not done.done() and time.monotonic() < deadline:
            time.sleep(0.001)
    if pending:
        time.sleep(_TASK_UNWIND_S)  # the tasks return right after completing their futures


def typed_future_maker() -> Any:
    """Note [typed futures]: the scripted ``_typed_future_when`` (made once per process)."""
    global _scripted
    with _script_lock:
        if _scripted is None:
            with warnings.catch_warnings():
                # torch.jit.script warns that it is deprecated; it is the only way to make
                # a typed Future from Python (Note [typed futures]).
                warnings.simplefilter("ignore", FutureWarning)
                scripted = torch.jit.script(_typed_future_when)
                # TorchScript's executor profiles and optimizes the first calls (~60 ms),
                # and again for an empty list; done here so that no collective pays for it.
                for outputs in 3 * [[torch.zeros(1)], [], [torch.zeros(1), torch.zeros(2)]]:
                    done = torch.futures.Future()
                    typed = scripted(done, torch.zeros((), dtype=torch.bool), outputs)
                    _recent.append(done)  # Note [exit with forked tasks]
                    done.set_result(0)
                    typed.wait()
                _scripted = scripted
    return _scripted
