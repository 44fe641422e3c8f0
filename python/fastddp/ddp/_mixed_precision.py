"""DDP's mixed_precision (torch's private ``_MixedPrecision(param_dtype, reduce_dtype,
buffer_dtype)``): the Python half, what runs around the forward. The gradient path is the
reducer's (Note [mixed precision] in csrc/reducer/reducer.h).

torch DDP 2.14's semantics (torch/nn/parallel/distributed.py), which fastddp follows:

- construction (``_setup_mixed_precision_params``, ``_cast_buffers``): every parameter
  gets ``_fp_param`` (its full-precision data) and ``_mp_param`` (a param_dtype tensor of
  its shape whose memory is allocated only from a forward to the end of its synchronized
  backward); every buffer becomes buffer_dtype, integer ones such as BatchNorm's
  ``num_batches_tracked`` included, after the initial broadcast of the fp32 values.
- each forward of the module (``_root_copy_hook``, a forward pre-hook on the module, so
  also for ``ddp.module(x)`` and under ``no_grad``): the parameters are copied into
  ``_mp_param``, a ``.grad`` they have is cast to param_dtype, and ``param.data`` becomes
  ``_mp_param``; DDP's own forward casts floating-point inputs to param_dtype
  (``_cast_forward_inputs``).
- a synchronized backward (``_reducer_allreduce_and_upcast_hook``): the param_dtype
  gradients are summed in reduce_dtype (param_dtype when not given), divided by the group
  size in reduce_dtype, and cast up into a ``.grad`` of the parameter's dtype; the
  parameters get ``_fp_param`` back. The optimizer then steps the fp32 parameters, and
  ``state_dict()`` holds fp32 parameters and buffer_dtype buffers. Under ``no_sync()`` or
  after a forward without backward the parameters (and grads) stay in param_dtype until
  the next synchronized backward.
- comm hooks: torch registers that hook itself, so registering another one (or
  optimizers in backward, which need one) fails.

fastddp departs from it only where torch's own path breaks: parameters named in
``_ddp_params_and_buffers_to_ignore`` are never cast (torch skips only those marked by
``_set_params_and_buffers_to_ignore_for_model``), a parameter whose ``.data`` was replaced
in full precision between steps keeps the new tensor (torch puts its old ``_fp_param``
back), ``param_dtype=None`` leaves the parameters alone (torch's cast to the same dtype
hooks the reducer twice), and with ``gradient_as_bucket_view=True`` each ``.grad`` is a
full-precision tensor of its own, as torch's upcast makes it, but holding this step's
averaged gradient. torch's first backward averages stale bucket contents (its
``_set_mixed_precision_param_dtype`` leaves the parameters' bucket views on the old buffers
until the rebuild); fastddp's averages that backward's gradients (docs/arguments.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.utils import _alloc_storage, _cast_forward_inputs, _free_storage
# The model: fastddp's DistributedDataParallel, which imports this module; the hints name
# torch's class, which it subclasses.
from torch.nn.parallel import DistributedDataParallel

from fastddp import _C

_FIELDS = ("param_dtype", "reduce_dtype", "buffer_dtype")


def _not_supported(what: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"fastddp.DistributedDataParallel: mixed_precision with {what} "
                               f"is not supported ({why})")


def check_arguments(config: Any, *, delayed: bool, sparse: bool) -> None:
    """Raises, before anything is built, for a config it cannot read or a combination that
    fastddp does not run."""
    if config is None:
        return
    for field in _FIELDS:
        dtype = getattr(config, field, None)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"mixed_precision.{field} must be a floating-point torch.dtype or "
                            f"None, got {dtype!r}")
    if delayed:  # torch casts them but never puts them back after their own allreduce
        raise _not_supported("delay_all_reduce_named_params",
                             "the delayed parameters' allreduce runs outside the reducer")
    if sparse:
        raise _not_supported("sparse gradients (nn.Embedding(sparse=True))",
                             "the reduce_dtype buckets are dense")


def reducer_arguments(ddp: DistributedDataParallel) -> dict:
    """What _C.Reducer takes for the model's mixed_precision (nothing without one)."""
    config = getattr(ddp, "mixed_precision", None)
    if config is None:
        return {}
    return {
        "mixed_precision": True,
        "param_dtype": config.param_dtype,
        # torch: the bucket is cast only when reduce_dtype differs from param_dtype.
        "reduce_dtype": config.reduce_dtype if config.reduce_dtype is not None
        else config.param_dtype,
        "hook": _C.UpcastAllreduceHook(ddp.process_group),
        # The bucket holds reduce_dtype, the .grad the parameter's dtype: no view can be both
        # (torch's upcast replaces the view with an fp32 copy too).
        "gradient_as_bucket_view": False,
    }


def refuse_comm_hook(ddp: DistributedDataParallel, what: str) -> None:
    """torch registers its upcast hook when given a mixed_precision, and its reducer takes
    one hook only: another one fails there, so it does in fastddp."""
    if getattr(ddp, "mixed_precision", None) is None:
        return
    message = (f"fastddp.DistributedDataParallel: {what} cannot be combined with "
               "mixed_precision: as in torch DDP, whose reducer already holds the "
               "mixed-precision hook (_reducer_allreduce_and_upcast_hook) and raises "
               "'register_comm_hook or register_builtin_comm_hook can only be called once.'")
    ddp.logger.set_error_and_log(message)
    raise NotImplementedError(message)


class MixedPrecision:
    """A model's mixed_precision: its buffers cast at construction, its parameters cast at
    each forward of its module, its inputs at each forward of the model."""

    def __init__(self, ddp: DistributedDataParallel, config: Any):
        self.ddp = ddp
        self.param_dtype = config.param_dtype
        self.buffer_dtype = config.buffer_dtype
        # The parameters torch casts: all but the ignored ones, requires_grad=False ones
        # included (they are put back at the end of the synchronized backward too).
        self.params = list(ddp._module_parameters)
        if self.param_dtype is not None:
            for p in self.params:
                p._mp_param = torch.zeros_like(p, dtype=self.param_dtype)
                _free_storage(p._mp_param)
                p._fp_param = p.data
        if self.buffer_dtype is not None:
            for buf in ddp.modules_buffers:
                buf.data = buf.to(dtype=self.buffer_dtype)
        # After the module's own pre-hooks registered so far, as torch's prepend=False.
        self.handle = ddp.module.register_forward_pre_hook(self._cast_params, with_kwargs=True)

    def cast_inputs(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Floating-point inputs to param_dtype, as torch's _pre_forward casts them."""
        return _cast_forward_inputs(self.param_dtype, *inputs, **kwargs)

    def _cast_params(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """torch's _root_copy_hook: the parameters (and their grads) in param_dtype."""
        if self.ddp._in_backward is not None:  # found at the model's first forward
            refuse_comm_hook(self.ddp, "optimizers in backward (_apply_optimizer_in_backward)")
        if self.param_dtype is None:
            return
        with torch.no_grad():
            for p in self.params:
                if p.dtype != self.param_dtype:  # full precision: its current data
                    p._fp_param = p.data
                _alloc_storage(p._mp_param, p.size())
            # One multi-tensor copy, which casts (a parameter still in param_dtype from a
            # forward without synchronized backward is its own _mp_param: a no-op).
            torch._foreach_copy_([p._mp_param for p in self.params],
                                 [p.data for p in self.params])
            for p in self.params:
                if p.grad is not None:
                    p.grad.data = p.grad.to(self.param_dtype)
                p.data = p._mp_param
        reducer = self.ddp._reducer
        if reducer is not None:
            reducer.after_param_cast(self.params, [p._fp_param for p in self.params])
