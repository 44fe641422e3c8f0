"""Scenarios for the paths only a GPU takes (test_gpu_paths.py), on a 1-rank NCCL world
with the reducer forced (FASTDDP_WORLD1_REDUCER=1), each against torch DDP on the same
data: the design rule (backward never waits for communication), check_for_nan_in_grad's
CUDA kernel, 16-bit and float64 parameter buckets, channels_last gradients and a bucket
of more than 2^31 bytes."""

import copy
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp.ddp._options import WORLD1_REDUCER_ENV
from tests.python.ddp import nonfinite_scenarios
from tests.python.scenarios import (ConvNet, agree, compare_grads, compare_state, image_batch, mlp,
                                    train, vector_batch)

# Cycles of torch.cuda._sleep per delayed collective: about 20 ms at the 1.7-2 GHz of an
# H100/H200, a hundred times a backward of mlp() there.
SLEEP_CYCLES = 40_000_000


def _forced(build):
    """fastddp's reducer at world size 1 (read when the model is wrapped)."""
    os.environ[WORLD1_REDUCER_ENV] = "1"
    try:
        return build()
    finally:
        os.environ.pop(WORLD1_REDUCER_ENV, None)


def _pair(build, **ddp_kwargs) -> tuple[TorchDDP, fastddp.DistributedDataParallel]:
    torch.manual_seed(0)
    base = build().cuda()
    ref = TorchDDP(copy.deepcopy(base), device_ids=[0], **ddp_kwargs)
    fast = _forced(lambda: fastddp.DistributedDataParallel(copy.deepcopy(base),
                                                           device_ids=[0], **ddp_kwargs))
    assert fast._reducer is not None
    return ref, fast


def cuda_batch(step: int):
    return vector_batch(step, device="cuda")


class _MarkBackward(torch.autograd.Function):
    """Identity whose backward records a CUDA event on the compute stream: placed on the
    input, it runs after every layer's backward, so its event follows backward's kernels."""

    @staticmethod
    def forward(ctx, x, marks):
        ctx.marks = marks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        ctx.marks.append(event)
        return grad, None


def backward_does_not_wait_for_a_delayed_collective(steps: int = 3) -> list[float]:
    """Each bucket's collective is delayed on a side stream (torch.cuda._sleep, then the
    allreduce issued from there, so NCCL's stream waits for the sleep). If the reducer made
    the compute stream wait for a bucket's communication before the end of backward, the
    input's backward (the last op) would start only after the first bucket's delayed
    collective. Returns, per step, the ms from that last op's event to the first bucket's
    collective's end: positive means backward finished first. The grads must equal torch
    DDP's (world size 1: each rank's own)."""
    side = torch.cuda.Stream()
    done: list[torch.cuda.Event] = []

    def delayed(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        side.wait_stream(torch.cuda.current_stream())  # the bucket's grads are written
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            buffer = bucket.buffer()
            work = dist.all_reduce(buffer, async_op=True)
            work.wait()  # the side stream waits for NCCL's: the event below follows it
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            done.append(event)
        return work.get_future().then(lambda f: f.value()[0])

    ref, fast = _pair(mlp, bucket_cap_mb=0.0001)  # about a bucket per parameter
    fast.register_comm_hook(None, delayed)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, fast)]
    gaps = []
    for step in range(steps):
        inputs, target = cuda_batch(step)
        marks: list[torch.cuda.Event] = []
        done.clear()
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad()
            x = inputs.clone().requires_grad_(True)
            if model is fast:
                x = _MarkBackward.apply(x, marks)
            F.mse_loss(model(x), target).backward()
        torch.cuda.synchronize()
        compare_grads(ref.module, fast.module, f"step {step}")
        assert marks and done, "no mark or no delayed collective"
        gaps.append(marks[-1].elapsed_time(done[0]))
        for opt in opts:
            opt.step()
    return gaps


def nan_check_on_cuda(hook: str) -> str:
    """check_for_nan_in_grad on CUDA buckets (csrc/kernels/cuda/nonfinite.cu): a NaN in
    '2.weight' at step 2 raises naming it; steps 3-4 then match torch DDP."""
    torch.manual_seed(0)
    base = mlp().cuda()
    fast = _forced(lambda: fastddp.DistributedDataParallel(
        copy.deepcopy(base), device_ids=[0], check_for_nan_in_grad=True))
    ref = TorchDDP(copy.deepcopy(base), device_ids=[0])
    nonfinite_scenarios._register(fast, hook)
    if hook == "bf16":
        ref.register_comm_hook(None, fastddp.hooks.bf16())
    return nonfinite_scenarios.train_around_a_poisoned_step(
        ref, fast, cuda_batch,
        poison=lambda: nonfinite_scenarios._poison(fast.module, "2.weight", math.nan),
        after_backward=lambda s: compare_grads(ref.module, fast.module, f"step {s}"),
        after_step=lambda s: compare_state(ref.module, fast.module, f"after step {s}"))


class FourDtypes(nn.Module):
    """float32, float16, bfloat16 and float64 submodules in a row: a bucket per dtype."""

    def __init__(self):
        super().__init__()
        self.single = nn.Linear(8, 16)
        self.f16 = nn.Linear(16, 16).half()  # not `half`: that is nn.Module.half()
        self.b16 = nn.Linear(16, 16).bfloat16()
        self.precise = nn.Linear(16, 16).double()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.single(x))
        h = torch.tanh(self.f16(h.half())).float()
        h = torch.tanh(self.b16(h.bfloat16())).float()
        h = torch.tanh(self.precise(h.double())).float()
        return self.head(h)


def dtype_buckets(gradient_as_bucket_view: bool) -> int:
    ref, fast = _pair(FourDtypes, bucket_cap_mb=0.001,
                      gradient_as_bucket_view=gradient_as_bucket_view)
    train(ref, fast, batch=cuda_batch)
    params = dict(fast.module.named_parameters())
    dtypes = [{params[n].dtype for n in bucket} for bucket in fast.bucket_plan()]
    assert all(len(d) == 1 for d in dtypes), f"a bucket mixes dtypes: {dtypes}"
    return len({d.pop() for d in dtypes})


def channels_last_on_cuda(gradient_as_bucket_view: bool) -> None:
    ref, fast = _pair(lambda: ConvNet().to(memory_format=torch.channels_last),
                      bucket_cap_mb=0.001, gradient_as_bucket_view=gradient_as_bucket_view)
    train(ref, fast, strides=True,
          batch=lambda s: tuple(t.cuda() for t in image_batch(s)))
    weight = fast.module.conv1.weight
    assert weight.grad.is_contiguous(memory_format=torch.channels_last), weight.grad.stride()


def handed_out_gradients_on_cuda() -> dict:
    """Note [gradients handed out] on CUDA: zero_grad() each step, the reduced gradients
    are the bucket slots (no write-back), equal to torch DDP's; then last step's gradients
    kept in a list across zero_grad() keep their values (they get memory of their own)."""
    ref, fast = _pair(mlp, bucket_cap_mb=0.001)
    train(ref, fast, batch=cuda_batch)
    one_pass = dict(fast.comm_stats()["step_cost"])
    kept = [[p.grad for p in m.module.parameters()] for m in (ref, fast)]
    snapshot = [g.clone() for g in kept[0]]
    train(ref, fast, batch=lambda step: cuda_batch(step + 10), steps=1)
    for i, (theirs, ours, before) in enumerate(zip(*kept, snapshot)):
        assert torch.equal(theirs, before), f"torch DDP changed kept gradient {i}"
        assert torch.equal(ours, theirs), f"fastddp's kept gradient {i} differs from torch's"
    return {"one_pass": one_pass, "kept": dict(fast.comm_stats()["step_cost"])}


def bucket_over_2gib() -> int:
    """One float32 weight of 537M elements (2^31 + 1.1M bytes) in one bucket: offsets and
    element counts past int32 in the copy-in, the collective and the write-back. Returns
    the bucket's bytes."""
    ref, fast = _pair(lambda: nn.Linear(2 ** 15, 2 ** 14 + 8, bias=False), bucket_cap_mb=4096)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        inputs = torch.randn(2, 2 ** 15, generator=g).cuda()
        for model in (ref, fast):
            model.zero_grad(set_to_none=True)
            model(inputs).square().mean().backward()
        agree(lambda: compare_grads(ref.module, fast.module, f"step {step}"))
    assert len(fast.bucket_plan()) == 1, fast.bucket_plan()
    return sum(p.numel() * p.element_size() for p in fast.module.parameters())
