"""Misuse scenarios for test_misuse.py, run on every rank of a harness world.

Each does one misuse, records what it raised (or "ok"), then takes the next step and checks
its numbers against torch DDP on the same data (or against the plain average of the ranks'
local gradients where torch DDP gets it wrong too). Errors are caught and returned as
outcomes, so that every rank answers and a test sees what each rank got.
"""

import copy
import datetime
import io
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.hooks.hooks_scenarios import EXACT, custom_hook
from tests.python.hooks.hooks_scenarios import compare_grads as compare_grads_exact
from tests.python.hooks.powersgd_scenarios import serialized_powerSGD_hook
from tests.python.scenarios import (agree, assert_close_ulps, compare_grads, mlp, rounding_ulps,
                                    side_by_side, step_grads, torch_rebuilt_plan, train, unwrap,
                                    vector_batch)


def _outcome(action: Callable[[], object]) -> str:
    """"ok", or the exception's type and message."""
    try:
        action()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def _step(model: nn.Module, step: int, dtype: torch.dtype = torch.float32,
          device: str = "cpu") -> None:
    inputs, target = vector_batch(step)
    model.zero_grad()
    F.mse_loss(model(inputs.to(device, dtype)), target.to(device, dtype)).backward()


def _averaged(module: nn.Module, step: int) -> list[torch.Tensor]:
    """The mean over ranks of the local gradients of `module` on this step's data, computed
    without DDP: what a correct synchronized backward leaves in .grad."""
    local = copy.deepcopy(module)
    _step(local, step, next(local.parameters()).dtype)
    grads = []
    for p in local.parameters():
        dist.all_reduce(p.grad)
        grads.append(p.grad / dist.get_world_size())
    return grads


def _is_average(module: nn.Module, expected: list[torch.Tensor], factor: float = 1.0) -> bool:
    """Whether every .grad is `factor` times the ranks' average, as far as the order of the
    sums allows (scenarios.ULPS: bit for bit on 2 ranks; `factor` 2 is exact)."""
    def close(grad: torch.Tensor, want: torch.Tensor) -> bool:
        try:
            assert_close_ulps(grad, want, rounding_ulps())
        except AssertionError:
            return False
        return True

    return all(close(p.grad, factor * g)
               for p, g in zip(module.parameters(), expected, strict=True))


# --- a rank with a different model --------------------------------------------------------

def different_model() -> str:
    """Rank 1 builds a wider hidden layer; then the next step: the same model on every rank
    trains as under torch DDP."""
    width = 16 if dist.get_rank() == 1 else 32
    message = _outcome(lambda: fastddp.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4))))
    train(*side_by_side(mlp), steps=2)
    return message


class RankSkips(nn.Module):
    """Rank 1's forward leaves `first` out: the same parameters, another graph."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.last = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(x if dist.get_rank() == 1 else torch.tanh(self.first(x)))


def rank_skips_a_layer() -> list[str]:
    """Two steps of RankSkips, on a group whose collectives time out after 3 s: rank 1
    never launches the bucket that the other ranks wait for."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    torch.manual_seed(0)
    model = fastddp.DistributedDataParallel(RankSkips(), process_group=group)
    return [_outcome(lambda: _step(model, step)) for step in range(2)]


# --- bucket layouts that differ across ranks ----------------------------------------------

BUCKET_ARGUMENTS = {
    # find_unused_parameters: buckets are never rebuilt, so the first ones must agree.
    "bucket_cap_mb": ({"bucket_cap_mb": 25, "find_unused_parameters": True},
                      {"bucket_cap_mb": 0.001, "find_unused_parameters": True}),
    "bucket_cap_mb_list": ({"bucket_cap_mb_list": [25]}, {"bucket_cap_mb_list": [0.001, 0.002]}),
    "find_unused_parameters": ({"bucket_cap_mb": 0.001},
                               {"bucket_cap_mb": 0.001, "find_unused_parameters": True}),
    # Default arguments: one first bucket everywhere, and the rebuilt layout is rank 0's.
    "bucket_cap_mb_rebuilt": ({"bucket_cap_mb": 25}, {"bucket_cap_mb": 0.001}),
}


def bucket_arguments_differ(argument: str) -> str:
    """Odd ranks take the second set of arguments. Returns what fastddp's constructor did;
    then the next step: where it was refused, the same model with rank 0's arguments on
    every rank trains as under torch DDP; where it was built, it trains as torch DDP with
    the same per-rank arguments, with rank 0's bucket layout on every rank."""
    kwargs = BUCKET_ARGUMENTS[argument][dist.get_rank() % 2]
    torch.manual_seed(0)
    message = _outcome(lambda: fastddp.DistributedDataParallel(mlp(), **kwargs))
    if message != "ok":
        kwargs = BUCKET_ARGUMENTS[argument][0]
    ref, fast = side_by_side(mlp, **kwargs)
    train(ref, fast, steps=3)
    if message == "ok":
        plan = fast.bucket_plan()
        agree(lambda: _expect(plan == torch_rebuilt_plan(ref),
                              f"fastddp {plan}, torch {torch_rebuilt_plan(ref)}"))
    return message


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


# --- comm hooks that misbehave -------------------------------------------------------------

_RESULTS: dict[str, Callable[[torch.Tensor], object]] = {
    "average": lambda t: t,
    "short": lambda t: t[:-1].clone(),
    "long": lambda t: torch.cat([t, t[:1]]),
    "two_d": lambda t: t.view(1, -1),
    "int_dtype": lambda t: t.to(torch.int32),
    "number": lambda t: 3.0,
    "none": lambda t: None,
    "two_tensors": lambda t: [t, t.clone()],
}


def misbehaving_hook(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages, except at step state["bad_step"], where it does state["kind"]."""
    kind = state["kind"] if state["step"] == state["bad_step"] else "average"
    buffer = bucket.buffer()
    if kind == "raise":
        raise ValueError(f"misbehaving_hook fails on purpose at step {state['step']}")
    if kind == "not_a_future":
        return buffer
    convert = _RESULTS[kind]
    future = dist.all_reduce(buffer.div_(dist.get_world_size()), async_op=True).get_future()
    return future.then(lambda f: convert(f.value()[0]))


def hook_misbehaves(kind: str) -> list[str]:
    """fastddp and torch DDP with misbehaving_hook, three steps; fastddp's misbehaves at
    step 1. torch DDP's misbehaves there too for "two_d" (a [1, N] result, which torch
    takes) and is otherwise skipped at step 1 (no backward, no optimizer step on either).
    Grads are compared bit for bit at every step fastddp completes; returns its outcomes."""
    torch.manual_seed(0)
    base = mlp()
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=0.001)
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001)
    ref_state = {"step": 0, "bad_step": 1 if kind == "two_d" else -1, "kind": kind}
    state = {"step": 0, "bad_step": 1, "kind": kind}
    ref.register_comm_hook(ref_state, misbehaving_hook)
    fast.register_comm_hook(state, misbehaving_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, fast)]
    outcomes = []
    for step in range(3):
        state["step"] = ref_state["step"] = step
        outcomes.append(_outcome(lambda: _step(fast, step)))
        if outcomes[-1] != "ok":
            continue
        if step != 1 or kind == "two_d":
            _step(ref, step)
            agree(lambda: compare_grads_exact(ref.module, fast.module, f"step {step}", EXACT))
            for opt in opts:
                opt.step()
    return outcomes


# --- parameters converted after wrapping ---------------------------------------------------

CONVERSIONS: dict[str, Callable[[nn.Module], object]] = {
    "double": lambda m: m.double(),
    "half": lambda m: m.half(),
    "meta": lambda m: m.to("meta"),
}


def convert_wrapper(how: str) -> str:
    """ddp_model.double(), .half(), .to("meta"): refused before anything is converted, so
    the model then trains as under torch DDP (not converted)."""
    ref, fast = side_by_side(mlp)
    message = _outcome(lambda: CONVERSIONS[how](fast))
    assert all(p.dtype == torch.float32 and p.device.type == "cpu"
               for p in fast.parameters()), "the refused conversion changed the model"
    train(ref, fast, steps=2)
    return message


def convert_module(how: str) -> list[str]:
    """The inner module converted behind the wrapper ("module.double": ddp.module.double();
    "param.data": each param.data replaced by a float64 copy) after one step. Returns the
    outcomes of the next two steps; a step that runs but does not leave the ranks' average
    in .grad is reported as such. (ddp.module.to("meta") replaces the Parameter objects
    themselves, which the reducer cannot see: not covered, see docs/failures.md.)"""
    torch.manual_seed(0)
    model = fastddp.DistributedDataParallel(mlp())
    _step(model, 0)
    if how == "module.double":
        model.module.double()
    else:
        for p in model.module.parameters():
            p.data = p.data.double()
    outcomes = []
    for step in (1, 2):
        expected = _averaged(model.module, step)
        outcome = _outcome(lambda: _step(model, step, torch.float64, "cpu"))
        if outcome == "ok" and not _is_average(model.module, expected):
            outcome = "ok, but .grad is not the ranks' average (the gradients were not reduced)"
        outcomes.append(outcome)
    return outcomes


# --- register_comm_hook after training started ---------------------------------------------

def _hook(spec: str) -> tuple[object, object]:
    """A fresh (state, hook): the bf16 hook with error feedback (a fastddp built-in, which
    torch DDP runs as its pure-torch reference), or a Python hook."""
    if spec == "bf16_ef":
        return None, fastddp.hooks.bf16(error_feedback=True)
    return {"calls": []}, custom_hook


def hook_registered_late(spec: str, when: str) -> str:
    """torch DDP and fastddp train two steps with the default allreduce, register the same
    hook (`when`: "between_steps", or "before_backward": after step 2's forward), and train
    two more; grads compared bit for bit after every backward."""
    torch.manual_seed(0)
    base = mlp()
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=0.001)
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, fast)]
    for step in range(4):
        inputs, target = vector_batch(step)
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad()
            if step == 2 and when == "between_steps":
                model.register_comm_hook(*_hook(spec))
            loss = F.mse_loss(model(inputs), target)
            if step == 2 and when == "before_backward":
                model.register_comm_hook(*_hook(spec))
            loss.backward()
        agree(lambda: compare_grads_exact(ref.module, fast.module, f"step {step}", EXACT))
        for opt in opts:
            opt.step()
    return fast._reducer.hook_name


def hook_registered_during_backward() -> list[str]:
    """At step 1 a tensor hook on the first layer's weight (whose gradient comes last)
    registers a comm hook while the backward is reducing. Returns the outcomes of three
    steps; steps that run are compared with torch DDP without a hook (the refused step
    skipped by both)."""
    torch.manual_seed(0)
    base = mlp()
    ref = TorchDDP(copy.deepcopy(base))
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, fast)]
    outcomes = []
    for step in range(3):
        if step == 1:
            def register(grad: torch.Tensor) -> None:
                handle.remove()
                fast.register_comm_hook(None, fastddp.hooks.bf16())

            handle = fast.module[0].weight.register_hook(register)
        outcomes.append(_outcome(lambda: _step(fast, step)))
        if step == 1 or outcomes[-1] != "ok":
            continue
        _step(ref, step)
        agree(lambda: compare_grads(ref.module, fast.module, f"step {step}"))
        for opt in opts:
            opt.step()
    return outcomes


# --- gradients modified in place by user hooks ---------------------------------------------

def _double_grad(param: torch.Tensor) -> None:
    param.grad.mul_(2)


def _replace_grad(param: torch.Tensor) -> None:
    param.grad = param.grad * 2


def grads_modified_by_user_hook(where: str, gradient_as_bucket_view: bool) -> None:
    """Every parameter's gradient doubled by a user hook: a tensor hook scaling the incoming
    gradient in place ("tensor_hook"), or a post-accumulate-grad hook scaling param.grad in
    place ("post_accumulate") or replacing it ("post_accumulate_replace"). fastddp must
    reduce what torch DDP reduces, and that must be twice the ranks' average."""
    ref, fast = side_by_side(mlp, bucket_cap_mb=0.001,
                             gradient_as_bucket_view=gradient_as_bucket_view)
    for model in (ref, fast):
        for p in model.module.parameters():
            if where == "tensor_hook":
                p.register_hook(lambda g: g.mul_(2))
            else:
                p.register_post_accumulate_grad_hook(
                    _double_grad if where == "post_accumulate" else _replace_grad)
    plain = mlp()  # the same parameters, without the hooks
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, fast)]
    for step in range(2):
        plain.load_state_dict(fast.module.state_dict())
        expected = _averaged(plain, step)
        for model in (ref, fast):
            _step(model, step)
        agree(lambda: compare_grads(ref.module, fast.module, f"step {step}"))
        agree(lambda: _expect(_is_average(fast.module, expected, 2.0),
                              f"step {step}: .grad is not twice the ranks' average"))
        for opt in opts:
            opt.step()


# --- PowerSGD state across a change of world size ------------------------------------------

PSGD_ARGS = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}
# find_unused_parameters: torch never rebuilds the buckets, so torch's bucket-indexed state
# resumes onto the same layout (with a rebuild, its first resumed step applies the saved
# error to another parameter order; fastddp keeps state per parameter and resumes exactly).
PSGD_DDP = {"bucket_cap_mb": 25, "find_unused_parameters": True}


def _psgd_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> list[torch.Tensor]:
    return step_grads(model, opt, vector_batch(step))


def _psgd_pair(module: nn.Module, group: dist.ProcessGroup, ref_state: psgd.PowerSGDState,
               route: str, state: object) -> tuple:
    """torch DDP with torch's hook and `ref_state`, fastddp by `route` ("torch_state": torch's
    hook with the PowerSGDState `state`; "fastddp_state": fastddp.hooks.powersgd, then
    load_comm_hook_state_dict(state) unless it is None), with their optimizers."""
    ref = TorchDDP(copy.deepcopy(module), process_group=group, **PSGD_DDP)
    ref_state.process_group = group
    ref.register_comm_hook(ref_state, serialized_powerSGD_hook)
    fast = fastddp.DistributedDataParallel(copy.deepcopy(module), process_group=group,
                                           **PSGD_DDP)
    if route == "torch_state":
        state.process_group = group
        fast.register_comm_hook(state, psgd.powerSGD_hook)
    else:
        fast.register_comm_hook(None, fastddp.hooks.powersgd(**PSGD_ARGS))
        if state is not None:
            fast.load_comm_hook_state_dict(state)
    return ref, fast, [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, fast)]


def _train_psgd(ref, fast, opts, steps: range) -> None:
    """Side by side; fastddp takes torch's parameters after each step (float rounding of the
    two orthogonalizations must not compound)."""
    for step in steps:
        theirs, ours = _psgd_step(ref, opts[0], step), _psgd_step(fast, opts[1], step)
        # PowerSGD's rounding, relative to the largest gradient element (why:
        # powersgd_scenarios.TOL); on this MLP measured at most 2e-6 of it.
        for t, o in zip(theirs, ours):
            torch.testing.assert_close(o, t, rtol=1e-5, atol=5e-6 * float(t.abs().max()),
                                       msg=lambda m: f"step {step}: {m}")
        with torch.no_grad():
            for p, q in zip(ref.parameters(), fast.parameters()):
                q.copy_(p)


def powersgd_world_size_changed(target: int, route: str) -> list[int]:
    """An elastic restart at another world size: ranks 0 and 1 train 4 steps (2 compressed)
    over a 2-rank group; rank 0's checkpoint (model, torch's PowerSGDState, fastddp's state)
    is loaded by every rank of a `target`-rank group (the whole world; 1: each rank alone),
    which trains 3 more steps. fastddp against torch DDP resumed by torch's recipe, grads
    within float rounding at every step. Returns both states' iterations at the end."""
    rank, world = dist.get_rank(), dist.get_world_size()
    source = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in range(world)]
    blob = [b""]
    torch.manual_seed(0)
    module = mlp()

    def before_the_restart() -> None:
        if rank >= 2:
            return
        fast_state = psgd.PowerSGDState(None, **PSGD_ARGS) if route == "torch_state" else None
        ref_state = psgd.PowerSGDState(None, **PSGD_ARGS)
        ref, fast, opts = _psgd_pair(module, source, ref_state, route, fast_state)
        _train_psgd(ref, fast, opts, range(4))
        if rank == 0:
            buffer = io.BytesIO()
            torch.save({"model": unwrap(ref).state_dict(), "torch": ref_state,
                        "fastddp": fast_state if route == "torch_state"
                        else fast.comm_hook_state_dict()}, buffer)
            blob[0] = buffer.getvalue()

    agree(before_the_restart)  # on every rank: agree's collective is over the whole world
    dist.broadcast_object_list(blob, src=0)
    saved = torch.load(io.BytesIO(blob[0]), weights_only=False)
    module.load_state_dict(saved["model"])
    group = singles[rank] if target == 1 else dist.group.WORLD
    ref, fast, opts = _psgd_pair(module, group, saved["torch"], route, saved["fastddp"])
    agree(lambda: _train_psgd(ref, fast, opts, range(4, 7)))
    fast_iter = (saved["fastddp"].iter if route == "torch_state"
                 else fast.comm_hook_state_dict()["iter"])
    return [saved["torch"].iter, fast_iter]
