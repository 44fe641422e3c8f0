"""Scenarios for test_api_surface.py: public torch DDP API items, each run under torch DDP
and under fastddp on the same rank with the same model and data, and compared.

Every comparison is bit for bit unless a comment says why not: with 2 ranks both
implementations run the same float ops in the same order (fastddp scales by 1/2 before
the sum, torch after it; halving a float is exact, so the order does not matter).
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.hooks import powersgd_scenarios
from tests.python.scenarios import agree, mlp, vector_batch, with_batchnorm

WRAPPERS = (TorchDDP, fastddp.DistributedDataParallel)
# The smallest normal float16; below it fp16 rounds to a fixed spacing of 2^-24.
FP16_TINY = 2.0**-14


def assert_bitwise(ref: nn.Module, fast: nn.Module, where: str, grads: bool = True) -> None:
    """State (parameters and buffers) and, with `grads`, gradients: bit for bit."""
    theirs, ours = ref.state_dict(), fast.state_dict()
    assert list(ours) == list(theirs), f"{where}: state_dict keys differ"
    pairs = [(f"{name}", theirs[name], ours[name]) for name in theirs]
    if grads:
        pairs += [(f"{n}.grad", p.grad, q.grad)
                  for (n, p), q in zip(ref.named_parameters(), fast.parameters(), strict=True)]
    for name, want, got in pairs:
        if want is None or got is None:
            assert want is None and got is None, f"{where}: {name} is None on one side only"
            continue
        same = (want == got) | (want.isnan() & got.isnan()) if want.is_floating_point() else (
            want == got)
        assert bool(same.all()), (f"{where}: {name}: {int((~same).sum())} of {want.numel()} "
                                  f"elements differ from torch DDP's")


def _both(build, **ddp_kwargs) -> list[nn.Module]:
    """torch DDP and fastddp around deep copies of one module built by `build()`."""
    base = build()
    return [wrap(copy.deepcopy(base), **ddp_kwargs) for wrap in WRAPPERS]


def _train_side_by_side(models: list[nn.Module], steps: int, batch=vector_batch,
                        loss_scale: float = 1.0) -> None:
    # A scaled loss scales the gradients; the learning rate takes the scale back out.
    opts = [torch.optim.SGD(m.parameters(), lr=0.05 / loss_scale, momentum=0.9) for m in models]
    for step in range(steps):
        inputs, target = batch(step)
        for model, opt in zip(models, opts):
            opt.zero_grad()
            (loss_scale * F.mse_loss(model(inputs), target)).backward()
        agree(lambda s=step: assert_bitwise(models[0].module, models[1].module, f"step {s}"))
        for opt in opts:
            opt.step()
    agree(lambda: assert_bitwise(models[0].module, models[1].module, "after training"))


def _rank0_copy(module: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0's state of `module` (a broadcast of clones: the module is left alone)."""
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for value in state.values():
        dist.broadcast(value, src=0)
    return state


def _equal_state(module: nn.Module, state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, state[k]) for k, v in module.state_dict().items())


# --- init_sync ----------------------------------------------------------------------

def init_sync(init_sync: bool) -> dict[str, list[bool]]:
    """Ranks start from different parameters and BatchNorm statistics. Returns, for torch
    DDP and fastddp, whether each kept its own start and whether it holds rank 0's; then
    both train 3 steps, bit for bit."""
    torch.manual_seed(dist.get_rank())
    base = with_batchnorm()
    with torch.no_grad():
        base[1].running_mean.add_(dist.get_rank() + 1)
    rank0 = _rank0_copy(base)
    models = [wrap(copy.deepcopy(base), init_sync=init_sync) for wrap in WRAPPERS]
    kept = [_equal_state(m.module, base.state_dict()) for m in models]
    got_rank0 = [_equal_state(m.module, rank0) for m in models]
    agree(lambda: assert_bitwise(models[0].module, models[1].module, "after construction",
                                 grads=False))
    _train_side_by_side(models, steps=3)
    return {"kept_own": kept, "holds_rank0": got_rank0}


# --- torch's built-in comm hook types -----------------------------------------------

def _local_grads(model: nn.Module) -> list[torch.Tensor]:
    """Collects each parameter's local gradient (before any reduction) at every backward."""
    seen: list[torch.Tensor] = []
    for p in model.parameters():
        p.register_hook(lambda g: seen.append(g.detach().clone()) or g)
    return seen


def _no_fp16_subnormal_halves(local: list[torch.Tensor]) -> None:
    """The data's precondition for comparing fp16 hooks bit for bit at 2 ranks: torch casts
    to fp16 and then halves, fastddp halves and then casts; that is the same number unless
    g / 2 is an fp16 subnormal, where rounding to a fixed spacing does not commute with
    halving. The loss scale of the fp16 scenarios keeps every nonzero |g| / 2 normal."""
    for g in local:
        halves = (g / 2).abs()
        tiny = ((halves > 0) & (halves < FP16_TINY)).sum().item()
        assert tiny == 0, f"{tiny} gradient halves are fp16 subnormals: raise the loss scale"


def builtin_hook(kind: str) -> dict:
    """`_register_builtin_comm_hook(dist.BuiltinCommHookType.<kind>)` on both; 3 steps bit
    for bit. Returns fastddp's hook name and both implementations' errors for a second
    registration (the first one counts)."""
    hook_type = getattr(dist.BuiltinCommHookType, kind)
    torch.manual_seed(0)
    models = _both(mlp)
    local = _local_grads(models[0].module)
    for model in models:
        model._register_builtin_comm_hook(hook_type)
    _train_side_by_side(models, steps=3, loss_scale=256.0)
    agree(lambda: _no_fp16_subnormal_halves(local))
    again = []
    for model in models:
        try:
            model.register_comm_hook(None, dh.allreduce_hook)
            again.append(None)
        except RuntimeError as e:
            again.append(str(e))
    return {"hook": models[1]._reducer.hook_name, "again": again}


# --- fastddp.hooks.native_torch_hooks() ---------------------------------------------

def _torch_hook(key: str, reference: bool) -> tuple[object, object]:
    """(state, hook) for a key of native_torch_hooks(). The reference side (torch DDP)
    runs torch's PowerSGD hooks serialized, as powersgd_scenarios explains (gloo pairs
    collectives by issue order; torch 2.14's batched hook needs _orthogonalize on 2-D)."""
    name = key.removeprefix("default_hooks.").removeprefix("powerSGD_hook.").split(" ")[0]
    if name.endswith("(allreduce_hook)"):
        return None, getattr(dh, name.removesuffix("(allreduce_hook)"))(dh.allreduce_hook)
    if name in ("powerSGD_hook", "batched_powerSGD_hook"):
        state = psgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        if reference:
            return state, getattr(powersgd_scenarios, f"serialized_{name}")
        return state, getattr(psgd, name)
    return None, getattr(dh, name)


def native_torch_hook(key: str, steps: int = 3) -> str:
    """torch's hook for `key` registered on torch DDP and on fastddp; grads compared after
    every backward: bit for bit, except PowerSGD (two plain steps, then one compressed step:
    see _close_to_powersgd). Returns the name of the hook fastddp's reducer runs."""
    powersgd = "powerSGD" in key
    torch.manual_seed(0)
    # PowerSGD: matrices worth compressing; the others: the MLP, whose data keeps every
    # fp16 half normal (see _no_fp16_subnormal_halves).
    models = _both(powersgd_scenarios.Mixed if powersgd else mlp, bucket_cap_mb=0.004)
    batch = powersgd_scenarios.batch if powersgd else vector_batch
    for model, reference in zip(models, (True, False)):
        model.register_comm_hook(*_torch_hook(key, reference))
    local = _local_grads(models[0].module)
    loss_scale = 256.0 if "fp16" in key else 1.0  # the largest gradient stays far below 65504
    opts = [torch.optim.SGD(m.parameters(), lr=0.05 / loss_scale) for m in models]
    for step in range(steps):
        inputs, target = batch(step)
        for model, opt in zip(models, opts):
            opt.zero_grad()
            (loss_scale * F.mse_loss(model(inputs), target)).backward()
        if powersgd:
            agree(lambda s=step: _close_to_powersgd(models, f"step {s}"))
            with torch.no_grad():  # rounding must not compound through the optimizer
                for p, q in zip(models[0].parameters(), models[1].parameters()):
                    q.copy_(p)
        else:
            agree(lambda s=step: assert_bitwise(models[0].module, models[1].module, f"step {s}"))
        for opt in opts:
            opt.step()
    if "fp16" in key:
        agree(lambda: _no_fp16_subnormal_halves(local))
    return models[1]._reducer.hook_name


def _close_to_powersgd(models: list[nn.Module], where: str) -> None:
    for (name, p), q in zip(models[0].module.named_parameters(), models[1].module.parameters()):
        # PowerSGD's P = M Q, Q = M^T P and the orthogonalization sum in another order in
        # C++ than in torch's Python (fused kernels accumulate in double): float32 rounding,
        # within 1e-5 of the tensor's largest gradient element.
        atol = 1e-5 * p.grad.abs().max().item()
        torch.testing.assert_close(q.grad, p.grad, rtol=0.0, atol=atol,
                                   msg=lambda m: f"{where}: grad of {name}: {m}")


# --- SyncBatchNorm ------------------------------------------------------------------

def sync_batchnorm() -> list[tuple[str, str] | None]:
    """A CPU module converted with nn.SyncBatchNorm.convert_sync_batchnorm: torch DDP
    refuses it at construction (SyncBatchNorm's forward needs a GPU to sync). Returns each
    wrapper's (exception type, message), None where it was accepted."""
    torch.manual_seed(0)
    outcome = []
    for wrap in WRAPPERS:
        module = nn.SyncBatchNorm.convert_sync_batchnorm(with_batchnorm())
        assert isinstance(module[1], nn.SyncBatchNorm)
        try:
            wrap(module)
            outcome.append(None)
        except Exception as e:  # noqa: BLE001 - the type is the result
            outcome.append((type(e).__name__, str(e)))
    return outcome


# --- join(throw_on_early_termination=True) ------------------------------------------

def join_throw() -> list[str | None]:
    """Rank r has 2 + r batches. Returns, for torch DDP and fastddp, what their join(...,
    throw_on_early_termination=True) raised on this rank; the steps before agree bit for bit
    and the process group is usable afterwards."""
    torch.manual_seed(0)
    models = _both(mlp)
    raised = []
    for model in models:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        try:
            with model.join(throw_on_early_termination=True):
                for step in range(2 + dist.get_rank()):
                    inputs, target = vector_batch(step)
                    opt.zero_grad()
                    F.mse_loss(model(inputs), target).backward()
                    opt.step()
            raised.append(None)
        except RuntimeError as e:
            raised.append(str(e))
        dist.barrier()  # no collective was left pending by the early termination
    agree(lambda: assert_bitwise(models[0].module, models[1].module, "after the throw"))
    return raised


# --- Join with another Joinable -----------------------------------------------------

def join_with_zero() -> int:
    """Join([ddp, ZeroRedundancyOptimizer]) with rank r having 2 + 2r batches: the same
    parameters as torch DDP under the same Join, bit for bit. Returns the batches run."""
    torch.manual_seed(0)
    models = _both(mlp)
    batches = 2 + 2 * dist.get_rank()
    for model in models:
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                       lr=0.05, momentum=0.9)
        # DDP first, as torch documents: with the optimizer first, torch DDP's own run
        # aborts in gloo (EnforceNotMet) on torch 2.14, and so does fastddp's.
        with Join([model, zero]):
            for step in range(batches):
                inputs, target = vector_batch(step)
                zero.zero_grad()
                F.mse_loss(model(inputs), target).backward()
                zero.step()
    agree(lambda: assert_bitwise(models[0].module, models[1].module, "after join", grads=False))
    return batches


# --- _ddp_params_and_buffers_to_ignore ----------------------------------------------

IGNORED = ["0.bias", "1.running_mean"]


def _same_on_all_ranks(tensors: dict[str, torch.Tensor]) -> dict[str, bool]:
    same = {}
    for name, value in tensors.items():
        gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, value.contiguous())
        same[name] = all(torch.equal(g, gathered[0]) for g in gathered)
    return same


def ignored_params() -> dict[str, dict[str, bool]]:
    """`0.bias` and BatchNorm's `1.running_mean` ignored (torch's
    _set_params_and_buffers_to_ignore_for_model), different on every rank, as is the
    running_var, which is not ignored; 3 steps, bit for bit with torch DDP. Returns whether
    fastddp's state after construction and its last gradients are the same on all ranks."""
    torch.manual_seed(0)
    base = with_batchnorm()
    with torch.no_grad():
        for value in (base[0].bias, base[1].running_mean, base[1].running_var):
            value.add_(dist.get_rank())
    models = []
    for wrap in WRAPPERS:
        module = copy.deepcopy(base)
        TorchDDP._set_params_and_buffers_to_ignore_for_model(module, IGNORED)
        models.append(wrap(module))
    constructed = _same_on_all_ranks(models[1].module.state_dict())
    _train_side_by_side(models, steps=3)
    grads = _same_on_all_ranks({n: p.grad for n, p in models[1].module.named_parameters()})
    return {"constructed": constructed, "grads": grads}


# --- _set_ddp_sink_clone ------------------------------------------------------------

def sink_clone(clone: bool, mode: str) -> list[dict]:
    """torch's _DDPSink passes the outputs through an autograd Function when outputs are
    tracked (find_unused_parameters=True, or the first iteration of a static graph); with
    _set_ddp_sink_clone(True) (the default) it returns clones, with False the outputs
    themselves, which then may not be modified in place. Per wrapper and iteration: whether
    the output shares the module output's storage, and what an in-place add then raised."""
    kwargs = {"find_unused_parameters": True} if mode == "find_unused" else {"static_graph": True}
    torch.manual_seed(0)
    models = _both(mlp, **kwargs)
    seen = []
    results = []
    for model in models:
        model._set_ddp_sink_clone(clone)
        model.module.register_forward_hook(lambda mod, inputs, out: seen.append(out))
        rows = []
        for step in range(2):
            inputs, target = vector_batch(step)
            model.zero_grad()
            out = model(inputs)
            row = {"shares": out.untyped_storage().data_ptr()
                   == seen[-1].untyped_storage().data_ptr()}
            try:
                out.add_(0.0)  # adds nothing: the numbers stay comparable
                row["in_place"] = None
            except RuntimeError as e:
                row["in_place"] = "is a view and is being modified inplace" in str(e)
            F.mse_loss(out, target).backward()
            rows.append(row)
        results.append(rows)
    agree(lambda: assert_bitwise(models[0].module, models[1].module, "after 2 iterations"))
    return results



# --- fastddp.launch.demo (make run) -------------------------------------------------

def demo_training(steps: int, batch: int, hidden: int, rounds: int) -> dict[str, list[float]]:
    """fastddp.launch.demo's two runs, as its main() sets them up on CPU, taking turns as there:
    the trained models must be bit for bit equal (checked here, not by the demo's own
    comparison). Returns both runs' losses (averaged over the ranks, as the demo logs)."""
    from fastddp.launch import demo

    torch.manual_seed(0)
    init_state = {k: v.clone() for k, v in demo.mlp(hidden).state_dict().items()}
    batches = demo.make_batches(steps, batch, dist.get_rank(), torch.device("cpu"))
    runs = [demo.Run(wrap, init_state, hidden, torch.device("cpu"), wrap.__name__, False)
            for wrap in WRAPPERS]
    demo.interleaved((runs[1], runs[0]), batches, rounds, warmup=min(5, steps - 1))
    agree(lambda: assert_bitwise(runs[0].model, runs[1].model, "after the demo's training"))
    return {"torch": runs[0].losses, "fastddp": runs[1].losses}
