"""The overlapped optimizer's native step (csrc/optim/fused_step.h, Note [fused step, as
torch's]): when it applies, the hyperparameters it reads before each backward, and the
optimizer state it steps, made exactly as torch's ``_init_group`` makes it."""

from __future__ import annotations

from typing import Any

import torch

from fastddp import _C

try:  # torch's dtype for a fused optimizer's step counter
    from torch.optim.optimizer import _get_scalar_dtype
except ImportError:  # pragma: no cover - every supported torch has it
    def _get_scalar_dtype(is_fused: bool | None = None) -> torch.dtype:
        return torch.float32


def kind_of(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> str | None:
    """"sgd" or "adam" where the native step gives the optimizer's own numbers: exactly
    torch's SGD, Adam or AdamW with fused=True in every group, float hyperparameters, not
    differentiable, every parameter a real one of ``params`` (the model's); else None (the
    optimizer's own step() runs, per bucket)."""
    if type(optimizer) is torch.optim.SGD:
        kind = "sgd"
    elif type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        kind = "adam"
    else:
        return None
    in_model = {id(p) for p in params}
    for group in optimizer.param_groups:
        if not group.get("fused") or group.get("differentiable"):
            return None
        scalars = [group["lr"], *group.get("betas", ())]
        if any(isinstance(x, torch.Tensor) for x in scalars):
            return None
        if any(id(p) not in in_model or p.is_complex() for p in group["params"]):
            return None
    return kind


def hyperparameters(kind: str, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Every param group's, as FusedStep.set_groups takes them."""
    groups = []
    for g in optimizer.param_groups:
        h = {"lr": g["lr"], "weight_decay": g["weight_decay"], "maximize": g["maximize"],
             "momentum": 0.0, "dampening": 0.0, "nesterov": False, "beta1": 0.0, "beta2": 0.0,
             "eps": 0.0, "amsgrad": False, "decoupled_weight_decay": False}
        if kind == "sgd":
            h.update(momentum=g["momentum"], dampening=g["dampening"], nesterov=g["nesterov"])
        else:  # AdamW is Adam with decoupled_weight_decay from torch 2.6 on; a class before
            h.update(beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                     amsgrad=g["amsgrad"], decoupled_weight_decay=g.get(
                         "decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
        groups.append(h)
    return groups


def build(kind: str, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Any:
    """A native FusedStep over the reducer's ``params``."""
    group_index = {id(p): g for g, group in enumerate(optimizer.param_groups)
                   for p in group["params"]}
    group_of = [group_index.get(id(p), -1) for p in params]

    def init_state(indices: list[int]) -> tuple[list[list[torch.Tensor]], list[bool]]:
        # Called from C++ on a parameter's first overlapped step (its .grad is written).
        states, fresh = [], []
        for i in indices:
            p = params[i]
            tensors, made = _state(kind, optimizer.state, optimizer.param_groups[group_of[i]], p)
            states.append(tensors)
            fresh.append(made)
        return states, fresh

    step = _C.FusedStep(kind, params, group_of, init_state)
    step.set_groups(hyperparameters(kind, optimizer))
    return step


def _state(kind: str, states: dict, group: dict,
           p: torch.Tensor) -> tuple[list[torch.Tensor], bool]:
    """The tensors a fused step updates, made as torch's SGD / Adam ``_init_group`` makes
    them for fused=True where the parameter has none yet; and whether a momentum buffer
    was just made (the kernel's first step fills it)."""
    if kind == "sgd" and group["momentum"] == 0:
        return [], False  # torch's SGD keeps no state then (not even an empty entry)
    state = states[p]
    if kind == "sgd":
        made = state.get("momentum_buffer") is None
        if made:  # torch's _fused_sgd: empty_like the gradient
            state["momentum_buffer"] = torch.empty_like(p.grad)
        return [state["momentum_buffer"]], made
    if not state:
        state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=True), device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    names = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
    return [state[n] for n in names], False
