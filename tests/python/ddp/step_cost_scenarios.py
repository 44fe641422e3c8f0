"""What one finite step costs outside the collectives, as the reducer and its hooks count it
(Note [counted cost], csrc/util/step_cost.h), run on every rank of a harness world."""

import torch
import torch.nn.functional as F

import fastddp
from tests.python.ddp.overflow_scenarios import make_hook
from tests.python.scenarios import mlp, vector_batch

STEPS = 4  # PowerSGD and ACP-SGD (start 2) compress the last two


def step_cost(hook: str, gradient_as_bucket_view: bool = False) -> dict:
    """The last step's counts, the gradients' bytes and the state's (hook_state_bytes: the
    error feedback and PowerSGD's Qs, where the hook reports them)."""
    torch.manual_seed(0)
    model = fastddp.DistributedDataParallel(mlp(), bucket_cap_mb=0.004,
                                            gradient_as_bucket_view=gradient_as_bucket_view)
    if hook != "none":
        model.register_comm_hook(*make_hook(hook))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        inputs, target = vector_batch(step)
        opt.zero_grad(set_to_none=False)
        F.mse_loss(model(inputs), target).backward()
        opt.step()
    stats = model.comm_stats()
    return {"cost": stats["step_cost"],
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "bucket_numels": [b["numel"] for b in stats["buckets"]]}
