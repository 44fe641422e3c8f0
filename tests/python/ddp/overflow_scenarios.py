"""One overflow step under torch.amp.GradScaler leaves no trace in a hook's state (Note [a bad
step leaves no trace] in csrc/reducer/finite_checks.h).

The reference is torch's own definition of a skipped step: GradScaler skips the optimizer
step of an iteration whose gradients overflowed and halves its scale. So the same training
in which that iteration never ran (no forward, no backward; the scale halved by hand, as
the scaler would have) must end with the same parameters, bit for bit: the overflow step
may change nothing but the scale. Without the state's restore, error feedback and PowerSGD
keep the NaN and every later step overflows too.

Scenarios for a harness world (gloo; hierarchical hooks on 4 ranks as 2 x 2)."""

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import fastddp
from fastddp import _C
from tests.python.scenarios import vector_batch

BAD_STEP = 4  # after PowerSGD's start (2): its memories exist and are used
INIT_SCALE = 2.0 ** 12


def make_hook(name: str):
    """(state, hook) to register, by name."""
    h = fastddp.hooks
    made = {
        "allreduce": h.allreduce,
        "bf16": h.bf16,
        "fp16": h.fp16,
        "bf16_fp32": lambda: h.bf16(accumulate="fp32"),
        "bf16_ef": lambda: h.bf16(error_feedback=True),
        "fp16_ef": lambda: h.fp16(error_feedback=True),
        "bf16_fp32_ef": lambda: h.bf16(accumulate="fp32", error_feedback=True),
        "int8": lambda: h.int8(),
        "fp8_e4m3": lambda: h.fp8("e4m3"),
        "fp8_e5m2": lambda: h.fp8("e5m2"),
        "powersgd": lambda: h.powersgd(2, start_powerSGD_iter=2),
        "batched_powersgd": lambda: h.batched_powersgd(2, start_powerSGD_iter=2),
        "acpsgd": lambda: h.acpsgd(2, start_iter=2),
        "hier_int8": lambda: h.hierarchical(h.int8(), local_size=2),
        "hier_allreduce": lambda: h.hierarchical(h.allreduce(), local_size=2),
        "hier_bf16": lambda: h.hierarchical(h.bf16(), local_size=2),
        "hier_bf16_ef": lambda: h.hierarchical(h.bf16(error_feedback=True), local_size=2),
        "hier_powersgd": lambda: h.hierarchical(h.powersgd(2, start_powerSGD_iter=2),
                                                local_size=2),
    }
    if name == "torch_powersgd":  # torch's own, through torch's API (run natively)
        return psgd.PowerSGDState(None, matrix_approximation_rank=2,
                                  start_powerSGD_iter=2), psgd.powerSGD_hook
    return None, made[name]()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _wrap(module: nn.Module, hook: str, device: str = "cpu") -> fastddp.DistributedDataParallel:
    # About one bucket per layer: the bad step can be put in the first or the last.
    ids = [torch.device(device).index or 0] if device != "cpu" else None
    model = fastddp.DistributedDataParallel(module.to(device), bucket_cap_mb=0.002,
                                            device_ids=ids)
    model.register_comm_hook(*make_hook(hook))
    return model


def _inject(model, where: str, ranks: str):
    """A tensor hook that makes this rank's gradient of one parameter infinite at BAD_STEP:
    in the bucket reduced first or last, or every parameter (where="all"). Returns a
    function of the step that arms it."""
    mine = ranks == "all" or dist.get_rank() == dist.get_world_size() - 1
    plan = model.bucket_plan()
    names = {"first": plan[0][:1], "last": plan[-1][:1]}.get(where, sum(plan, []))
    armed = {"on": False}
    params = dict(model.module.named_parameters())
    for name in names:
        params[name].register_hook(lambda g: g * float("inf") if armed["on"] else g)

    def arm(step: int) -> None:
        armed["on"] = mine and step == BAD_STEP
    return arm


def scaler_run(hook: str, where: str = "all", ranks: str = "one", steps: int = 9,
               device: str = "cpu") -> dict:
    """A GradScaler run with one overflow at BAD_STEP against the same run without that
    iteration. Returns whether the parameters are equal bit for bit, the steps the scaler
    took after the bad one, and the final scales. On CUDA the forward runs under float16
    autocast, as fp16 training does."""
    autocast = (torch.autocast("cuda", dtype=torch.float16) if device != "cpu"
                else contextlib.nullcontext())
    base = _model()
    runs = {}
    for kind in ("overflow", "skipped"):
        model = _wrap(copy.deepcopy(base), hook, device)
        arm = _inject(model, where, ranks) if kind == "overflow" else (lambda step: None)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=INIT_SCALE)
        taken = []
        for step in range(steps):
            if kind == "skipped" and step == BAD_STEP:
                scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
                continue
            arm(step)
            inputs, target = vector_batch(step, device=device)
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = F.mse_loss(model(inputs).float(), target)
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            taken.append(scaler.get_scale() >= before)  # halved: the step was skipped
        runs[kind] = (model, taken, scaler.get_scale())
    (fast, taken, scale), (ref, ref_taken, ref_scale) = runs["overflow"], runs["skipped"]
    return {"equal": all(torch.equal(a, b) for a, b in zip(fast.parameters(),
                                                            ref.parameters())),
            "taken_after": taken[BAD_STEP + 1:], "scales": (scale, ref_scale),
            "finite": all(bool(p.isfinite().all()) for p in fast.parameters())}


def scaler_run_settled_as_on_device(**kwargs) -> dict:
    """scaler_run with double-buffered hook state settled as on a GPU (the host swaps in
    every step's state, and a put-back keyed on the step's flag restores the old one: Note
    [double-buffered step state]), so that path is tested where there is no GPU."""
    _C._settle_as_on_device(True)
    try:
        return scaler_run(**kwargs)
    finally:
        _C._settle_as_on_device(False)


def long_run(hook: str, steps: int = 200, every: int = 5) -> dict:
    """Overflows on rank 0 every `every`-th step for `steps` steps, against the same training
    in which those iterations never ran (the scale halved by hand, as scaler_run) and against
    the run without any: whether the first two end with equal parameters, bit for bit, and
    the three final losses (over the 16 batches trained on, averaged over the ranks) with
    the loss before training."""
    base = _model()

    def training_loss(module: nn.Module) -> float:
        """The mean loss over the 16 batches trained on, averaged over the ranks."""
        with torch.no_grad():
            loss = torch.stack([F.mse_loss(module(x), y) for x, y in map(vector_batch, range(16))])
        loss = loss.mean().reshape(1)
        dist.all_reduce(loss)
        return loss.item() / dist.get_world_size()

    out = {"start": training_loss(base)}
    models = {}
    for kind in ("overflows", "skipped", "clean"):
        model = _wrap(copy.deepcopy(base), hook)
        bad = {"on": False}
        for p in model.module.parameters():
            p.register_hook(lambda g: g * float("inf") if bad["on"] else g)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        # growth_interval=4: the scale doubles after the 4 good steps between two injected
        # overflows and halves at the next, so it stays put (injected overflows do not
        # come from a too-large scale; with the default 2000 it would fall 40 times).
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=4)
        for step in range(steps):
            overflow_step = step % every == every - 1
            if kind == "skipped" and overflow_step:
                scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
                continue
            bad["on"] = kind == "overflows" and overflow_step and dist.get_rank() == 0
            inputs, target = vector_batch(step % 16)
            opt.zero_grad(set_to_none=True)
            scaler.scale(F.mse_loss(model(inputs), target)).backward()
            scaler.step(opt)
            scaler.update()
        out[kind] = training_loss(model.module)
        models[kind] = model
    out["equal"] = all(torch.equal(a, b) for a, b in zip(models["overflows"].parameters(),
                                                          models["skipped"].parameters()))
    return out


def auto_run(overflow_at: int | None, steps: int = 12) -> dict:
    """fastddp.hooks.auto tuning under GradScaler, with one overflow (every parameter, last
    rank) at `overflow_at` or none: the step of auto's first switch (a trial or its choice,
    a step count that timing does not change), the steps the scaler took, finiteness."""
    model = fastddp.DistributedDataParallel(_model())
    model.register_comm_hook(None, fastddp.hooks.auto("any", warmup=1, samples=3,
                                                      verbose=False))
    bad = {"on": False}
    for p in model.module.parameters():
        p.register_hook(lambda g: g * float("inf") if bad["on"] else g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    taken = []
    for step in range(steps):
        bad["on"] = step == overflow_at and dist.get_rank() == dist.get_world_size() - 1
        inputs, target = vector_batch(step)
        opt.zero_grad(set_to_none=True)
        scaler.scale(F.mse_loss(model(inputs), target)).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        taken.append(scaler.get_scale() >= before)
    summary = model.auto_choice()
    # history[0] is the installation at step 0; the next entry is the first switch.
    return {"first_switch": summary["history"][1][0] if len(summary["history"]) > 1 else None,
            "history": summary["history"],
            "taken": taken,
            "finite": all(bool(p.isfinite().all()) for p in model.parameters())}
