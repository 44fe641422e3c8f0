"""check_for_nan_in_grad scenarios, run on every rank of a harness world.

A NaN or Inf put into one parameter's gradient on chosen ranks at a chosen step must make
backward() raise on every rank, naming the parameter, the rank and the step; the next
step (after zero_grad) must train exactly as torch DDP does on the same data.
"""

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.scenarios import agree, compare_grads, compare_state, mlp, vector_batch

HOOKS = {
    "allreduce": None,
    "bf16": lambda: fastddp.hooks.bf16(),
    "bf16-fp32acc-ef": lambda: fastddp.hooks.bf16(accumulate="fp32", error_feedback=True),
    "powersgd": lambda: fastddp.hooks.powersgd(start_powerSGD_iter=2, min_compression_rate=1),
    "python": "python",
}


def _python_allreduce(state: object,
                      bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def _register(model: nn.Module, hook: str) -> None:
    make = HOOKS[hook]
    if make == "python":
        model.register_comm_hook(None, _python_allreduce)
    elif make is not None:
        model.register_comm_hook(None, make())


def _poison(model: nn.Module, name: str, value: float) -> None:
    """Makes `name`'s gradient non-finite in the next backward, on this rank."""
    param = dict(model.named_parameters())[name]
    handle = None

    def hook(grad: torch.Tensor) -> torch.Tensor:
        handle.remove()
        grad = grad.clone()
        grad.view(-1)[1] = value
        return grad

    handle = param.register_hook(hook)


def nan_then_train(hook: str, bad_ranks: list[int], value: float = math.nan,
                   gradient_as_bucket_view: bool = False) -> list[str]:
    """Step 1 is clean, step 2 has a non-finite gradient of '2.weight' on `bad_ranks` and
    must raise; steps 3-4 train side by side with torch DDP (whose replica skipped step 2
    the same way: no optimizer step) and must match. Returns the step-2 message."""
    torch.manual_seed(0)
    base = mlp()
    kwargs = {"gradient_as_bucket_view": gradient_as_bucket_view}
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), check_for_nan_in_grad=True,
                                           **kwargs)
    ref = TorchDDP(copy.deepcopy(base), **kwargs)
    _register(fast, hook)
    if hook in ("bf16", "bf16-fp32acc-ef"):
        ref.register_comm_hook(None, fastddp.hooks.bf16() if hook == "bf16" else
                               fastddp.hooks.bf16(accumulate="fp32", error_feedback=True))
    return train_around_a_poisoned_step(
        ref, fast, vector_batch,
        poison=lambda: dist.get_rank() in bad_ranks and _poison(fast.module, "2.weight", value),
        after_backward=lambda s: compare_grads(ref.module, fast.module, f"step {s}"),
        after_step=lambda s: compare_state(ref.module, fast.module, f"after step {s}"))


def train_around_a_poisoned_step(ref: nn.Module, fast: nn.Module, batch: Callable[[int], Any],
                                 poison: Callable[[], Any],
                                 after_backward: Callable[[int], None],
                                 after_step: Callable[[int], None] | None = None) -> str:
    """Steps 1-4 of torch DDP (`ref`) and fastddp side by side, SGD on both. At step 2 only
    fastddp runs, after `poison()`, and its backward must raise on every rank (torch's
    replica skips that step the same way: no optimizer step); after every other backward
    and step the checks compare them on every rank. Returns the step-2 message."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, fast)]
    message = ""
    for step in range(1, 5):
        inputs, target = batch(step)
        for opt in opts:
            opt.zero_grad()
        if step == 2:
            poison()
            try:
                F.mse_loss(fast(inputs), target).backward()
            except RuntimeError as e:
                message = str(e)
            agree(lambda: _expect(message != "", "step 2 did not raise"))
            continue
        for model in (ref, fast):
            F.mse_loss(model(inputs), target).backward()
        agree(lambda s=step: after_backward(s))
        for opt in opts:
            opt.step()
        if after_step is not None:
            agree(lambda s=step: after_step(s))
    return message


def nan_then_finite(hook: str, bad_ranks: list[int]) -> str:
    """A stateful hook, compressing from step 3: step 4 has a non-finite gradient on
    `bad_ranks` and raises; steps 5-7 must give finite gradients, equal on every rank.
    Returns the step-4 message."""
    torch.manual_seed(0)
    model = fastddp.DistributedDataParallel(mlp(), check_for_nan_in_grad=True)
    _register(model, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    message = ""
    for step in range(1, 8):
        inputs, target = vector_batch(step)
        opt.zero_grad()
        if step == 4 and dist.get_rank() in bad_ranks:
            _poison(model.module, "2.weight", math.nan)
        try:
            F.mse_loss(model(inputs), target).backward()
        except RuntimeError as e:
            _expect(step == 4, f"step {step} raised: {e}")
            message = str(e)
            continue
        _expect(step != 4, "step 4 did not raise")
        for name, p in model.named_parameters():
            _expect(bool(torch.isfinite(p.grad).all()), f"step {step}: {name}.grad not finite")
            grads = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
            dist.all_gather(grads, p.grad)
            _expect(all(torch.equal(g, grads[0]) for g in grads),
                    f"step {step}: {name}.grad differs across ranks")
        opt.step()
    return message


def clean_run_is_unchanged(hook: str) -> None:
    """With the check on and finite gradients, every gradient is bit for bit what it is
    with the check off."""
    torch.manual_seed(0)
    base = mlp()
    models = [fastddp.DistributedDataParallel(copy.deepcopy(base), check_for_nan_in_grad=c)
              for c in (False, True)]
    for model in models:
        _register(model, hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    for step in range(4):
        inputs, target = vector_batch(step)
        for model, opt in zip(models, opts):
            opt.zero_grad()
            F.mse_loss(model(inputs), target).backward()
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            _expect(torch.equal(p.grad, q.grad), f"step {step}: {name}.grad differs")
        for opt in opts:
            opt.step()


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
