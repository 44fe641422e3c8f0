"""torch DDP's mixed_precision (_MixedPrecision) under fastddp. Run on every rank of a
harness world (see harness.py).

torch DDP itself cannot be the reference on this CPU-only machine: its mixed precision
makes a torch.Stream() at construction, which needs an accelerator. The reference is the
computation torch's code runs (torch/nn/parallel/distributed.py: _root_copy_hook,
_cast_buffers, _cast_forward_inputs; ddp_comm_hooks/mixed_precision_hooks.py:
_reducer_allreduce_and_upcast_hook) written out with plain torch ops on a copy of the
model: the fp32 parameters cast to param_dtype for forward and backward, the param_dtype
gradients concatenated per bucket and cast to reduce_dtype, allreduce(SUM), divided by
the world size in reduce_dtype, cast up to fp32. The same ops run in the same order on
the same values, buckets laid out as fastddp's (gloo's ring adds the ranks in an order set
by how it chunks each buffer), so every comparison is bit for bit. On a GPU,
cuda_torch_parity compares to torch DDP itself.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.parallel.distributed import _cast_buffers, _MixedPrecision

import fastddp
from tests.python.scenarios import agree, mlp, vector_batch, with_batchnorm

LR, MOMENTUM = 0.05, 0.9
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}
MODELS = {"mlp": mlp, "batchnorm": with_batchnorm}


def config(param: str, reduce: str | None, buffer: str | None) -> _MixedPrecision:
    return _MixedPrecision(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce],
                           buffer_dtype=DTYPES[buffer])


def bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    # rtol=atol=0: the same ops on the same values in the same order (dtype checked too).
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


class Reference:
    """torch's mixed-precision step written out: ``module`` runs forward and backward on
    param_dtype copies of ``masters``, the fp32 parameters the optimizer steps."""

    def __init__(self, base: nn.Module, mp: _MixedPrecision):
        self.mp = mp
        self.module = copy.deepcopy(base)
        self.masters = {n: nn.Parameter(p.detach().clone())
                        for n, p in self.module.named_parameters()}
        _cast_buffers(mp, self.module)  # torch's own: every buffer to buffer_dtype
        self.opt = torch.optim.SGD(self.masters.values(), lr=LR, momentum=MOMENTUM)

    def forward_backward(self, inputs: torch.Tensor, target: torch.Tensor) -> None:
        with torch.no_grad():
            for b in self.module.buffers():  # broadcast_buffers=True: rank 0's, each forward
                dist.broadcast(b, 0)
            for n, p in self.module.named_parameters():  # _root_copy_hook
                p.data = self.masters[n].detach().to(self.mp.param_dtype)
                if p.grad is not None:
                    p.grad.data = p.grad.to(self.mp.param_dtype)
        out = self.module(inputs.to(self.mp.param_dtype))  # _cast_forward_inputs
        F.mse_loss(out.float(), target).backward()

    def reduce(self, plan: list[list[str]]) -> None:
        """_reducer_allreduce_and_upcast_hook, bucket by bucket (fastddp's buckets)."""
        reduce_dtype = self.mp.reduce_dtype or self.mp.param_dtype
        named = dict(self.module.named_parameters())
        for bucket in plan:
            grads = [named[n].grad for n in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads]).to(reduce_dtype)
            dist.all_reduce(flat)
            flat.div_(dist.get_world_size())
            for n, g, part in zip(bucket, grads, flat.split([g.numel() for g in grads])):
                self.masters[n].grad = part.view_as(g).to(torch.float32)
                named[n].grad = None  # a synchronized backward leaves no local grad behind

    def zero_grad(self) -> None:
        self.opt.zero_grad()
        for p in self.module.parameters():
            p.grad = None


def _probe(model: fastddp.DistributedDataParallel, seen: list) -> None:
    """Records what the module's forward sees: after fastddp's cast (registered later)."""
    def hook(module, args):
        seen.append((args[0].dtype, {p.dtype for p in module.parameters()}))
    model.module.register_forward_pre_hook(hook)


def check_grads(ref: Reference, fast: nn.Module, where: str) -> None:
    for n, p in fast.module.named_parameters():
        assert p.dtype == torch.float32, f"{where}: {n} is {p.dtype} after backward"
        bitwise(p.grad, ref.masters[n].grad, f"{where}: grad of {n}")


def check_state(ref: Reference, fast: nn.Module, where: str) -> None:
    for n, p in fast.module.named_parameters():
        bitwise(p.detach(), ref.masters[n].detach(), f"{where}: {n}")
    for (n, b), r in zip(fast.module.named_buffers(), ref.module.buffers(), strict=True):
        bitwise(b, r, f"{where}: buffer {n}")


def training(model: str, param: str, reduce: str | None, buffer: str | None,
             steps: int = 4, **ddp_kwargs) -> None:
    """fastddp against the reference: grads after every backward, parameters and buffers
    after every step, what the forward sees, param and state_dict dtypes."""
    mp = config(param, reduce, buffer)
    torch.manual_seed(0)
    base = MODELS[model]()
    ref = Reference(base, mp)
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), mixed_precision=mp,
                                           bucket_cap_mb=0.0005, **ddp_kwargs)
    seen: list = []
    _probe(fast, seen)
    opt = torch.optim.SGD(fast.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        inputs, target = vector_batch(step)
        opt.zero_grad(set_to_none=step % 2 == 0)  # a fp32 zero .grad is cast down first
        ref.zero_grad()
        F.mse_loss(fast(inputs).float(), target).backward()
        ref.forward_backward(inputs, target)
        _reduce_and_step(ref, fast, opt, step)
    assert seen == [(mp.param_dtype, {mp.param_dtype})] * steps, seen
    for p in fast.parameters():  # torch's attributes
        assert (p._mp_param.dtype, p._fp_param.dtype) == (mp.param_dtype, torch.float32)
        assert p._mp_param.untyped_storage().nbytes() == 0  # freed until the next forward
    expected = copy.deepcopy(base)
    _cast_buffers(mp, expected)  # torch's own: what its state_dict holds
    dtypes = {k: v.dtype for k, v in fast.module.state_dict().items()}
    assert dtypes == {k: v.dtype for k, v in expected.state_dict().items()}, dtypes


def _reduce_and_step(ref: "Reference", fast: nn.Module, opt: torch.optim.Optimizer,
                     step: int) -> None:
    """The reference's reduction of this step, then both compared: the grads, and after
    both optimizers' steps the parameters and buffers."""
    ref.reduce(fast.bucket_plan())
    agree(lambda: check_grads(ref, fast, f"step {step}"))
    opt.step()
    ref.opt.step()
    agree(lambda: check_state(ref, fast, f"after step {step}"))


def accumulation(param: str, reduce: str) -> None:
    """no_sync(): the local grads add up in param_dtype and the parameters stay in
    param_dtype until the synchronized backward, as torch's hooks leave them."""
    mp = config(param, reduce, None)
    torch.manual_seed(0)
    base = mlp()
    ref = Reference(base, mp)
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), mixed_precision=mp)
    opt = torch.optim.SGD(fast.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(2):
        (a, ta), (b, tb) = vector_batch(2 * step), vector_batch(2 * step + 1)
        opt.zero_grad()
        ref.zero_grad()
        with fast.no_sync():
            F.mse_loss(fast(a).float(), ta).backward()
        assert {p.dtype for p in fast.parameters()} == {mp.param_dtype}
        assert {p.grad.dtype for p in fast.parameters()} == {mp.param_dtype}
        F.mse_loss(fast(b).float(), tb).backward()
        ref.forward_backward(a, ta)
        ref.forward_backward(b, tb)
        _reduce_and_step(ref, fast, opt, step)


def refusals() -> None:
    """What torch forbids with mixed_precision (its reducer takes its upcast hook only) and
    what fastddp does not run: NotImplementedError (a RuntimeError, as torch's), by name."""
    mp = config("bf16", "fp32", None)
    model = fastddp.DistributedDataParallel(mlp(), mixed_precision=mp)
    with pytest.raises(RuntimeError, match="mixed_precision"):
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(NotImplementedError, match="mixed_precision"):
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    assert model._comm_hooks == [] and model._get_ddp_logging_data()["comm_hook"] == (
        "_reducer_allreduce_and_upcast_hook")
    with pytest.raises(NotImplementedError, match="join"):
        model.join()
    base = mlp()
    named = list(base.named_parameters())
    with pytest.raises(NotImplementedError, match="delay_all_reduce_named_params"):
        fastddp.DistributedDataParallel(base, mixed_precision=mp,
                                        delay_all_reduce_named_params=named[:2],
                                        param_to_hook_all_reduce=named[2][1])
    with pytest.raises(NotImplementedError, match="sparse"):
        fastddp.DistributedDataParallel(nn.Embedding(10, 4, sparse=True), mixed_precision=mp)
    with pytest.raises(TypeError, match="param_dtype"):
        fastddp.DistributedDataParallel(mlp(), mixed_precision=_MixedPrecision(torch.int8))


def cuda_torch_parity(model: str, param: str, reduce: str | None, buffer: str | None,
                      steps: int = 4) -> None:
    """On a GPU, where torch DDP's mixed precision runs: fastddp against torch DDP itself,
    both on cuda:0 (2 gloo ranks, which add in the one order there is: bit for bit).

    torch's first backward reduces garbage: _set_mixed_precision_param_dtype converts the
    buckets' flat tensors to param_dtype but leaves the per-parameter views on the old fp32
    ones, so the gradients are copied where the hook does not read. Its bucket rebuild at
    the second forward lays out fresh buckets; the comparison starts there, after a first
    step that only runs forward and backward."""
    mp = config(param, reduce, buffer)
    torch.manual_seed(0)
    base = MODELS[model]().cuda()
    models = [wrap(copy.deepcopy(base), device_ids=[0], mixed_precision=mp)
              for wrap in (TorchDDP, fastddp.DistributedDataParallel)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in models]
    for step in range(steps + 1):
        inputs, target = vector_batch(step, device="cuda")
        for model, opt in zip(models, opts):
            opt.zero_grad()
            F.mse_loss(model(inputs).float(), target).backward()
        if step == 0:
            continue
        ref, fast = (m.module for m in models)
        for (n, p), q in zip(ref.named_parameters(), fast.parameters(), strict=True):
            bitwise(q.grad, p.grad, f"step {step}: grad of {n}")
        for opt in opts:
            opt.step()
        for (n, v), w in zip(ref.state_dict().items(), fast.state_dict().values(), strict=True):
            bitwise(w, v, f"after step {step}: {n}")
