"""What one finite step costs outside the collectives, as the reducer and its hooks count it
(Note [counted cost], csrc/util/step_cost.h), run on every rank of a harness world."""

import torch
import torch.nn.functional as F

import fastddp
from tests.python.ddp.overflow_scenarios import make_hook
from tests.python.scenarios import mlp, vector_batch

STEPS = 4  # PowerSGD and ACP-SGD (start 2) compress the last two


def step_cost(hook: str, gradient_as_bucket_view: bool = False, set_to_none: bool = False,
              keep_grads: bool = False) -> dict:
    """The last step's counts, the gradients' bytes and the state's (hook_state_bytes: the
    error feedback and PowerSGD's Qs, where the hook reports them). `set_to_none`: the
    optimizer's zero_grad as torch's default; `keep_grads`: last step's gradients are kept
    in a list across it (Note [gradients handed out])."""
    torch.manual_seed(0)
    model = fastddp.DistributedDataParallel(mlp(), bucket_cap_mb=0.004,
                                            gradient_as_bucket_view=gradient_as_bucket_view)
    if hook != "none":
        model.register_comm_hook(*make_hook(hook))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    for step in range(STEPS):
        inputs, target = vector_batch(step)
        if keep_grads:
            kept = [p.grad for p in model.parameters()]
        opt.zero_grad(set_to_none=set_to_none)
        F.mse_loss(model(inputs), target).backward()
        opt.step()
    stats = model.comm_stats()
    return {"cost": stats["step_cost"],
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "bucket_numels": [b["numel"] for b in stats["buckets"]]}
