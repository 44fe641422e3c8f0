"""Optimizers in backward (``torch.distributed.optim._apply_optimizer_in_backward``) under
fastddp: stepped on the averaged gradient, as torch DDP steps them.

Note [optimizers in backward]
``_apply_optimizer_in_backward`` gives each parameter its own optimizers
(``param._in_backward_optimizers``) and a hook on its gradient accumulator that steps them
and sets ``.grad`` to None as soon as the local gradient is there. Under data parallelism
that steps on the rank's own gradient: the replicas drift apart. torch DDP (its
``_setup_in_backward_optimizers``, at the first forward) removes those hooks and steps the
optimizers from a comm-hook wrapper after each bucket's allreduce, then sets the gradients
to None at the end of backward; without sync (``no_sync()``) nothing is reduced, nothing
steps, and the gradients accumulate for the next synchronized backward.

fastddp does the same at the first forward, with any comm hook and either value of
gradient_as_bucket_view: the first such parameter whose gradient is accumulated queues an
autograd-engine callback, which queues a second one; that runs after every callback queued
during the backward, the reducer's write-back of the averaged gradients among them. It steps
each optimizer there and sets the gradients to None. The steps come after the whole
backward instead of after each bucket (same numbers; overlapping them is the reducer's
job, not yet done).
"""

import torch
from torch.autograd import Variable


class InBackwardOptimizers:
    """The model's parameters that carry ``_in_backward_optimizers``, stepped after the
    reduction (Note [optimizers in backward])."""

    @classmethod
    def find(cls, params: list[torch.nn.Parameter]) -> "InBackwardOptimizers | None":
        """For the model's reduced parameters, at its first forward; None if none has one."""
        if not any(hasattr(p, "_in_backward_optimizers") for p in params):
            return None
        return cls(params)

    def __init__(self, params: list[torch.nn.Parameter]):
        # Imported here: torch.distributed.optim imports FSDP and DTensor (sympy), 0.9 s of
        # every `import fastddp`; a parameter only has in-backward optimizers once the user
        # imported it.
        from torch.distributed.optim import apply_optimizer_in_backward

        self.params = [p for p in params if hasattr(p, "_in_backward_optimizers")]
        handles = apply_optimizer_in_backward.param_to_optim_hook_handle_map
        for p in self.params:
            for handle in handles.get(p, []):
                handle.remove()  # never a step on the local gradient
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        self._sync = True
        self._queued = False

    def set_sync(self, sync: bool) -> None:
        """After each forward: whether its backward reduces (not under no_sync)."""
        self._sync = sync

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        # Callbacks run in the order queued; queued from here, the step runs after every
        # callback the backward queued, the reducer's write-back included.
        Variable._execution_engine.queue_callback(self._step)

    def _step(self) -> None:
        self._queued = False
        if not self._sync:
            return  # as torch: no reduction, no step; the gradients accumulate
        for p in self.params:
            if p.grad is None:
                continue  # not used in this backward
            for optimizer in p._in_backward_optimizers:
                optimizer.step()
            p.grad = None
