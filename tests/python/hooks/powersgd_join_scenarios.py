"""PowerSGD with uneven inputs under join(), run on every rank of a harness world: torch DDP
with torch's own powerSGD_hook against fastddp running it natively. The rank that runs out
of batches first joins; its hook goes on with zero buckets (torch runs the comm hook on
them), so its error feedback and warm-start Q keep moving and feed the others' averages."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.hooks.powersgd_scenarios import TOL
from tests.python.scenarios import mlp, vector_batch


def uneven_join(steps: int = 7, short_by: int = 3) -> dict:
    """Rank 0 trains `steps - short_by` batches, the others `steps`; one bucket (torch's
    powerSGD_hook issues its collectives from callbacks: one bucket keeps gloo's order)."""
    torch.manual_seed(0)
    base = mlp()
    ref, fast = TorchDDP(copy.deepcopy(base)), fastddp.DistributedDataParallel(copy.deepcopy(base))
    for model in (ref, fast):
        state = psgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                   min_compression_rate=1)
        model.register_comm_hook(state, psgd.powerSGD_hook)
    mine = steps - short_by if dist.get_rank() == 0 else steps
    for model in (ref, fast):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with model.join():
            for step in range(mine):
                inputs, target = vector_batch(step)
                opt.zero_grad(set_to_none=False)
                F.mse_loss(model(inputs), target).backward()
                opt.step()
    # PowerSGD's float32 rounding (powersgd_scenarios.TOL: the fused products against torch's
    # BLAS, amplified by orthogonalization and carried by error feedback), atol relative to
    # the parameter's largest magnitude.
    for (name, p), q in zip(ref.module.named_parameters(), fast.module.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=TOL["rtol"], atol=TOL["atol"] * p.abs().max().item(),
                                   msg=lambda m, n=name: f"rank {dist.get_rank()}: {n}: {m}")
    return {"steps": mine, "hook": fast._reducer.hook_name}
