"""ParameterShardedOptimizer (fastddp.optim.by_parameter) against torch DDP + the same torch
optimizer, unsharded, and torch's ZeroRedundancyOptimizer over torch DDP, from one set of
weights on the same batches; whole-tensor optimizers included. Scenarios for a harness world
(2 and 3 gloo ranks)."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp.optim import ParameterShardedOptimizer
from tests.python.optim.sharded_scenarios import CAP_MB
from tests.python.scenarios import mlp, vector_batch

# Whole-tensor optimizers (Adafactor factors a matrix's second moment into its row and
# column means; Adagrad is elementwise, as a control) and one elementwise with momentum.
OPTIMIZERS = {
    "adafactor": (torch.optim.Adafactor, {"lr": 0.01}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


def train(optimizer: str = "adafactor", steps: int = 10, clip: bool = False) -> dict:
    cls, kwargs = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    first = mlp()
    fast = fastddp.DistributedDataParallel(copy.deepcopy(first), bucket_cap_mb=CAP_MB)
    ref = TorchDDP(copy.deepcopy(first), bucket_cap_mb=CAP_MB)
    zero = TorchDDP(copy.deepcopy(first), bucket_cap_mb=CAP_MB)
    fast_opt = ParameterShardedOptimizer(fast, cls, **kwargs)
    ref_opt = cls(ref.parameters(), **kwargs)
    zero_opt = ZeroRedundancyOptimizer(zero.parameters(), optimizer_class=cls, **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)  # GradScaler on the fast one
    for step in range(steps):
        inputs, target = vector_batch(step)
        for model, opt in ((fast, fast_opt), (ref, ref_opt), (zero, zero_opt)):
            opt.zero_grad()
            loss = F.mse_loss(model(inputs), target)
            if model is fast:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)  # the ordinary .grad: GradScaler's own unscale
            else:
                loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            if model is fast:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
    fast_p = [p.detach() for p in fast.module.parameters()]
    whole = sum(t.numel() * t.element_size() for s in ref_opt.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    mine = fast_opt.shard_state_bytes()
    shares = [torch.tensor([mine]) for _ in range(dist.get_world_size())]
    dist.all_gather(shares, torch.tensor([mine]))
    zero_mine = sum(t.numel() * t.element_size() for s in zero_opt.optim.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return {
        "diff_ref": max((a - b).abs().max().item()
                        for a, b in zip(fast_p, ref.module.parameters())),
        "diff_zero": max((a - b).abs().max().item()
                         for a, b in zip(fast_p, zero.module.parameters())),
        "moved": all(not torch.equal(a, b) for a, b in zip(fast_p, first.parameters())),
        "state_bytes": mine, "zero_state_bytes": zero_mine, "whole_state_bytes": whole,
        "shares_sum": int(sum(int(t) for t in shares)),
    }


def state_dict_round_trip(optimizer: str = "adafactor", steps: int = 4) -> dict:
    """consolidate_state_dict() on rank 0 is the unsharded optimizer's state_dict(), and a
    whole state loaded on every rank steps on as the unsharded optimizer does."""
    cls, kwargs = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    first = mlp()
    fast = fastddp.DistributedDataParallel(copy.deepcopy(first), bucket_cap_mb=CAP_MB)
    ref = TorchDDP(copy.deepcopy(first), bucket_cap_mb=CAP_MB)
    fast_opt = ParameterShardedOptimizer(fast, cls, **kwargs)
    ref_opt = cls(ref.parameters(), **kwargs)

    def step(n: int) -> None:
        inputs, target = vector_batch(n)
        for model, opt in ((fast, fast_opt), (ref, ref_opt)):
            opt.zero_grad()
            F.mse_loss(model(inputs), target).backward()
            opt.step()

    for n in range(steps):
        step(n)
    fast_opt.consolidate_state_dict(to=0)
    saved = fast_opt.state_dict() if dist.get_rank() == 0 else None
    same = True
    if saved is not None:
        want = ref_opt.state_dict()
        same = (saved["param_groups"] == want["param_groups"]
                and sorted(saved["state"]) == sorted(want["state"])
                and all(torch.equal(torch.as_tensor(saved["state"][i][k]),
                                    torch.as_tensor(want["state"][i][k]))
                        for i in want["state"] for k in want["state"][i]))
    # a fresh sharded optimizer takes the unsharded one's whole state, then steps alike
    fresh = ParameterShardedOptimizer(fast, cls, **kwargs)
    # A copy: torch's state_dict() hands out its live state tensors, and load_state_dict
    # keeps tensors already of the right dtype and device (two optimizers would share them).
    fresh.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    fast_opt = fresh
    step(steps)
    diff = max((a - b).abs().max().item()
               for a, b in zip(fast.module.parameters(), ref.module.parameters()))
    return {"consolidated_equal": same, "diff_after_load": diff}


def refusals() -> dict:
    found = {}
    for name, build in {
        "lbfgs": lambda: ParameterShardedOptimizer(fastddp.DistributedDataParallel(mlp()),
                                                   torch.optim.LBFGS),
        "state_dict_first": lambda: ParameterShardedOptimizer(
            fastddp.DistributedDataParallel(mlp()), torch.optim.Adagrad).state_dict(),
        "a_foreign_parameter": lambda: ParameterShardedOptimizer(
            fastddp.DistributedDataParallel(mlp()), torch.optim.Adagrad,
            [torch.nn.Parameter(torch.zeros(3))]),
    }.items():
        try:
            build()
            found[name] = None
        except (NotImplementedError, RuntimeError, ValueError) as e:
            found[name] = f"{type(e).__name__}: {e}"
    return found
