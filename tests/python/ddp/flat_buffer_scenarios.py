"""The aligned flat buffer (Note [aligned flat buffer] in csrc/reducer/bucket.h) on CPU.

FASTDDP_BUCKET_ALIGN forces on the CPU the padded layout that CUDA gets by default, so that
every bucket, hook and write-back path runs over padded slots here. Parameters have odd
element counts, so that nearly every slot is padded. Each scenario compares with torch DDP
(its own hooks where it has them) on the same data; the hooks torch lacks are compared with
fastddp's packed layout (FASTDDP_BUCKET_ALIGN=0, torch's), itself tested against torch
elsewhere.
"""

import contextlib
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp.ddp._options import BUCKET_ALIGN_ENV
from tests.python.hooks.hooks_scenarios import EXACT, compare_grads
from tests.python.hooks.quant8_hooks_scenarios import quantization_bound
from tests.python.hooks.world1_hooks_scenarios import CASES, PSGD_START, _hook
from tests.python.scenarios import compare_grads as compare_grads_ulps
from tests.python.scenarios import unwrap


class OddMLP(nn.Module):
    """Element counts 35, 5, 15, 3, 27, 9, 18, 2: none a multiple of 4, plus (with
    `double`) a float64 layer, so the buckets span two (dtype) buffers."""

    def __init__(self, double: bool = True):
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 3)
        self.c = nn.Linear(3, 9)
        self.d = nn.Linear(9, 2).to(torch.float64 if double else torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c(torch.relu(self.b(torch.tanh(self.a(x))))))
        return self.d(h.to(self.d.weight.dtype)).double()


@contextlib.contextmanager
def bucket_align(value: int):
    previous = os.environ.get(BUCKET_ALIGN_ENV)
    os.environ[BUCKET_ALIGN_ENV] = str(value)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(BUCKET_ALIGN_ENV, None)
        else:
            os.environ[BUCKET_ALIGN_ENV] = previous


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(6, 7, generator=g), torch.randn(6, 2, generator=g, dtype=torch.float64)


def _grad_ptrs(model: nn.Module) -> list[int]:
    return [p.grad.data_ptr() for p in unwrap(model).parameters()]


def layout(align: int, steps: int = 3) -> dict:
    """Plain allreduce with gradient_as_bucket_view: every .grad starts `align`-aligned,
    the grads of one dtype share one storage, and equal torch DDP's (bit for bit on 2
    ranks; to the last bits on more), also after the rebuild of the first step."""
    torch.manual_seed(0)
    base = OddMLP()
    kwargs = {"bucket_cap_mb": 0.0001, "gradient_as_bucket_view": True}
    ref = TorchDDP(copy.deepcopy(base), **kwargs)
    with bucket_align(align):
        fast = fastddp.DistributedDataParallel(copy.deepcopy(base), **kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fast)]
    for step in range(steps):
        inputs, target = _batch(step)
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad(set_to_none=step % 2 == 0)
            F.mse_loss(model(inputs), target).backward()
        # Sums of 3+ ranks depend on the order gloo adds them in, which follows how it
        # chunks the buffer: the padded buffer's chunks are not torch's (scenarios.ULPS;
        # measured 0.8 ulps). 2 ranks: bit for bit.
        compare_grads_ulps(unwrap(ref), unwrap(fast), f"align {align}, step {step}")
        misaligned = [(n, p.grad.data_ptr() % align) for n, p in unwrap(fast).named_parameters()
                      if p.grad.data_ptr() % align]
        assert not misaligned, f"grads not {align}-byte aligned: {misaligned}"
        for opt in opts:
            opt.step()
    storages = {}
    for p in unwrap(fast).parameters():
        storages.setdefault(p.dtype, set()).add(p.grad.untyped_storage().data_ptr())
    bucket_bytes = fast._reducer.bucket_bytes()
    payload = sum(p.numel() * p.element_size() for p in fast.parameters())
    return {"buckets": len(bucket_bytes),
            "storages": {str(k): len(v) for k, v in storages.items()},
            "padded_bytes": sum(bucket_bytes) - payload}


# The 8-bit hooks quantize blocks of 256 elements, which padding regroups: their padded
# and packed results are two quantizations of one mean, each within what the format's two
# quantizations can cost (quant8_hooks_scenarios.quantization_bound; the first step, before
# error feedback).
QUANT8 = ("int8", "fp8(e4m3)", "fp8(e5m2)")


def _local_grads(step: int = 0) -> torch.Tensor:
    """This rank's own gradients of the float32 OddMLP on its batch, flat (no DDP)."""
    torch.manual_seed(0)
    model = OddMLP(double=False)
    inputs, target = _batch(step)
    F.mse_loss(model(inputs), target).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _train(spec: str, align: int | None, steps: int, double: bool = True,
           **ddp_kwargs) -> tuple[nn.Module, list]:
    """Grads after each of `steps` backward passes, fastddp with hook `spec` (a
    world1_hooks_scenarios spec) at FASTDDP_BUCKET_ALIGN=align (None: torch DDP)."""
    torch.manual_seed(0)
    base = OddMLP(double)
    if align is None:
        model = TorchDDP(base, **ddp_kwargs)
    else:
        with bucket_align(align):
            model = fastddp.DistributedDataParallel(base, **ddp_kwargs)
    hook = _hook(spec)
    if hook is not None:
        model.register_comm_hook(*hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    grads = []
    for step in range(steps):
        inputs, target = _batch(step)
        opt.zero_grad(set_to_none=step % 2 == 0)
        F.mse_loss(model(inputs), target).backward()
        grads.append([p.grad.clone() for p in unwrap(model).parameters()])
        opt.step()
    return model, grads


def hook_case(case: str, align: int = 64, steps: int = PSGD_START + 3) -> str:
    """One world1_hooks_scenarios case over padded slots: equal to fastddp's packed layout bit
    for bit, and to torch DDP with the case's reference hook bit for bit (2 ranks add in
    the one order there is; the half hooks round as torch's). Both runs' parameters follow
    their own grads, so the PowerSGD cases, whose compressed steps round differently from
    torch's and would compound, are compared up to PSGD_START (test_powersgd.py compares
    the compressed steps)."""
    fast_spec, ref_spec, _, native = CASES[case]
    kwargs = {"bucket_cap_mb": 0.0002}
    if native in QUANT8:  # float32 only, against the exact mean (torch DDP, no hook)
        fast, padded = _train(fast_spec, align, 1, double=False, **kwargs)
        _, packed = _train(fast_spec, 0, 1, double=False, **kwargs)
        _, exact = _train("none", None, 1, double=False, **kwargs)
        want = torch.cat([z.flatten() for z in exact[0]])
        bound = quantization_bound(native.removeprefix("fp8(").rstrip(")"), _local_grads(), want)
        for name, grads in (("padded", padded[0]), ("packed", packed[0])):
            got = torch.cat([x.flatten() for x in grads])
            worst = ((got - want).abs() / bound).max().item()
            assert worst < 1, f"{case} {name}: {worst:.3g} of the quantization bound"
        assert fast._reducer.hook_name == native, (fast._reducer.hook_name, native)
        return native
    fast, padded = _train(fast_spec, align, steps, **kwargs)
    if native is not None:
        assert fast._reducer.hook_name == native, (fast._reducer.hook_name, native)
    _, packed = _train(fast_spec, 0, steps, **kwargs)
    for step, (a, b) in enumerate(zip(padded, packed, strict=True)):
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"{case}, step {step}, parameter {k}: padded != packed"
    _, ref = _train(ref_spec, None, steps, **kwargs)
    checked = PSGD_START if native in ("powersgd", "powersgd_batched") else steps
    for step in range(checked):
        for k, (x, y) in enumerate(zip(padded[step], ref[step], strict=True)):
            torch.testing.assert_close(x, y, rtol=0, atol=0,
                                       msg=lambda m: f"{case}, step {step}, param {k}: {m}")
    return fast._reducer.hook_name


def cuda_default_alignment() -> int:
    """On one GPU (FASTDDP_WORLD1_REDUCER=1, NCCL): without FASTDDP_BUCKET_ALIGN every .grad
    view starts 16-byte aligned, and the grads equal torch DDP's."""
    from fastddp.ddp._options import WORLD1_REDUCER_ENV

    assert BUCKET_ALIGN_ENV not in os.environ
    os.environ[WORLD1_REDUCER_ENV] = "1"
    try:
        torch.manual_seed(0)
        base = OddMLP().cuda()
        kwargs = {"bucket_cap_mb": 0.0001, "gradient_as_bucket_view": True, "device_ids": [0]}
        ref = TorchDDP(copy.deepcopy(base), **kwargs)
        fast = fastddp.DistributedDataParallel(copy.deepcopy(base), **kwargs)
        assert fast._reducer is not None
        for step in range(2):
            inputs, target = (t.cuda() for t in _batch(step))
            for model in (ref, fast):
                model.zero_grad(set_to_none=True)
                F.mse_loss(model(inputs), target).backward()
            compare_grads(unwrap(ref), unwrap(fast), f"cuda, step {step}", EXACT)
            assert all(ptr % 16 == 0 for ptr in _grad_ptrs(fast)), _grad_ptrs(fast)
        return len(fast._reducer.bucket_bytes())
    finally:
        os.environ.pop(WORLD1_REDUCER_ENV, None)
