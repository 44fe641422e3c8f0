"""torch's own PowerSGD hooks registered with a PowerSGDState, the article's path, on any
device: fastddp (which runs them natively) against torch DDP running them, from the same
weights on the same batches. Registering the state once crashed the first GPU machine
(csrc/util/message.h, Note [no streams in _C]); so did loading a saved state.

Scenarios for a harness world: gloo on the CPU in `make test`, NCCL on CUDA under -m gpu.
"""

import copy
import io

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.hooks.powersgd_scenarios import (_differs_from_plain_mean,
                                                   serialized_batched_powerSGD_hook,
                                                   serialized_powerSGD_hook)
from tests.python.scenarios import mlp, vector_batch

# fastddp fuses the orthogonalization and the low-rank products, which round differently
# in float32 from torch's separate ops; the bound is absolute, relative to the parameter's
# largest gradient element (why: powersgd_scenarios.TOL). This MLP's matrices are small
# and well conditioned: measured at most 1.3e-6 of that scale over 3 compressed steps and a
# resume (gloo, 2 and 3 ranks).
TOL = {"rtol": 1e-5, "atol": 5e-6}
STATE = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}


def _pair(device: str, batched: bool):
    """(fastddp model, torch DDP model, their PowerSGDStates), from one set of weights. torch's
    side runs torch's hook serialized (waited for per bucket: gloo pairs collectives by issue
    order) and, when batched, with its 2-D _orthogonalize fixed: no number changes."""
    torch.manual_seed(0)
    base = mlp().to(device)
    ids = [torch.device(device).index or 0] if device != "cpu" else None
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), device_ids=ids)
    ref = TorchDDP(copy.deepcopy(base), device_ids=ids)
    states = (psgd.PowerSGDState(None, **STATE), psgd.PowerSGDState(None, **STATE))
    fast.register_comm_hook(states[0], psgd.batched_powerSGD_hook if batched
                            else psgd.powerSGD_hook)
    ref.register_comm_hook(states[1], serialized_batched_powerSGD_hook if batched
                           else serialized_powerSGD_hook)
    return fast, ref, states


def _step(fast, ref, step: int, device: str) -> bool:
    """One backward of both on the same batch; grads compared, then both take the same SGD
    step from fastddp's parameters. Whether compression ran (grads off the plain mean)."""
    inputs, target = vector_batch(step, device=device)
    for model in (fast, ref):
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(inputs), target).backward()
    for (name, a), b in zip(fast.module.named_parameters(), ref.module.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=TOL["rtol"],
                                   atol=TOL["atol"] * b.grad.abs().max().item(),
                                   msg=f"step {step}: {name}")
    compressed = _differs_from_plain_mean(ref.module, fast, inputs, target)
    with torch.no_grad():
        for a, b in zip(fast.module.parameters(), ref.module.parameters()):
            a.sub_(0.1 * a.grad)
            b.copy_(a)
    return compressed


def torch_hook_with_state(device: str = "cpu", batched: bool = False, steps: int = 5) -> int:
    """Five steps (two plain, three compressed) matching torch DDP; returns how many steps
    were compressed."""
    fast, ref, _ = _pair(device, batched)
    return sum(_step(fast, ref, step, device) for step in range(steps))


def _roundtrip(state: psgd.PowerSGDState) -> psgd.PowerSGDState:
    """torch's checkpoint recipe: the state pickled with torch.save (its __getstate__ drops
    the process group), loaded, given the group back."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded.process_group = None
    return loaded


def save_and_load_state(device: str = "cpu", batched: bool = False) -> int:
    """fastddp: three steps, its state saved and loaded into a fresh model of the current
    weights, three more steps; they match torch DDP's six uninterrupted steps. (Not torch
    DDP resumed the same way: measured on 2 gloo ranks, its first step after the resume is
    4.5e-2 away from its own uninterrupted run; the uninterrupted run is what a checkpoint
    promises.) Returns the compressed steps."""
    fast, ref, states = _pair(device, batched)
    compressed = sum(_step(fast, ref, step, device) for step in range(3))
    ids = [torch.device(device).index or 0] if device != "cpu" else None
    resumed = fastddp.DistributedDataParallel(copy.deepcopy(fast.module), device_ids=ids)
    resumed.register_comm_hook(_roundtrip(states[0]), psgd.batched_powerSGD_hook if batched
                               else psgd.powerSGD_hook)
    return compressed + sum(_step(resumed, ref, step, device) for step in range(3, 6))
