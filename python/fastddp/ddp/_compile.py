"""torch.compile support for fastddp.DistributedDataParallel.

Dynamo treats a model as DDP when the code it compiles runs while
``torch.nn.parallel.DistributedDataParallel._active_ddp_module`` is set (torch's forward
sets it around the module call, in ``_inside_ddp_forward``): dynamo's DDPOptimizer then
splits the compiled graph at the active module's ``bucket_bytes_cap``, so that each
bucket's gradients are ready (and reduced) while the rest of backward runs. fastddp's
forward sets it the same way around its module call (distributed.py), so the split is torch's.
The rest of that forward, which calls the C++ reducer, never reaches dynamo: the forward
itself is skipped (nonrecursive_disable: the module it calls is still compiled) and its
reducer parts run under `eager`. Dynamo cannot trace the reducer, and would otherwise
break the graph at each call.

Compiled autograd cannot trace fastddp's reducer: its gradient hooks are C++ post hooks on
the grad accumulators without ``compiled_args`` (torch's C++ reducer has the same limit).
As torch DDP, a model built under ``optimize_ddp="python_reducer"`` uses Python hooks with
functional collectives instead, which compiled autograd traces (_python_reducer.py, Note
[python reducer]). Built in any other mode, fastddp raises NotImplementedError naming the
setting at the first backward of a compiled training step with
``torch._dynamo.config.compiled_autograd = True`` (guard_outputs); compiled autograd entered
only around ``loss.backward()`` is invisible at forward time: the reducer's hooks then raise
NotImplementedError naming compiled autograd at that backward (their compiled_args,
csrc/reducer/reducer.cpp). Either way the collective is never skipped silently.
"""

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback
from torch.utils._pytree import tree_flatten, tree_unflatten

_ADVICE = ("fastddp's reducer hooks are C++ autograd hooks that compiled autograd cannot "
           "trace; as with torch's DistributedDataParallel, build the model under "
           "torch._dynamo.config.optimize_ddp=\"python_reducer\" for compiled autograd, or use "
           "torch.compile on the model with the default eager backward")


def nonrecursive_disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` runs eagerly under torch.compile while the functions it calls are still compiled
    (torch.compiler.disable(recursive=False)). torch._dynamo is imported at the first call,
    not when fastddp is (it takes seconds)."""
    return torch._disable_dynamo(fn, recursive=False)


def skip_this_frame_from_now_on() -> None:
    """Called first in a nonrecursive_disable function: under torch.compile, marks its code
    for dynamo's C frame evaluator to skip (nested frames still compile). torch's
    non-recursive disable alone decides again in Python at every call, which cost about
    200 us per step; torch._dynamo.reset() clears the mark, hence at every call (0.6 us,
    under compile only). Eagerly it costs one C call."""
    if _eval_frame_callback() is None:  # not under torch.compile: dynamo sees no frame
        return
    skip_code = getattr(sys.modules.get("torch._dynamo.eval_frame"), "skip_code", None)
    if skip_code is not None:
        skip_code(sys._getframe(1).f_code)


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` and everything it calls run eagerly, never traced (torch.compiler.disable): the
    reducer calls, which dynamo cannot trace, and fastddp's bookkeeping around them."""
    return torch._disable_dynamo(fn)


def _compiled_autograd_on() -> bool:
    # torch._dynamo.config.compiled_autograd=True turns it on only while a compiled function
    # runs; compiled_autograd._enable() while its block runs. Both set this flag.
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and module.compiled_autograd_enabled


_BACKWARD_MESSAGE = (
    "fastddp.DistributedDataParallel: backward under compiled autograd "
    "(torch._dynamo.config.compiled_autograd=True around a compiled training step, or "
    f"torch._dynamo.compiled_autograd._enable) is not supported: {_ADVICE}.")


class _CompiledAutogradGuard(torch.autograd.Function):
    """Identity on the DDP outputs. Compiled autograd asks every node of the backward graph
    for its key before it runs any; this node answers with fastddp's error naming the
    setting, before compiled autograd reaches the reducer's hooks on the parameters (they
    sit behind the outputs, and can only say that compiled autograd is on). Eager backward
    passes through it."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads

    @staticmethod
    def _compiled_autograd_key(ctx: Any) -> tuple:
        raise NotImplementedError(_BACKWARD_MESSAGE)


def guard_outputs(output: Any) -> Any:
    """`output`, its tensors passed through _CompiledAutogradGuard when compiled autograd is
    on now (a compiled training step with torch._dynamo.config.compiled_autograd=True): a
    backward under it raises NotImplementedError at once. Otherwise `output` itself, at the
    cost of one flag read."""
    if not _compiled_autograd_on():
        return output
    leaves, spec = tree_flatten(output)
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.grad_fn]
    if not slots:
        return output
    guarded = _CompiledAutogradGuard.apply(*(leaves[i] for i in slots))
    for i, tensor in zip(slots, guarded):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)
