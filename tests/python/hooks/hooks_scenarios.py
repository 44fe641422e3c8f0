"""Comm-hook scenarios, run on every rank of a harness world (see harness.py).

A hook is named by a string (kwargs must pickle): "fastddp.<builtin>[_fp32][_ef]",
"torch.<default or debugging hook, or wrapper>", "custom", or "none" (no hook: torch DDP's own
reduction). Each scenario trains torch DDP and fastddp side by side from one seed and
compares grads after every backward.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.scenarios import agree, mlp, unwrap, vector_batch

EXACT = {"rtol": 0.0, "atol": 0.0}


def custom_hook(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A Python hook that uses the GradBucket API and is not torch's average."""
    grads = bucket.gradients()
    state["calls"].append((bucket.index(), bucket.is_last(), len(bucket.parameters()),
                           [tuple(g.shape) for g in grads]))
    buffer = bucket.buffer()
    buffer.mul_(2.0 / dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def make_hook(spec: str) -> tuple[object, object]:
    """(state, hook) for a spec string; (None, None) for "none"."""
    if spec == "none":
        return None, None
    if spec == "custom":
        return {"calls": []}, custom_hook
    if spec == "torch.bf16_wrapper_custom":
        return {"calls": []}, dh.bf16_compress_wrapper(custom_hook)
    if spec.startswith("torch."):
        name = spec.removeprefix("torch.")
        if name.endswith("_wrapper"):
            return None, getattr(dh, f"{name}")(dh.allreduce_hook)
        return None, getattr(dh, name, None) or getattr(debugging_hooks, name)
    parts = spec.removeprefix("fastddp.").split("_")
    if parts[0] == "hier":  # "fastddp.hier_<inner spec>": 2 ranks per node
        inner = make_hook("fastddp." + "_".join(parts[1:]))[1]
        return None, fastddp.hooks.hierarchical(inter=inner, local_size=2)
    options = {}
    if "fp32" in parts:
        options["accumulate"] = "fp32"
    if "ef" in parts:
        options["error_feedback"] = True
    return None, getattr(fastddp.hooks, parts[0])(**options)


def compare_grads(ref: nn.Module, fast: nn.Module, where: str, tol: dict) -> None:
    """Bit for bit (tol EXACT); |fast - ref| <= tol["bound"][name] element by element; or
    within rtol, and atol relative to the largest |ref| element of each gradient."""
    for (name, p), q in zip(ref.named_parameters(), fast.parameters(), strict=True):
        if tol is EXACT:
            bad = (q.grad != p.grad).sum().item()
            assert bad == 0, (f"{where}: grad of {name}: {bad} of {p.grad.numel()} elements differ, "
                              f"max |diff| {(q.grad - p.grad).abs().max().item():.3g}")
        elif "rtol" in tol:
            atol = tol["atol"] * p.grad.abs().max().item()
            torch.testing.assert_close(q.grad, p.grad, rtol=tol["rtol"], atol=atol,
                                       msg=lambda m: f"{where}: grad of {name}: {m}")
        else:
            excess = (q.grad - p.grad).double().abs() - tol["bound"][name]
            assert bool((excess <= 0).all()), (
                f"{where}: grad of {name}: {int((excess > 0).sum())} elements beyond the bound, "
                f"by up to {excess.max().item():.3g}")


def division_bound(model: nn.Module, inputs: torch.Tensor, target: torch.Tensor,
                   loss_scale: float = 1.0) -> dict:
    """How far torch's allreduce_hook (buffer.div_(w), then the sum) may fall from torch
    DDP's reduction (grad * fl(1/w), then the sum), per element: with u = 2^-24 and
    S = sum over ranks of |g_r|, each side is within (w + 1) u S / w of the exact mean (the
    product: 2u per term, the rounded 1/w and the product; the quotient: u; then u per
    addition of w - 1), so the two within (2w + 2) u S / w, plus 2^-146 for the float32
    subnormals (4 roundings of at most 2^-150). S is torch's: the local gradients of a
    replica, summed in magnitude across ranks."""
    local = copy.deepcopy(model)
    local.zero_grad()
    (F.mse_loss(local(inputs), target) * loss_scale).backward()
    w = dist.get_world_size()
    bound = {}
    for name, p in local.named_parameters():
        s = p.grad.double().abs()
        dist.all_reduce(s)
        bound[name] = (2 * w + 2) * 2.0 ** -24 * s / w + 2.0 ** -146
    return bound


def hooked_training(fast_hook: str, ref_hook: str, exact: bool, steps: int = 4,
                    device: str = "cpu", dtype: str = "float32", loss_scale: float = 1.0,
                    **ddp_kwargs) -> list:
    """torch DDP with `ref_hook` against fastddp with `fast_hook`. Exact: grads bit for bit
    and parameters follow. Otherwise grads within division_bound (torch's allreduce_hook
    divides, torch DDP and fastddp multiply by 1/w), and fastddp takes torch's parameters
    after each step so that differences cannot compound. device "cuda": the models on the
    current GPU (ranks share it on gloo). dtype: the model's. loss_scale multiplies the
    loss (1e-4: many gradients in float16's subnormal range)."""
    torch.manual_seed(0)
    base = mlp().to(device, getattr(torch, dtype))
    if device != "cpu":
        ddp_kwargs = {**ddp_kwargs, "device_ids": [torch.device(device).index or 0]}
    ref = TorchDDP(copy.deepcopy(base), **ddp_kwargs)
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    ref_state, ref_fn = make_hook(ref_hook)
    fast_state, fast_fn = make_hook(fast_hook)
    if ref_fn is not None:
        ref.register_comm_hook(ref_state, ref_fn)
    if fast_fn is not None:
        fast.register_comm_hook(fast_state, fast_fn)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fast)]
    for step in range(steps):
        inputs, target = (t.to(base[0].weight.dtype) for t in vector_batch(step, device=device))
        tol = EXACT if exact else {"bound": division_bound(unwrap(ref), inputs, target,
                                                                 loss_scale)}
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad(set_to_none=step % 2 == 0)
            (F.mse_loss(model(inputs), target) * loss_scale).backward()
        agree(lambda: compare_grads(unwrap(ref), unwrap(fast), f"step {step}", tol))
        for opt in opts:
            opt.step()
        if not exact:
            with torch.no_grad():
                for p, q in zip(ref.parameters(), fast.parameters()):
                    q.copy_(p)
    if isinstance(fast_state, dict):
        assert fast_state["calls"] == ref_state["calls"], (fast_state["calls"], ref_state["calls"])
    return fast._reducer.hook_name if fast._reducer is not None else None


def accumulation_error(ranks_expected: int = 4) -> dict[str, float]:
    """Relative error of bf16 and fp32-accumulated bf16 averages against float32."""
    assert dist.get_world_size() == ranks_expected
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    models = {name: fastddp.DistributedDataParallel(copy.deepcopy(base))
              for name in ("fp32", "bf16", "bf16_fp32")}
    models["bf16"].register_comm_hook(None, fastddp.hooks.bf16())
    models["bf16_fp32"].register_comm_hook(None, fastddp.hooks.bf16(accumulate="fp32"))
    g = torch.Generator().manual_seed(dist.get_rank())
    inputs, target = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    for model in models.values():
        F.mse_loss(model(inputs), target).backward()
    exact = torch.cat([p.grad.flatten() for p in models["fp32"].parameters()])
    errors = {}
    for name in ("bf16", "bf16_fp32"):
        got = torch.cat([p.grad.flatten() for p in models[name].parameters()])
        errors[name] = ((got - exact).abs().sum() / exact.abs().sum()).item()
    return errors


def registration_errors() -> list[str]:
    """Returns the messages of torch's registration errors, raised by fastddp."""
    torch.manual_seed(0)
    model = fastddp.DistributedDataParallel(mlp())
    messages = []
    for hook, error in ((3, TypeError), (lambda state, bucket: None, None),
                        (_bad_annotation, ValueError), (_bad_return, ValueError)):
        if error is None:
            continue
        try:
            model.register_comm_hook(None, hook)
        except error as e:
            messages.append(str(e))
        else:
            raise AssertionError(f"{hook!r} was accepted")
    model.register_comm_hook(None, fastddp.hooks.bf16())
    try:
        model.register_comm_hook(None, fastddp.hooks.bf16())
    except RuntimeError as e:
        messages.append(str(e))
    else:
        raise AssertionError("a second register_comm_hook was accepted")
    for bad in ({"accumulate": "fp64"}, {"error_feedback": 1}):
        try:
            fastddp.hooks.bf16(**bad)
        except (ValueError, TypeError) as e:
            messages.append(str(e))
    return messages


def _bad_annotation(state: object, bucket: int) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called")


def _bad_return(state: object, bucket: dist.GradBucket) -> int:
    raise AssertionError("never called")


class FailingMidBackward(nn.Module):
    """An MLP whose backward fails inside fastddp's reducer half-way, on every rank alike,
    after break_next_backward(): its first layer's weight gets a sparse gradient (a
    post-accumulate hook swaps it), which the reducer refuses (a dense parameter) after the
    later layers' buckets launched."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def break_next_backward(self) -> None:
        def to_double(param: torch.Tensor) -> None:
            param.grad = param.grad.to_sparse()
            handle.remove()

        handle = self.net[0].weight.register_post_accumulate_grad_hook(to_double)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def abandoned_step(spec: str) -> None:
    """A backward that fails after its first buckets were launched: the next steps run as
    if it never happened (the hook drops the half-done step instead of finishing it, so
    every rank's collective sequence stays the same), bit for bit against a run without
    the failed step."""
    torch.manual_seed(0)
    base = FailingMidBackward()
    models = [fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.0005)
              for _ in range(2)]
    for model in models:
        model.register_comm_hook(*make_hook(spec))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    failed = 2  # after the one bucket rebuild (step 1's forward)
    for step in range(5):
        inputs, target = vector_batch(step)
        if step == failed:
            assert len(models[0].bucket_plan()) > 2, models[0].bucket_plan()
        for i, (model, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            if step == failed:
                if i == 1:
                    continue  # the reference skips the failed step
                model.module.break_next_backward()
                try:
                    F.mse_loss(model(inputs), target).backward()
                except RuntimeError as e:
                    assert "net.0.weight" in str(e), e
                else:
                    raise AssertionError("the backward did not fail")
                continue
            F.mse_loss(model(inputs), target).backward()
            opt.step()
        if step != failed:
            agree(lambda: compare_grads(unwrap(models[1]), unwrap(models[0]), f"step {step}",
                                        EXACT))
