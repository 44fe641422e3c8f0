"""DiLoCo scenarios, run on every rank of a harness world (tests/python/harness.py), against
references fastddp did not write: torch DDP with SGD (H = 1), torch.optim.SGD(nesterov=True)
on the rank-averaged pseudo-gradient, and an uninterrupted run (restart). torchft's DiLoCo is
in torchft_scenarios.py.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.scenarios import (agree, assert_close_ulps, mlp, partly_frozen, rounding_ulps,
                                    vector_batch, with_batchnorm)

INNER_LR = 0.05


def local_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One inner step on this rank's batch of `step` (different on every rank)."""
    inputs, target = vector_batch(step)
    opt.zero_grad()
    F.mse_loss(model(inputs), target).backward()
    opt.step()


def h1_matches_torch_ddp(steps: int, model: str = "mlp") -> None:
    """sync_every=1, inner SGD(lr), outer SGD lr 1 without momentum: after every step the
    weights are torch DDP + SGD(lr)'s. `model`: "mlp" or "partly_frozen" (frozen parameters
    in the middle: broadcast once, never averaged, as torch DDP leaves them).

    Not bit for bit (measured: 3e-8 apart after the first step): DDP steps p - lr * mean(g),
    DiLoCo p - mean(p - (p - lr * g_r)). Each rank's p - lr * g_r rounds (half an ulp of
    |p|), the subtraction from p is then exact where both are within a factor of 2 (Sterbenz)
    and rounds as little otherwise, the mean and the final step round once more each: at most
    2 ulps of the tensor's largest |element| per step, carried on by later steps.
    `allowed_per_step` per step taken allows that, plus gloo's summation order on 3 ranks
    (rounding_ulps(), tests/python/scenarios.py)."""
    allowed_per_step = 2
    torch.manual_seed(0)
    base = {"mlp": mlp, "partly_frozen": partly_frozen}[model]()
    ref = TorchDDP(copy.deepcopy(base))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=INNER_LR)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    with fastddp.DiLoCo(model, opt, sync_every=1, outer_lr=1.0, outer_momentum=0.0):
        for step in range(steps):
            local_step(ref, ref_opt, step)
            local_step(model, opt, step)
            ulps = allowed_per_step * (step + 1) + rounding_ulps()

            def check() -> None:
                for (name, theirs), ours in zip(ref.module.named_parameters(),
                                                model.parameters(), strict=True):
                    assert_close_ulps(ours.detach(), theirs.detach(), ulps,
                                      msg=lambda m: f"after step {step}: {name}: {m}")
            agree(check)


def outer_step_is_nesterov_sgd(wire: str, syncs: int, sync_every: int) -> None:
    """Written-out reference of the outer step: the ranks' weights before each sync (taken by
    an inner-optimizer post-hook registered before DiLoCo's, so it runs first), pseudo-
    gradients against the reference's own anchor, averaged by torch's all_reduce over one flat
    buffer (fp32 wire: SUM, then / world size) or taken from the wire's average (quantized
    wires, whose codes other tests check: here only the step is under test), and
    torch.optim.SGD(lr, momentum, nesterov=True) on per-parameter copies of the anchor with that
    average as grad. The models after each sync equal the reference bit for bit: the same
    elementwise arithmetic on the same numbers (one flat tensor or many does not matter)."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    before_sync: list[torch.Tensor] = []
    opt.register_step_post_hook(lambda *_: before_sync.__setitem__(
        slice(None), [p.detach().clone() for p in model.parameters()]))
    diloco = fastddp.DiLoCo(model, opt, sync_every=sync_every, outer_lr=0.7,
                            outer_momentum=0.9, wire=wire)
    wire_average: list[torch.Tensor] = []
    outer_step = diloco.outer_optimizer.step

    def spy(*args, **kwargs):
        wire_average[:] = [f.grad.clone() for f in diloco.fragments[0].anchor.flats]
        return outer_step(*args, **kwargs)
    diloco.outer_optimizer.step = spy
    anchor = [p.detach().clone() for p in model.parameters()]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    sizes = [a.numel() for a in anchor]
    for sync in range(syncs):
        _train(model, opt, range(sync * sync_every, (sync + 1) * sync_every))
        if wire == "fp32":
            flat = torch.cat([(a - w).reshape(-1) for a, w in zip(anchor, before_sync)])
            dist.all_reduce(flat)
            flat.div_(dist.get_world_size())
        else:
            flat = wire_average[0]
        for a, g in zip(anchor, flat.split(sizes)):
            a.grad = g.view_as(a)
        outer.step()

        def check() -> None:
            for i, (a, p) in enumerate(zip(anchor, model.parameters(), strict=True)):
                assert torch.equal(p.detach(), a), (
                    f"sync {sync}: parameter {i} differs from SGD(nesterov=True)'s step by "
                    f"{(p.detach() - a).abs().max().item():.3g}")
        agree(check)
    diloco.close()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        local_step(model, opt, step)


def _build(wire: str, seed: int, model_fn=mlp, sync_every: int = 3, **streaming):
    torch.manual_seed(seed)
    model = model_fn()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = fastddp.DiLoCo(model, opt, sync_every=sync_every, outer_lr=0.7,
                            outer_momentum=0.9, wire=wire, **streaming)
    return model, opt, diloco


def restart_is_exact(wire: str, stop_at: int, steps: int, **streaming) -> None:
    """Train `steps` inner steps straight through; train `stop_at`, save the model's, the
    inner optimizer's and DiLoCo's state dicts, build everything afresh (other initial
    weights), load them, train on: the same weights bit for bit. `streaming`: sync_every,
    fragments, overlap, merge_alpha."""
    model, opt, diloco = _build(wire, seed=0, **streaming)
    _train(model, opt, range(steps))
    straight = [p.detach().clone() for p in model.parameters()]
    diloco.close()

    model, opt, diloco = _build(wire, seed=0, **streaming)
    _train(model, opt, range(stop_at))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), diloco.state_dict()))
    diloco.close()
    del model, opt, diloco

    model, opt, diloco = _build(wire, seed=1, **streaming)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    diloco.load_state_dict(saved[2])
    assert diloco.step == stop_at
    _train(model, opt, range(stop_at, steps))
    diloco.close()

    def check() -> None:
        for i, (a, b) in enumerate(zip(model.parameters(), straight, strict=True)):
            assert torch.equal(a.detach(), b), (
                f"parameter {i} after a restart at step {stop_at} differs from the "
                f"uninterrupted run by {(a.detach() - b).abs().max().item():.3g}")
    agree(check)


def buffers_follow_rank0(sync_every: int) -> None:
    """After a sync every rank holds rank 0's buffers (BatchNorm statistics), as torch DDP's
    broadcast_buffers makes them, and weights equal on every rank."""
    model, opt, diloco = _build("fp32", seed=0, model_fn=with_batchnorm, sync_every=sync_every)
    _train(model, opt, range(sync_every))
    diloco.close()
    state = torch.cat([t.detach().reshape(-1).float() for t in model.state_dict().values()])
    gathered = [torch.empty_like(state) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, state)
    agree(lambda: torch.testing.assert_close(state, gathered[0], rtol=0, atol=0))


def bad_argument(**kwargs) -> None:
    """Builds a DiLoCo with `kwargs` overriding valid arguments (raises)."""
    torch.manual_seed(0)
    model = mlp()
    arguments = {"model": model, "inner_optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
                 "sync_every": 2}
    if kwargs.pop("float64", False):
        model.double()
    if kwargs.pop("foreign_parameter", False):
        arguments["inner_optimizer"] = torch.optim.SGD(
            list(model.parameters()) + [nn.Parameter(torch.zeros(3))], lr=0.1)
    arguments.update(kwargs)
    fastddp.DiLoCo(**arguments)


def load_mismatch(what: str) -> None:
    """load_state_dict of a state that does not fit (raises)."""
    model, opt, diloco = _build("fp32", seed=0)
    state = diloco.state_dict()
    diloco.close()
    if what == "config":
        _, _, other = _build("int8", seed=0)
        other.load_state_dict(state)
    elif what == "missing":
        del state["fragments"]
        diloco.load_state_dict(state)
    elif what == "shape":
        anchor = state["fragments"][0]["anchor"]
        anchor[0] = anchor[0][:-1]
        diloco.load_state_dict(state)
    elif what == "pending":  # an exchange in flight saved, of the wrong size
        fragment = state["fragments"][0]
        fragment["pending"] = [a[:-1].clone() for a in fragment["anchor"]]
        diloco.load_state_dict(state)


def stats_after(wire: str, steps: int, sync_every: int) -> dict[str, int]:
    """DiLoCo.stats() after `steps` inner steps of mlp()."""
    model, opt, diloco = _build(wire, seed=0, sync_every=sync_every)
    _train(model, opt, range(steps))
    diloco.close()
    return diloco.stats()
