"""``DistributedDataParallel.reducer``: the part of torch's ``dist.Reducer`` that training
frameworks call directly, with torch's meaning, over fastddp's C++ reducer.

Frameworks reach past DDP's public API into its reducer when the backward they run is not
the one that follows DDP's forward (see docs/frameworks.md):

- Lightning's manual optimization runs ``manual_backward`` inside ``training_step``, that is
  inside DDP's forward. It calls ``reducer._rebuild_buckets()`` and
  ``reducer.prepare_for_backward(outputs)`` before that backward
  (``lightning/pytorch/overrides/distributed.py``), and ``reducer._delay_all_reduce()`` after
  the first backward of a static graph (``lightning/pytorch/strategies/ddp.py``).
- Accelerate's ``trigger_sync_in_backward`` calls ``reducer.prepare_for_backward([])`` to make
  a backward after a ``no_sync`` forward reduce the gradients.

Every other method of torch's Reducer raises NotImplementedError naming it; a name torch's
Reducer does not have raises AttributeError, as it would on torch's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
# The model: fastddp's DistributedDataParallel, which imports this module; the hints name
# torch's class, which it subclasses.
from torch.nn.parallel import DistributedDataParallel


_TORCH_REDUCER = getattr(getattr(torch._C, "_distributed_c10d", None), "Reducer", None)


class ReducerProxy:
    """What frameworks call on ``ddp.reducer``, answered by ``ddp._reducer`` (``_C.Reducer``).

    At world size 1 fastddp builds no C++ reducer: a world of one has nothing to reduce, and
    torch's reducer there averages every gradient over one rank, which leaves it as it is. The
    proxy's methods then check their arguments and change nothing, which is what torch's
    calls amount to at that size (``_rebuild_buckets()`` returns False: fastddp has no buckets
    to rebuild at world size 1).
    """

    def __init__(self, ddp: DistributedDataParallel):
        # A weak reference: the wrapper owns the proxy, not the other way round.
        self._ddp = weakref.ref(ddp)

    def _native(self) -> Any:
        ddp = self._ddp()
        if ddp is None:
            raise RuntimeError("fastddp: the DistributedDataParallel this reducer belonged to "
                               "no longer exists")
        return ddp._reducer

    def prepare_for_backward(self, outputs: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """torch's ``Reducer.prepare_for_backward``: the next backward is synchronized.

        Arms the gradient hooks and, with ``find_unused_parameters`` (and no static graph),
        marks the parameters the graph from ``outputs`` does not reach as unused, exactly as
        DDP's forward does for its own outputs. Called outside DDP's forward, as Lightning's
        manual optimization and Accelerate's ``trigger_sync_in_backward`` do.
        """
        tensors = _as_tensor_list(outputs)
        reducer = self._native()
        if reducer is None:
            return  # world size 1: see the class docstring
        # No output sink here (the caller built its loss already): in the first
        # static-graph iteration the C++ reducer queues its delayed reduction from the
        # first gradient hook instead.
        reducer.prepare_for_backward([t for t in tensors if t.grad_fn is not None])

    def _rebuild_buckets(self) -> bool:
        """torch's ``Reducer._rebuild_buckets``: rebuilds the buckets in the gradient-ready
        order of the first synchronized backward if that has not happened yet; returns
        whether it rebuilt now.

        fastddp rebuilds at the start of every forward with grad enabled (as torch DDP calls
        this method there), so after a forward this returns False; called after a backward
        with no forward since, it rebuilds as torch's would. Raises if the previous
        synchronized backward did not finish, with torch's message.
        """
        reducer = self._native()
        if reducer is None:
            return False
        # before_forward(sync=False) checks the prior reduction and rebuilds once, and
        # counts no iteration.
        return bool(reducer.before_forward(False))

    def _delay_all_reduce(self) -> None:
        """torch's ``Reducer._delay_all_reduce``: the first static-graph iteration's
        reduction of every bucket, now (Lightning's manual optimization calls it after the
        first backward); nothing if it already ran or is queued for the end of the
        backward."""
        reducer = self._native()
        if reducer is not None:
            reducer.delay_all_reduce()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """torch's sampling of runtime statistics for ``_get_ddp_logging_data()``: every
        iteration up to the 10th, then every ``sample_rate``-th (see _ddp_logger.py)."""
        ddp = self._ddp()
        if ddp is not None:
            ddp.logger._set_ddp_runtime_logging_sample_rate(sample_rate)
            if ddp._reducer is not None:  # its device timing follows (Note [device timeline])
                ddp._reducer.set_timing_sample_rate(sample_rate)

    def __getattr__(self, name: str) -> Callable[..., NoReturn]:
        # Only reached for names not defined above.
        if name.startswith("__") or _TORCH_REDUCER is None or not hasattr(_TORCH_REDUCER, name):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")

        def unsupported(*args: Any, **kwargs: Any) -> NoReturn:
            raise _unsupported(name)

        unsupported.__name__ = name
        return unsupported

    def __repr__(self) -> str:
        return f"<fastddp reducer proxy over {self._native()!r}>"


def _unsupported(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"fastddp: DistributedDataParallel.reducer.{name}() (a method of torch's C++ Reducer) "
        "is not supported by fastddp's reducer; fastddp answers prepare_for_backward() and "
        "_rebuild_buckets(). Run with FASTDDP_DISABLE=1 for stock torch DDP.")


def _as_tensor_list(outputs: object) -> list[torch.Tensor]:
    """torch's two overloads: one tensor or a sequence of tensors."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in outputs):
        return list(outputs)
    raise TypeError("reducer.prepare_for_backward(outputs): outputs must be a Tensor or a list "
                    f"of Tensors, got {type(outputs).__name__}")
