"""torch DDP's ``delay_all_reduce_named_params`` / ``param_to_hook_all_reduce``.

The named parameters leave the buckets (as ignored parameters do); their gradients are
views of one flat float buffer. When autograd computes ``param_to_hook_all_reduce``'s
gradient (a tensor hook: meant to be the last one backward computes), the buffer is divided
by the world size and one allreduce of it is launched, as torch does
(``_delayed_all_reduce_hook``). torch never waits for it, so whether the optimizer reads the
averaged gradients depends on the backend finishing in time; fastddp also queues an autograd
callback that waits for it before ``backward()`` returns: the same numbers, without the race.
The parameters are broadcast from rank 0 at construction, and the gradients pointed back at
the buffer after each forward (``_clear_grad_buffer``), as torch does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from fastddp import _group_ops


def check_arguments(named_params, hook_param) -> None:
    """torch's check: both arguments or neither (its message and exception type)."""
    if (named_params is not None) != (hook_param is not None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce "
                         "need to be set at the same time.")


class DelayedAllReduce:
    """The delayed parameters of one model: their buffer, views and pending allreduce."""

    def __init__(self, group: dist.ProcessGroup,
                 named_params: Sequence[tuple[str, nn.Parameter]], hook_param: nn.Parameter):
        self.params = [param for _, param in named_params]
        self.group = group
        # torch makes it on device_ids[0] or the CPU, in the default dtype; the parameters'
        # own device is where their gradients live.
        self.buffer = torch.zeros(sum(p.numel() for p in self.params),
                                  device=self.params[0].device)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        with torch.no_grad():
            _group_ops.broadcast_tensors(group, [p.detach() for p in self.params], src=0)
        self._work: dist.Work | None = None
        self._handle = hook_param.register_hook(self._launch)

    def _launch(self, grad: torch.Tensor) -> torch.Tensor:
        self.buffer.div_(self.group.size())
        self._work = _group_ops.all_reduce(self.group, self.buffer, async_op=True)
        torch.autograd.Variable._execution_engine.queue_callback(self._wait)
        return grad

    def _wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            _group_ops.wait(work)

    def point_grads_at_buffer(self) -> None:
        """torch's ``_clear_grad_buffer``: a parameter whose grad is None gets its view back
        (zeroed, unless every one was None: then the whole buffer is zeroed at once)."""
        all_none = all(p.grad is None for p in self.params)
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None:
                p.grad = view
                if not all_none:
                    p.grad.zero_()
        if all_none:
            self.buffer.zero_()
