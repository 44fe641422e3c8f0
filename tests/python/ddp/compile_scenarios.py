"""torch.compile scenarios, run on every rank of a harness world (see harness.py).

Each compiles torch DDP and fastddp the same way (torch.compile(DDP(m)): "outer";
DDP(torch.compile(m)): "inner") with a backend that counts the graphs it is given:
dynamo's DDPOptimizer hands the backend one graph per bucket-sized piece of the model, so
the count is the number of pieces the forward was split into.
"""

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import fastddp  # noqa: E402
from compile_step import counting_backend  # noqa: E402  (benchmarks/compile_step.py)
from tests.python.hooks.hooks_scenarios import make_hook  # noqa: E402
from tests.python.scenarios import agree, assert_close_ulps, rounding_ulps, unwrap  # noqa: E402

MODES = ("outer", "inner")
# A 512x512 float32 weight is 1 MiB: with bucket_cap_mb=1 each big layer is a bucket.
WIDTH = 512


class Net(nn.Module):
    """Four linear layers, three of them near 1 MiB: DDPOptimizer splits it into pieces."""

    def __init__(self, unused: bool = False):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, WIDTH), nn.Linear(WIDTH, WIDTH),
                                     nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4)])
        # A layer forward never uses (find_unused_parameters).
        self.spare = nn.Linear(4, 4) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight samples, different on every rank and every step."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _make_hook(spec: str) -> tuple[object, object]:
    """hooks_scenarios.make_hook's specs, and "powersgd": fastddp's, compressing from step 2."""
    if spec == "powersgd":
        return None, fastddp.hooks.powersgd(matrix_approximation_rank=2, start_powerSGD_iter=2)
    return make_hook(spec)


def wrap(cls: type, base: nn.Module, mode: str, backend: str, hook: str | None = None,
         **ddp_kwargs: Any) -> tuple[nn.Module, nn.Module, dict]:
    """(model to call, the DDP wrapper, graph counter) for `cls` compiled in `mode`
    ("outer", "inner", or "eager": not compiled)."""
    box, compiled = counting_backend(backend)
    module = copy.deepcopy(base)
    if mode == "inner":
        module = torch.compile(module, backend=compiled)
    ddp = cls(module, **ddp_kwargs)
    if hook is not None:
        ddp.register_comm_hook(*_make_hook(hook))
    model = torch.compile(ddp, backend=compiled) if mode == "outer" else ddp
    return model, ddp, box


def _grads(ddp: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in unwrap(ddp).parameters()]


def run(cls: type, mode: str, backend: str, steps: int, unused: bool = False,
        hook: str | None = None, **ddp_kwargs: Any) -> dict:
    """Trains one model; returns its grads per step, final parameters and graph count, or
    the error it raised."""
    torch._dynamo.reset()  # a fresh cache: no recompile limit carried from earlier runs
    torch.manual_seed(0)
    try:
        model, ddp, box = wrap(cls, Net(unused), mode, backend, hook, **ddp_kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        grads = []
        frames = torch._dynamo.utils.counters["frames"]
        for step in range(steps):
            if step == steps - 1:
                converted = frames["total"]
            inputs, target = batch(step)
            opt.zero_grad(set_to_none=step % 2 == 0)
            F.mse_loss(model(inputs), target).backward()
            grads.append(_grads(ddp))
            opt.step()
        # Frames dynamo's Python side looked at in the last step (compiled ones are cached).
        converted = frames["total"] - converted
    except Exception as e:  # compared with the other implementation's outcome
        return {"error": type(e).__name__, "message": str(e)}
    state = ddp._comm_hooks[0][1] if hook is not None else None
    return {"grads": grads, "params": [p.detach().clone() for p in unwrap(ddp).parameters()],
            "graphs": box["graphs"], "calls": state["calls"] if isinstance(state, dict) else None,
            "converted": converted}


def _compare(ref: dict, fast: dict) -> None:
    # The same compiled graphs on both sides and 2 ranks: bit for bit (scenarios.ULPS).
    ulps = rounding_ulps()
    if "error" in ref or "error" in fast:
        assert ref.get("error") == fast.get("error"), (
            f"torch DDP: {ref.get('error', 'ok')} {ref.get('message', '')[:300]}; "
            f"fastddp: {fast.get('error', 'ok')} {fast.get('message', '')[:300]}")
        return
    for step, (theirs, ours) in enumerate(zip(ref["grads"], fast["grads"], strict=True)):
        for i, (p, q) in enumerate(zip(theirs, ours, strict=True)):
            assert (p is None) == (q is None), f"step {step}: grad {i} set under one only"
            if p is not None:
                assert_close_ulps(q, p, ulps, msg=lambda m: f"step {step} grad {i}: {m}")
    for i, (p, q) in enumerate(zip(ref["params"], fast["params"], strict=True)):
        assert_close_ulps(q, p, ulps, msg=lambda m: f"parameter {i}: {m}")
    # A Python hook's record of (bucket index, is_last, parameters, shapes) per call.
    assert fast["calls"] == ref["calls"], (fast["calls"], ref["calls"])


def same_as_torch(mode: str, backend: str = "inductor", steps: int = 3, unused: bool = False,
                  hook: str | None = None, **ddp_kwargs: Any) -> dict:
    """torch DDP and fastddp compiled the same way on the same data: the same gradients
    and parameters, or the same error. Returns the graph counts (or the error)."""
    ddp_kwargs.setdefault("bucket_cap_mb", 1)
    ref = run(TorchDDP, mode, backend, steps, unused, hook, **ddp_kwargs)
    fast = run(fastddp.DistributedDataParallel, mode, backend, steps, unused, hook, **ddp_kwargs)
    agree(lambda: _compare(ref, fast))
    if "error" in ref:
        return {"error": ref["error"], "torch": ref["message"], "fastddp": fast["message"]}
    return {"torch": ref["graphs"], "fastddp": fast["graphs"],
            "converted": {"torch": ref["converted"], "fastddp": fast["converted"]}}


def hook_compiled_vs_eager(hook: str, mode: str, backend: str = "aot_eager",
                           steps: int = 4) -> dict:
    """fastddp with `hook`, compiled, against the same uncompiled, side by side: grads bit
    for bit at every step (the compiled model takes the eager one's parameters after each
    step, so that a difference could not compound)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = Net()
    cls = fastddp.DistributedDataParallel
    eager, eager_ddp, _ = wrap(cls, base, "eager", backend, hook, bucket_cap_mb=1)
    compiled, compiled_ddp, box = wrap(cls, base, mode, backend, hook, bucket_cap_mb=1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, compiled)]
    for step in range(steps):
        inputs, target = batch(step)
        for model, opt in zip((eager, compiled), opts):
            opt.zero_grad()
            F.mse_loss(model(inputs), target).backward()

        def check(s: int = step) -> None:
            # Bit for bit: aot_eager runs the eager aten ops, so each rank's local gradients
            # are the eager ones; every hook here works per element or per parameter (not
            # on the bucket as a whole), so the compiled run's other buckets change nothing,
            # and 2 ranks add in the one order there is.
            for i, (p, q) in enumerate(zip(_grads(eager_ddp), _grads(compiled_ddp))):
                torch.testing.assert_close(q, p, rtol=0, atol=0,
                                           msg=lambda m: f"step {s} grad {i}: {m}")

        agree(check)
        for opt in opts:
            opt.step()
        with torch.no_grad():
            for p, q in zip(unwrap(eager_ddp).parameters(), unwrap(compiled_ddp).parameters()):
                q.copy_(p)
    # A Python hook's calls are not compared: under compile the gradients become ready in
    # another order, so the rebuilt buckets differ (as torch DDP's do; same_as_torch
    # compares them with torch's).
    return {"hook": compiled_ddp._reducer.hook_name, "graphs": box["graphs"]}


def _compiled_step(ddp: nn.Module, backend: str) -> Callable:
    @torch.compile(backend=backend)
    def step(inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(ddp(inputs), target)
        loss.backward()
        return loss

    return step


def compiled_autograd(how: str, backend: str = "aot_eager") -> dict:
    """fastddp under compiled autograd, turned on `how`:
    "step": torch._dynamo.config.compiled_autograd=True and a compiled training step (the
    way torch recommends); "backward": compiled_autograd._enable() around backward only.
    Raises what fastddp raises; the gradients must be left unset (nothing was skipped and
    reported done)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ddp = fastddp.DistributedDataParallel(Net(), bucket_cap_mb=1)
    inputs, target = batch(0)
    try:
        if how == "step":
            with torch._dynamo.config.patch(compiled_autograd=True):
                _compiled_step(ddp, backend)(inputs, target)
        else:
            loss = F.mse_loss(torch.compile(ddp, backend=backend)(inputs), target)
            from torch._dynamo import compiled_autograd as ca
            with ca._enable(torch.compile(backend=backend)):
                loss.backward()
    finally:
        assert all(p.grad is None for p in ddp.parameters()), "a gradient was written"
    return {}


def torch_under_compiled_autograd(backend: str = "aot_eager") -> str:
    """What torch DDP raises for the same compiled training step (the reference error)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ddp = TorchDDP(Net(), bucket_cap_mb=1)
    inputs, target = batch(0)
    try:
        with torch._dynamo.config.patch(compiled_autograd=True):
            _compiled_step(ddp, backend)(inputs, target)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def compiled_forward_under_config(backend: str = "aot_eager", steps: int = 3) -> dict:
    """torch._dynamo.config.compiled_autograd=True with torch.compile(DDP(m)) and an eager
    backward (compiled autograd is on only while the compiled forward runs): torch DDP
    trains, and fastddp must train to the same numbers."""
    with torch._dynamo.config.patch(compiled_autograd=True):
        return same_as_torch("outer", backend, steps)


def python_reducer_mode(mode: str) -> None:
    """Construction under torch's optimize_ddp Python-reducer modes."""
    with torch._dynamo.config.patch(optimize_ddp=mode):
        fastddp.DistributedDataParallel(Net(), bucket_cap_mb=1)


def patched(backend: str = "aot_eager", steps: int = 2) -> dict:
    """Under fastddp.patch(), a script's torch.compile(nn.parallel.DistributedDataParallel(m))
    builds fastddp's model: torch DDP's grads and graph count (torch._dynamo keeps torch's
    class under its own name; fastddp marks the active module on that class)."""
    ref = run(TorchDDP, "outer", backend, steps, bucket_cap_mb=1)
    with fastddp.patch(disable=False):
        cls = nn.parallel.DistributedDataParallel
        assert issubclass(cls, fastddp.DistributedDataParallel), cls
        fast = run(cls, "outer", backend, steps, bucket_cap_mb=1)
    agree(lambda: _compare(ref, fast))
    return {"torch": ref["graphs"], "fastddp": fast["graphs"]}
