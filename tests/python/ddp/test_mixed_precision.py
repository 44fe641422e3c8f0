"""torch DDP's mixed_precision (_MixedPrecision) under fastddp (mixed_precision_scenarios.py):
on 2 and 3 gloo ranks, bit for bit against torch's computation written out with plain ops
(torch DDP's own needs an accelerator), and against torch DDP itself on a GPU."""

import pytest

from tests.python.ddp import mixed_precision_scenarios as s
from tests.python.harness import World

# (model, param_dtype, reduce_dtype, buffer_dtype): both 16-bit types for the parameters,
# reduction in fp32, in param_dtype (reduce_dtype None, torch's default) and in the other
# 16-bit type, and a model with buffers (BatchNorm, whose CPU kernel wants its statistics
# in the parameters' dtype) cast to buffer_dtype.
CONFIGS = [
    ("mlp", "bf16", "fp32", None),
    ("mlp", "fp16", "fp32", None),
    ("mlp", "bf16", None, None),
    ("mlp", "fp16", "fp16", None),
    ("mlp", "bf16", "fp16", None),
    ("batchnorm", "bf16", "fp32", "bf16"),
    ("batchnorm", "fp16", None, "fp16"),
]


@pytest.mark.parametrize(("model", "param", "reduce", "buffer"), CONFIGS)
def test_mixed_precision_trains_as_torch_computes(world, model, param, reduce, buffer):
    world.check(s.training, model=model, param=param, reduce=reduce, buffer=buffer)


@pytest.mark.parametrize("ddp_kwargs", [
    {"gradient_as_bucket_view": True},  # each .grad is fp32 of its own, as in torch
    {"static_graph": True},
    {"find_unused_parameters": True},
    {"check_for_nan_in_grad": True},
    {"lazy_bucket_allocation": True},  # the buffers allocated in reduce_dtype, at backward
], ids=lambda kw: next(iter(kw)))
def test_mixed_precision_with_other_arguments(world, ddp_kwargs):
    world.check(s.training, model="batchnorm", param="bf16", reduce="fp32", buffer="bf16",
                **ddp_kwargs)


@pytest.mark.parametrize(("param", "reduce"), [("bf16", "fp32"), ("fp16", "fp16")])
def test_no_sync_accumulates_in_param_dtype(world, param, reduce):
    world.check(s.accumulation, param=param, reduce=reduce)


def test_comm_hooks_and_unsupported_combinations_are_refused(world):
    world.check(s.refusals)


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "param", "reduce", "buffer"), [
    ("batchnorm", "bf16", "fp32", "bf16"), ("batchnorm", "fp16", None, "fp16"),
    ("mlp", "bf16", "bf16", None)])
def test_cuda_mixed_precision_matches_torch_ddp(model, param, reduce, buffer):
    # gloo reduces CUDA tensors through host memory: two ranks on one GPU.
    world = World(2, backend="gloo")
    try:
        world.check(s.cuda_torch_parity, model=model, param=param, reduce=reduce,
                    buffer=buffer)
    finally:
        world.close()
