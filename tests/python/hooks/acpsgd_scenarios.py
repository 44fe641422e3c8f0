"""ACP-SGD (fastddp.hooks.acpsgd) against the algorithm written out with torch ops, on every
rank of a harness world.

The reference follows the authors' acpsgd.py (github.com/lzhangbv/powersgd): per matrix, on
M = gradient + error, even steps send P = M orth(Q) and odd steps Q = M^T orth(P), the other
factor kept from the step before; error = M - P Q^T with this rank's factor; the gradient is
(reduced P or Q) times the other factor, over the world size. The reference reduces with
torch.distributed.all_reduce, one tensor at a time, orthogonalizes with torch's own PowerSGD
_orthogonalize, and chooses the matrices and draws the first Q as torch's PowerSGD does
(fastddp's acpsgd shares those rules with its powersgd hook). Only the bucket layout is read
from fastddp (model.bucket_plan()): the draw of the first Q is one generator per bucket.
"""

import copy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.profiler import ProfilerActivity, profile

import fastddp
from tests.python.hooks.hooks_scenarios import compare_grads
from tests.python.hooks.powersgd_scenarios import TOL, Mixed, batch
from tests.python.scenarios import agree

# Why TOL (powersgd_scenarios.py) bounds ACP-SGD too: the same roundings. fastddp's fused
# products and orthogonalization against torch's BLAS and Householder QR, amplified by
# orthogonalizing and carried on by the error feedback and both kept factors; and here
# also the sum order (one fused buffer per bucket against a tensor at a time), which on 3
# gloo ranks rounds each reduced factor differently in the last bit.


class Reference:
    """The algorithm, per parameter, from the local gradients of an undistributed replica."""

    def __init__(self, model: torch.nn.Module, buckets, rank: int, start: int,
                 rate: float = 2.0, seed: int = 0):
        self.params = dict(model.named_parameters())
        self.buckets, self.rank, self.start, self.rate = buckets, rank, start, rate
        self.rng = np.random.RandomState(seed)
        self.error: dict[str, torch.Tensor] = {}
        self.p: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self.step = 0

    def shape(self, name: str) -> tuple[int, int, int] | None:
        """(n, m, r) when the parameter is compressed (torch's PowerSGD rule), else None."""
        p = self.params[name]
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, self.rank)
        return (n, m, r) if p.dim() > 1 and (n + m) * r * self.rate < n * m else None

    def draw_q(self) -> None:
        """One generator per bucket; its matrices' Qs in the plan's order: grouped by
        (n, m) in order of first appearance. The layout is read now, after the rebuild."""
        for names in self.buckets():
            gen = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
            groups: dict[tuple[int, int], list[str]] = {}
            for name in names:
                if (s := self.shape(name)) is not None:
                    groups.setdefault(s[:2], []).append(name)
            for group in groups.values():
                for name in group:
                    n, m, r = self.shape(name)
                    device = self.params[name].device  # drawn on the CPU, as the hook does
                    self.q[name] = torch.randn((m, r), generator=gen).to(device)
                    self.error[name] = torch.zeros(n, m, device=device)

    def grads(self) -> dict[str, torch.Tensor]:
        world = dist.get_world_size()
        out = {}
        if self.step < self.start:
            for name, p in self.params.items():
                g = p.grad.clone()
                dist.all_reduce(g.div_(world))
                out[name] = g
            self.step += 1
            return out
        if self.step == self.start:
            self.draw_q()
        even = (self.step - self.start) % 2 == 0
        for name, p in self.params.items():
            if self.shape(name) is None:
                g = p.grad.clone()
                dist.all_reduce(g)
                out[name] = g.div_(world)
                continue
            m = p.grad.view(p.shape[0], -1) + self.error[name]
            if even:
                q = self.q[name].unsqueeze(0).clone()
                psgd._orthogonalize(q)
                q = q[0]
                local = m @ q
                self.error[name] = m - local @ q.T
                dist.all_reduce(local)
                self.p[name], self.q[name] = local, q
            else:
                pp = self.p[name].unsqueeze(0).clone()
                psgd._orthogonalize(pp)
                pp = pp[0]
                local = m.T @ pp
                self.error[name] = m - pp @ local.T
                dist.all_reduce(local)
                self.p[name], self.q[name] = pp, local
            out[name] = (self.p[name] @ self.q[name].T).div_(world).view_as(p)
        self.step += 1
        return out


def against_reference(rank: int = 2, start: int = 2, steps: int = 8, device: str = "cpu") -> int:
    """fastddp's acpsgd and the reference from the same weights on the same batches, SGD
    steps with the reference's gradients on both; grads compared after every backward.
    Returns how many parameters were compressed. On CUDA (one GPU, NCCL at world size 1:
    registering the hook builds the reducer) the hook's bmm, orthogonalization kernels and
    streams run against the same torch ops on the GPU."""
    torch.manual_seed(0)
    base = Mixed().to(device)
    ids = [torch.cuda.current_device()] if device == "cuda" else None
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.002,
                                           device_ids=ids)
    fast.register_comm_hook(None, fastddp.hooks.acpsgd(rank, start_iter=start))
    local = copy.deepcopy(base)
    ref = None
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (fast, local)]
    for step in range(steps):
        inputs, target = (t.to(device) for t in batch(step))
        for model, opt in zip((fast, local), opts):
            opt.zero_grad()
            F.mse_loss(model(inputs), target).backward()
        if ref is None:  # reads the bucket layout when it first compresses
            ref = Reference(local, fast.bucket_plan, rank, start)
        want = ref.grads()
        for name, p in local.named_parameters():
            p.grad = want[name]
        agree(lambda s=step: compare_grads(local, fast.module, f"step {s}", TOL))
        for opt in opts:
            opt.step()
    return sum(ref.shape(n) is not None for n in ref.params)


def allreduces_per_step(hook: str, steps: int = 5) -> list[int]:
    """Per step, the c10d allreduce calls as torch's profiler records them (torch's own
    instrumentation of its collectives) and as comm_stats() reports them (c10d's sequence
    number of the group), and the bucket count at the end."""
    torch.manual_seed(0)
    fast = fastddp.DistributedDataParallel(Mixed(), bucket_cap_mb=0.002)
    make = {"acpsgd": lambda: fastddp.hooks.acpsgd(2, start_iter=2),
            "powersgd": lambda: fastddp.hooks.powersgd(2, start_powerSGD_iter=2)}[hook]
    fast.register_comm_hook(None, make())
    counts = []
    for step in range(steps):
        inputs, target = batch(step)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            F.mse_loss(fast(inputs), target).backward()
        counts.append((sum(e.count for e in prof.key_averages() if e.key == "c10d::allreduce_"),
                       fast.comm_stats()["collectives"]))
    return counts + [len(fast.bucket_plan())]


def resume(cut: int = 5, steps: int = 9, load_hook_state: bool = True) -> dict:
    """An uninterrupted run against one resumed from a checkpoint (model, optimizer,
    comm_hook_state_dict() through torch.save) taken after `cut` steps: with start 2, cut 5
    falls after a P step, so the resumed run's first step is a Q step, which needs the
    saved P. Returns whether the resumed steps' gradients are bitwise those of the
    uninterrupted run, and the state's keys."""
    import io

    from tests.python.hooks.powersgd_state_scenarios import _train as train

    def make(module):
        ddp = fastddp.DistributedDataParallel(module, bucket_cap_mb=0.002)
        ddp.register_comm_hook(None, fastddp.hooks.acpsgd(2, start_iter=2))
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    torch.manual_seed(0)
    model, opt = make(Mixed())
    whole: dict[int, list[torch.Tensor]] = {}
    train(model, opt, range(cut), whole)
    buf = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "hook": model.comm_hook_state_dict()}, buf)
    train(model, opt, range(cut, steps), whole)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    module = Mixed()
    module.load_state_dict(saved["model"])
    resumed, ropt = make(module)
    ropt.load_state_dict(saved["opt"])
    if load_hook_state:
        resumed.load_comm_hook_state_dict(saved["hook"])
    again: dict[int, list[torch.Tensor]] = {}
    train(resumed, ropt, range(cut, steps), again)
    pairs = [(a, b) for s in range(cut, steps) for a, b in zip(whole[s], again[s], strict=True)]
    return {"equal": all(torch.equal(a, b) for a, b in pairs),
            "max_diff": max(float((a - b).abs().max()) for a, b in pairs),
            "keys": sorted(saved["hook"]), "p_names": sorted(saved["hook"]["p"])}
