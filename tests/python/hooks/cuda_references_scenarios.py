"""Scenarios of test_cuda_references.py: fastddp's CUDA paths against torch's own hooks
under torch DDP, on any device (the GPU tests run them with device="cuda"; on the CPU they
run in make test too, so that the scenarios themselves are tested where no GPU is).
"""

import contextlib
import copy
import math

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.ddp.flat_buffer_scenarios import bucket_align
from tests.python.ddp.nonfinite_scenarios import _poison, train_around_a_poisoned_step
from tests.python.hooks.hooks_scenarios import EXACT, compare_grads, hooked_training, make_hook
from tests.python.scenarios import mlp, unwrap, vector_batch

# fastddp's hook and torch DDP's reference for the check_for_nan_in_grad scenarios.
NAN_HOOKS = {"allreduce": ("none", "none"),
             "bf16": ("fastddp.bf16", "torch.bf16_compress_hook"),
             "fp16": ("fastddp.fp16", "torch.fp16_compress_hook")}


def half_hooks(fast_hook: str, ref_hook: str, packed: bool, device: str = "cuda",
               **kwargs) -> str | None:
    """hooks_scenarios.hooked_training, bit for bit. packed: fastddp's buckets in torch's
    layout (FASTDDP_BUCKET_ALIGN=0): on CUDA each slot otherwise starts 16-byte aligned,
    and on 3+ ranks the backend then splits the buffer into other chunks than torch's, so
    it sums some elements in another order."""
    with bucket_align(0) if packed else contextlib.nullcontext():
        return hooked_training(fast_hook, ref_hook, exact=True, device=device,
                               bucket_cap_mb=0.001, **kwargs)


def nan_then_torch(hook: str, device: str = "cuda", dtype: str = "float32",
                   gradient_as_bucket_view: bool = False) -> str:
    """check_for_nan_in_grad=True, whose check runs in the copy-in kernels (on CUDA: a flag
    in device memory set by nonfinite.cu's kernel for allreduce, by the compression kernel
    of half_cast.cu for bf16/fp16; other dtypes take a separate read). Step 1 is clean and
    equals torch DDP (which has no such check) bit for bit; step 2 has a NaN in rank 1's
    '2.weight' gradient and must raise on every rank; steps 3-4 equal torch DDP again
    (whose replica skipped step 2). Returns the step-2 message."""
    torch.manual_seed(0)
    base = mlp().to(device, getattr(torch, dtype))
    kwargs = {"gradient_as_bucket_view": gradient_as_bucket_view}
    if device != "cpu":
        kwargs["device_ids"] = [torch.device(device).index or 0]
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), check_for_nan_in_grad=True,
                                           **kwargs)
    ref = TorchDDP(copy.deepcopy(base), **kwargs)
    for model, spec in zip((fast, ref), NAN_HOOKS[hook]):
        state, fn = make_hook(spec)
        if fn is not None:
            model.register_comm_hook(state, fn)
    return train_around_a_poisoned_step(
        ref, fast,
        lambda step: tuple(t.to(base[0].weight.dtype) for t in vector_batch(step, device=device)),
        poison=lambda: dist.get_rank() == 1 and _poison(fast.module, "2.weight", math.nan),
        after_backward=lambda s: compare_grads(unwrap(ref), unwrap(fast), f"step {s}", EXACT))
