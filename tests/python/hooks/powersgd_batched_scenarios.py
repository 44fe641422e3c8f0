"""Batched PowerSGD scenarios beyond powersgd_training(batched=True): the native hook's
statistics and checkpoint against torch's uninterrupted batched_powerSGD_hook."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.hooks.hooks_scenarios import compare_grads
from tests.python.hooks.powersgd_scenarios import (BATCHED_TOL, Mixed, batch,
                                                   serialized_batched_powerSGD_hook)
from tests.python.scenarios import agree, unwrap

# Relative to each parameter's largest gradient element (compare_grads), as
# powersgd_scenarios.TOL explains: BATCHED_TOL (measured here at most 1.1e-5, 3.8e-6 beyond
# rtol 1e-5).
TOL = BATCHED_TOL


def _native(state_args: dict) -> "fastddp._C.BatchedPowerSGDHook":
    return fastddp.hooks.batched_powersgd(**state_args).native(dist.group.WORLD)


def checkpoint_resume(steps: int = 7, split: int = 4, bucket_cap_mb: float = 0.004,
                      load: bool = True, **state_args) -> dict:
    """fastddp with the native hook for `split` steps, then a new hook that loads the first
    one's state_dict, against torch's one uninterrupted run: the grads of every step, and the
    compression statistics, must be torch's. The new hook goes on the same model: batched
    PowerSGD's numbers depend on the bucket layout (a bucket is one matrix), and a new model
    would run its first step in the initial layout, where torch's run has the rebuilt one."""
    torch.manual_seed(0)
    base = Mixed()
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
    ref_state = psgd.PowerSGDState(None, **state_args)
    ref.register_comm_hook(ref_state, serialized_batched_powerSGD_hook)
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
    hook = _native(state_args)
    fast._reducer.set_comm_hook(hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, fast)]
    saved = None
    reports = []
    for step in range(steps):
        if step == split:
            reports += hook.take_stats_reports()
            saved = hook.state_dict()
            hook = _native(state_args)  # a fresh generator, iteration and state
            if load:  # False: the check must catch a hook that starts afresh
                hook.load_state_dict(saved)
            fast._reducer.set_comm_hook(hook)
        inputs, target = batch(step)
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad()
            F.mse_loss(model(inputs), target).backward()
        agree(lambda s=step: compare_grads(unwrap(ref), unwrap(fast), f"step {s}", TOL))
        for opt in opts:
            opt.step()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), fast.parameters()):
                q.copy_(p)
    return {"saved_keys": sorted(saved), "bucket_qs": len(saved.get("bucket_qs", {})),
            "errors": len(saved["errors"]), "iter": hook.iter,
            "native_stats": hook.compression_stats(),
            "torch_stats": list(ref_state.compression_stats()),
            "reports": reports + hook.take_stats_reports(),
            "last_step_bytes": hook.last_step_bytes()}
