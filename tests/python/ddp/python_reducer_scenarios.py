"""torch._dynamo.config.optimize_ddp="python_reducer" (Note [python reducer] in
fastddp/ddp/_python_reducer.py): torch DDP and fastddp built in that mode, trained the same
way on the same data. Run on every rank of a harness world (see harness.py)."""

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol
import torch.nn.functional as F
from torch._dynamo import compiled_autograd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.ddp.compile_scenarios import Net, _compare, batch
from tests.python.scenarios import agree


def summing_hook(group, bucket):  # noqa: ANN001 (torch checks any annotation against GradBucket)
    """A comm hook in this mode's protocol (one parameter at a time: `bucket` is (grad,
    param); torch checks the argument's name): the sum over ranks, not the mean, so that its
    gradients differ from the default averaging's."""
    grad, _ = bucket
    grad.copy_(fcol.all_reduce(grad, "sum", group))


def _train(cls: type, backward: str, hook: bool, steps: int) -> dict:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        ddp = cls(Net(), bucket_cap_mb=1)
    if hook:
        ddp.register_comm_hook(dist.group.WORLD, summing_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    model = torch.compile(ddp, backend="aot_eager") if backward == "compiled" else ddp
    grads = []
    for step in range(steps):
        inputs, target = batch(step)
        opt.zero_grad(set_to_none=step % 2 == 0)
        loss = F.mse_loss(model(inputs), target)
        if backward == "compiled":  # compiled autograd traces the backward, hooks included
            with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                loss.backward()
        else:
            loss.backward()
        grads.append([p.grad.clone() for p in ddp.parameters()])
        opt.step()
    captures = torch._dynamo.utils.counters["compiled_autograd"]["captures"]
    return {"grads": grads, "params": [p.detach().clone() for p in ddp.parameters()],
            "calls": [], "captures": captures}


def trains_as_torch(backward: str, hook: bool = False, steps: int = 3) -> dict:
    """Built under optimize_ddp="python_reducer": a compiled model whose backward runs under
    compiled autograd (backward="compiled"), or an eager model and backward. fastddp's gradients after every
    backward and parameters after every step are torch DDP's (bit for bit on 2 ranks, see
    compile_scenarios._compare); with the summing hook too. Returns the compiled-autograd
    capture counts: the compiled backward really went through compiled autograd."""
    ref = _train(TorchDDP, backward, hook, steps)
    fast = _train(fastddp.DistributedDataParallel, backward, hook, steps)
    agree(lambda: _compare(ref, fast))
    return {"torch": ref["captures"], "fastddp": fast["captures"]}


def builtin_hook_refused(how: str) -> str:
    """A fastddp built-in hook in this mode (register_comm_hook, or torch's builtin type):
    NotImplementedError naming the mode; torch's would sit unused on its idle reducer."""
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        ddp = fastddp.DistributedDataParallel(Net(), bucket_cap_mb=1)
    try:
        if how == "register":
            ddp.register_comm_hook(None, fastddp.hooks.bf16())
        else:
            ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    except NotImplementedError as e:
        return str(e)
    raise AssertionError("the built-in hook was accepted")


def other_mode_trains_as_torch(mode: str, **kwargs: Any) -> dict:
    """optimize_ddp="python_reducer_without_compiled_forward" (torch DDP keeps its C++
    reducer there), a compiled model and an eager backward: as torch."""
    from tests.python.ddp.compile_scenarios import same_as_torch

    with torch._dynamo.config.patch(optimize_ddp=mode):
        return same_as_torch("outer", "aot_eager", **kwargs)
