"""The sharded optimizer (fastddp.optim.ShardedOptimizer) against references fastddp did not
write: torch DDP followed by the same torch optimizer, unsharded, and torch's own
ZeroRedundancyOptimizer over torch DDP, from one set of weights on the same batches.

Scenarios for a harness world (2 and 3 gloo ranks, and 1)."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from fastddp.optim import ShardedOptimizer
from tests.python.scenarios import ConvNet, image_batch, mlp, vector_batch

OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True,
                                       "weight_decay": 0.01}),
    "sgd_fused": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "fused": True}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adam_fused": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "fused": True}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adamw_foreach": (torch.optim.AdamW, {"lr": 0.01, "foreach": True}),
    "adamw_fused": (torch.optim.AdamW, {"lr": 0.01, "fused": True}),
}

# Small buckets: mlp()'s six parameters (1,476 elements) in several buckets, so that shard
# boundaries cut parameters, on 2 ranks and on 3 (uneven: 3 does not divide the buckets).
CAP_MB = 0.002


# torch's fused CPU kernels round their vectorized body and their scalar tail apart, and a
# shard's runs start and end elsewhere than the parameters do: the same update, elementwise,
# but not bit for bit (measured on 2 ranks: fused SGD 1 ulp of a weight after 20 steps;
# fused Adam 1 ulp of an exp_avg_sq after 5, its weights equal).
POSITION_DEPENDENT = {"sgd_fused", "adam_fused", "adamw_fused"}


def _bound(world: int, clip: bool, optimizer: str, wire: str = "fp32") -> float:
    """The largest |difference| allowed between a parameter and torch's, after 20 steps.

    0 where the numbers are torch's to the bit: on 2 ranks (a sum of two numbers is the same
    in any order, so the reduce-scatter's average is the allreduce's) without clipping, for
    every implementation but POSITION_DEPENDENT's. Otherwise roundings differ:
    - POSITION_DEPENDENT: an ulp of an update per step, as said there;
    - on 3 ranks gloo's reduce-scatter may add the ranks in another order than its
      allreduce: each element of the average can differ in its last bit (a relative 2^-23);
    - clip_grad_norm_ sums the squares of the shards, then over ranks, where torch sums
      per parameter, then the norms' squares: the clip factor can differ by a few ulps.
    Adam's update divides the first moment by the root of the second, so a relative 2^-23
    in a gradient moves the update by about as much relative, i.e. lr * 2^-23 per step;
    over 20 steps at lr 0.01-0.05 that is under 1e-7 in total. SGD with momentum 0.9 sums
    at most 10x the gradient's own rounding (the |gradients| here are below 1). 1e-6 is
    ten times the larger of the two, and 2^-20 of the weights' size (about 0.5): a
    different sum order passes, a wrong shard, step or scale (differences of 1e-3 and up)
    does not. A 16-bit wire's reference (_wire_hook) sums in the wire's own order: exact on
    any number of ranks."""
    same_sum = world <= 2 or wire != "fp32"
    return 0.0 if same_sum and not clip and optimizer not in POSITION_DEPENDENT else 1e-6


def _wire_hook(wire: str):
    """torch DDP's comm hook for the reference of ``gradient_wire=wire``. bf16 on 2 ranks:
    torch's own bf16_compress_hook, whose average is the wire's bit for bit there (it rounds
    the gradient, then halves it exactly; the wire halves, then rounds: the same number; a
    sum of two is rounded once either way). Otherwise the wire's arithmetic in torch ops:
    each rank's gradient times 1/world in float32 (torch's copy-in), rounded to the wire,
    gathered, summed in float32 in rank order, rounded once (torch's hook sums n - 1 times
    in 16 bits on more ranks, and fp16's rounding then halving differs from halving then
    rounding for subnormal halves)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    world = dist.get_world_size()
    if wire == "bf16" and world == 2:
        return default_hooks.bf16_compress_hook
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[wire]

    def written_out(state, bucket):
        mine = bucket.buffer().mul(1.0 / world).to(dtype)
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
        total = rows[0].float()
        for row in rows[1:]:
            total = total + row.float()
        bucket.buffer().copy_(total.to(dtype))
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future
    return written_out


class Strided(nn.Module):
    """Parameters whose bucket slots are not plain ranges of their shape: ConvNet in
    channels_last (dense, permuted strides: make_buckets lays their slots out with those
    strides) and a head that is a column slice of a wider tensor (not dense: its slot is
    contiguous). The sharded flat buffer must use each slot's strides, or element e of a
    gradient shard steps another element of the parameter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = ConvNet().to(memory_format=torch.channels_last)
        self.mix = nn.Parameter(torch.randn(4, 8)[:, ::2])
        assert not self.mix.is_contiguous() and self.mix.stride() == (8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) @ self.mix


def _make_models(gradient_as_bucket_view: bool = False, model: str = "mlp", **fast_kwargs):
    common = dict(bucket_cap_mb=CAP_MB, gradient_as_bucket_view=gradient_as_bucket_view)
    if model == "strided":  # built four times: deepcopy makes a non-dense parameter contiguous
        build = Strided
    else:
        torch.manual_seed(0)
        first = mlp()

        def build():
            return copy.deepcopy(first)
    base = build()
    fast = fastddp.DistributedDataParallel(build(), **common, **fast_kwargs)
    ref = TorchDDP(build(), **common)
    zero = TorchDDP(build(), **common)
    return base, fast, ref, zero


def train(optimizer: str = "adamw", steps: int = 20, clip: bool = False, groups: bool = False,
          no_sync_every: int = 0, gradient_as_bucket_view: bool = False,
          schedule: bool = False, overlap_all_gather: bool = False,
          zero_stage: int = 1, model: str = "mlp", wire: str = "fp32") -> dict:
    """fastddp + ShardedOptimizer against torch DDP + the optimizer and against torch DDP +
    ZeroRedundancyOptimizer. groups: two param groups with their own learning rates and
    weight decay. clip: clip_grad_norm_(0.5) each step (the shards' method; torch's function
    on the references). no_sync_every=k: every k-th backward runs under no_sync().
    schedule: a StepLR on all three. overlap_all_gather: each module's forward waits for
    its buckets' all-gathers (the parameters are read once more, at the end, after wait()).
    zero_stage=2: the bucket buffers released after each backward (held bytes recorded).
    model="strided": Strided on image batches instead of mlp() on vectors. wire: the
    sharded optimizer's gradient_wire; the references then run _wire_hook."""
    cls, kwargs = OPTIMIZERS[optimizer]
    base, fast, ref, zero = _make_models(gradient_as_bucket_view, model)
    batch = image_batch if model == "strided" else vector_batch

    def groups_of(model):
        params = list(model.parameters())
        if groups:  # the first layer's weight and bias: another lr, no weight decay
            return [{"params": params[:2], "lr": kwargs["lr"] / 3, "weight_decay": 0.0},
                    {"params": params[2:]}]
        return params

    if wire != "fp32":
        for reference in (ref, zero):
            reference.register_comm_hook(None, _wire_hook(wire))
    fast_opt = ShardedOptimizer(fast, cls, groups_of(fast), overlap_all_gather=overlap_all_gather,
                                zero_stage=zero_stage, gradient_wire=wire, **kwargs)
    ref_opt = cls(groups_of(ref), **kwargs)
    zero_opt = ZeroRedundancyOptimizer(groups_of(zero), optimizer_class=cls, **kwargs)
    # torch's ZeroRedundancyOptimizer is no reference for Strided: it broadcasts each
    # parameter from its owner, and gloo's broadcast into a non-dense tensor writes the
    # elements as if it were contiguous (measured: a [:, ::2] slice receives half of them),
    # so its `mix` is wrong from the first step on. torch DDP + the optimizer stays one.
    compare_zero = model != "strided"
    opts = ((fast, fast_opt), (ref, ref_opt)) + (((zero, zero_opt),) if compare_zero else ())
    schedulers = ([torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.8)
                   for _, o in opts] if schedule else [])
    norms = []
    grads_none = True
    # overlap_all_gather: pending after each step, all waited for by the next forward
    gathers_overlap = True
    held = []  # the reducer's bucket bytes after each synchronized backward
    for step in range(steps):
        inputs, target = batch(step)
        accumulate = no_sync_every and step % no_sync_every == no_sync_every - 1
        for model, opt in opts:
            with model.no_sync() if accumulate else _null():
                F.mse_loss(model(inputs), target).backward()
            if model is fast and overlap_all_gather:
                gathers_overlap &= all(g is None for g in fast_opt._gathers)
        if accumulate:
            continue
        grads_none &= all(p.grad is None for p in fast.parameters())
        held.append(fast._reducer.held_bucket_bytes())
        if clip:
            norms.append((fast_opt.clip_grad_norm_(0.5).item(),
                          torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()))
            if compare_zero:
                torch.nn.utils.clip_grad_norm_(zero.parameters(), 0.5)
        for model, opt in opts:
            opt.step()
            opt.zero_grad()
        if overlap_all_gather:
            gathers_overlap &= all(g is not None for g in fast_opt._gathers)
        for scheduler in schedulers:
            scheduler.step()
    fast_opt.wait()  # the last step's all-gathers, under overlap_all_gather
    bound = _bound(dist.get_world_size(), clip, optimizer, wire)
    fast_p = [p.detach() for p in fast.module.parameters()]
    diff_ref = max((a - b).abs().max().item() for a, b in zip(fast_p, ref.module.parameters()))
    diff_zero = (max((a - b).abs().max().item() for a, b in zip(fast_p, zero.module.parameters()))
                 if compare_zero else None)
    mine = torch.cat([p.reshape(-1) for p in fast_p])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    moved = (mine - torch.cat([p.detach().reshape(-1) for p in base.parameters()])).abs().max()
    return {"within_bound_of_torch": diff_ref <= bound, "diff_ref": diff_ref,
            "within_bound_of_zero": compare_zero and diff_zero <= bound, "diff_zero": diff_zero,
            "replicas_agree": all(torch.equal(g, mine) for g in gathered),
            "moved": moved.item() > 1e-3, "grads_none": grads_none,
            "buckets": len(fast._sharded), "exact": bound == 0.0,
            "gathers_overlap": gathers_overlap, "held_bucket_bytes": max(held),
            # the global norm: the shards' against torch's over whole gradients (float32
            # sums in two orders: a few ulps of the norm)
            "norms_agree": all(abs(a - b) <= 1e-6 * max(1.0, b) for a, b in norms)}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def state_bytes(optimizer: str = "adamw") -> dict:
    """The optimizer state this rank holds, against the unsharded optimizer's after one
    step: the shards' together are the whole state, and each rank's is its share."""
    cls, kwargs = OPTIMIZERS[optimizer]
    _, fast, ref, _ = _make_models()
    fast_opt = ShardedOptimizer(fast, cls, **kwargs)
    ref_opt = cls(ref.parameters(), **kwargs)
    inputs, target = vector_batch(0)
    for model, opt in ((fast, fast_opt), (ref, ref_opt)):
        F.mse_loss(model(inputs), target).backward()
        opt.step()
    whole = sum(t.numel() * t.element_size() for s in ref_opt.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    mine = torch.tensor([fast_opt.shard_state_bytes()])
    total = mine.clone()
    dist.all_reduce(total)
    return {"mine": mine.item(), "whole": whole, "total": total.item(),
            "buckets": len(fast._sharded), "elements": sum(b.flat.numel() for b in fast._sharded)}


def refusals() -> dict:
    """What the sharded optimizer refuses, each with the exception it raises and its text."""
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as e:  # noqa: BLE001: the type and text are the result
            out[name] = (type(e).__name__, str(e))

    cls, kwargs = OPTIMIZERS["adamw"]

    def model(**kw):
        torch.manual_seed(0)
        return fastddp.DistributedDataParallel(mlp(), bucket_cap_mb=CAP_MB, **kw)

    def powersgd():
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        m = model()
        m.register_comm_hook(ps.PowerSGDState(None, matrix_approximation_rank=1),
                             ps.powerSGD_hook)
        ShardedOptimizer(m, cls, **kwargs)

    def acpsgd():
        m = model()
        m.register_comm_hook(None, fastddp.hooks.acpsgd(matrix_approximation_rank=1))
        ShardedOptimizer(m, cls, **kwargs)

    def hook_after():
        m = model()
        ShardedOptimizer(m, cls, **kwargs)
        m.register_comm_hook(None, fastddp.hooks.bf16())

    def stranger():
        m = model()
        ShardedOptimizer(m, cls, list(m.parameters()) + [nn.Parameter(torch.zeros(3))],
                         **kwargs)

    def missing():
        m = model()
        ShardedOptimizer(m, cls, list(m.parameters())[1:], **kwargs)

    def twice():
        m = model()
        p = list(m.parameters())
        ShardedOptimizer(m, cls, [{"params": p}, {"params": p[:1]}], **kwargs)

    def whole_tensor():
        ShardedOptimizer(model(), torch.optim.Adagrad, lr=0.1)

    def lbfgs():
        ShardedOptimizer(model(), torch.optim.LBFGS, lr=0.1)

    def int4_wire():  # a wire the reduce-scatter has none of
        ShardedOptimizer(model(), cls, gradient_wire="int4", **kwargs)

    def bf16_wire_of_float64():  # the wire casts float32 gradients only; refused, unchanged
        torch.manual_seed(0)
        m = fastddp.DistributedDataParallel(mlp().double(), bucket_cap_mb=CAP_MB)
        try:
            ShardedOptimizer(m, cls, gradient_wire="bf16", **kwargs)
        finally:
            assert getattr(m, "_sharded", None) is None and m._native_hook is None

    def unused():
        ShardedOptimizer(model(find_unused_parameters=True), cls, **kwargs)

    def two_optimizers():
        m = model()
        ShardedOptimizer(m, cls, **kwargs)
        ShardedOptimizer(m, cls, **kwargs)

    def overlap():
        m = model()
        ShardedOptimizer(m, cls, **kwargs)
        m.overlap_optimizer(torch.optim.SGD(m.parameters(), lr=0.1))

    def step_without_backward():
        m = model()
        ShardedOptimizer(m, cls, **kwargs).step()

    def unscale_first():  # scaler.unscale_(opt) would reach .grad, not the shards
        m = model()
        opt = ShardedOptimizer(m, cls, **kwargs)
        scaler = torch.amp.GradScaler("cpu")
        inputs, target = vector_batch(0)
        scaler.scale(F.mse_loss(m(inputs), target)).backward()
        scaler.unscale_(opt)
        scaler.step(opt)

    def checkpoint():  # state_dict() before consolidate_state_dict()
        ShardedOptimizer(model(), cls, **kwargs).state_dict()

    def join():
        m = model()
        ShardedOptimizer(m, cls, **kwargs)
        with m.join():
            pass

    def pickled():
        m = model()
        ShardedOptimizer(m, cls, **kwargs)
        import pickle
        pickle.dumps(m)

    def wrong_groups():
        m = model()
        opt = ShardedOptimizer(m, cls, **kwargs)
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]})

    for name, fn in [("powersgd", powersgd), ("acpsgd", acpsgd), ("hook_after", hook_after),
                     ("stranger", stranger), ("missing", missing), ("twice", twice),
                     ("whole_tensor", whole_tensor), ("lbfgs", lbfgs), ("unused", unused),
                     ("two_optimizers", two_optimizers), ("overlap", overlap),
                     ("step_without_backward", step_without_backward),
                     ("unscale_first", unscale_first), ("checkpoint", checkpoint),
                     ("wrong_groups", wrong_groups), ("join", join), ("pickled", pickled),
                     ("int4_wire", int4_wire), ("bf16_wire_of_float64", bf16_wire_of_float64)]:
        attempt(name, fn)
    dist.barrier()  # every rank refused alike: no collective is left half issued
    return out


def _max_diff(a, b) -> float:
    return max(((x - y).abs().max().item() for x, y in zip(a, b)), default=0.0)


def checkpoint(optimizer: str = "adamw", groups: bool = True) -> dict:
    """The state dict in torch's format, both ways. Five steps of fastddp + ShardedOptimizer
    and of torch DDP + the optimizer; the shards' state consolidated on rank 0 against the
    torch optimizer's state_dict(), and loaded into a plain torch optimizer. Then a resume:
    a new model and ShardedOptimizer load torch's weights and state dict, and five more
    steps of both match."""
    cls, kwargs = OPTIMIZERS[optimizer]
    _, fast, ref, _ = _make_models()

    def groups_of(model):
        params = list(model.parameters())
        if groups:
            return [{"params": params[:2], "lr": kwargs["lr"] / 3}, {"params": params[2:]}]
        return params

    fast_opt = ShardedOptimizer(fast, cls, groups_of(fast), **kwargs)
    ref_opt = cls(groups_of(ref), **kwargs)

    def train(pairs, steps, first):
        for step in range(first, first + steps):
            inputs, target = vector_batch(step)
            for model, opt in pairs:
                opt.zero_grad()
                F.mse_loss(model(inputs), target).backward()
                opt.step()

    train(((fast, fast_opt), (ref, ref_opt)), 5, 0)
    fast_opt.consolidate_state_dict(to=0)
    out = {"state_on_other_ranks_refused": True}
    bound = _bound(dist.get_world_size(), False, optimizer)
    if dist.get_rank() == 0:
        mine, theirs = fast_opt.state_dict(), ref_opt.state_dict()
        out["same_keys"] = (sorted(mine["state"]) == sorted(theirs["state"]) and all(
            sorted(mine["state"][i]) == sorted(theirs["state"][i]) for i in theirs["state"]))
        out["groups_equal"] = mine["param_groups"] == theirs["param_groups"]
        pairs = [(mine["state"][i][k], theirs["state"][i][k]) for i in theirs["state"]
                 for k in theirs["state"][i]]
        out["state_diff"] = {f"{i}.{k}": (a - b).abs().max().item() if a.dim() else
                             (a.item(), b.item()) for (i, k), (a, b) in zip(
                                 ((i, k) for i in theirs["state"] for k in theirs["state"][i]),
                                 pairs)}
        # Bit for bit where the weights are (bound 0). Else each element within 8 float32
        # ulps of the tensor's largest |element|: a gradient's rounding (_bound: an ulp of
        # the largest gradient on 3 ranks; POSITION_DEPENDENT: an ulp of the update) enters
        # a moment once per step, 5 steps here (measured: at most 2).
        ulps = 0.0 if bound == 0.0 else 8 * torch.finfo(torch.float32).eps
        out["state_within_bound"] = all(
            a.shape == b.shape and a.dtype == b.dtype
            and (a - b).abs().max().item() <= ulps * b.abs().max().item() for a, b in pairs)
        plain = cls(groups_of(copy.deepcopy(ref.module)), **kwargs)
        plain.load_state_dict(mine)  # torch's own checks of the format
        out["plain_loads"] = True
    else:
        try:
            fast_opt.state_dict()
            out["state_on_other_ranks_refused"] = False
        except RuntimeError:
            pass
    # The resume: torch's weights and state dict into a new model and ShardedOptimizer.
    torch.manual_seed(0)
    resumed = fastddp.DistributedDataParallel(copy.deepcopy(ref.module), bucket_cap_mb=CAP_MB)
    resumed_opt = ShardedOptimizer(resumed, cls, groups_of(resumed), **kwargs)
    resumed_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    train(((resumed, resumed_opt), (ref, ref_opt)), 5, 5)
    out["resumed_within_bound"] = _max_diff(resumed.module.parameters(),
                                            ref.module.parameters()) <= bound
    out["exact"] = bound == 0.0
    return out


def step_cost(zero_stage: int = 1, wire: str = "fp32") -> dict:
    """The last of four steps' counted cost (Note [counted cost], csrc/util/step_cost.h)."""
    torch.manual_seed(0)
    model = fastddp.DistributedDataParallel(mlp(), bucket_cap_mb=CAP_MB)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=0.01, zero_stage=zero_stage,
                           gradient_wire=wire)
    for step in range(4):
        inputs, target = vector_batch(step)
        opt.zero_grad()
        F.mse_loss(model(inputs), target).backward()
        opt.step()
    return {"cost": model.comm_stats()["step_cost"],
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "bucket_bytes": sum(b.flat.numel() * b.flat.element_size() for b in opt._buckets)}


def grad_scaler(optimizer: str = "adamw", steps: int = 12, overflow_at: int = 5) -> dict:
    """bf16 autocast with GradScaler on both: fastddp + ShardedOptimizer against torch DDP +
    the optimizer unsharded, through ``scaler.step(opt)`` and ``scaler.update()``. At step
    ``overflow_at`` the last rank's input holds an inf: its gradients, so the average, are
    not finite, every rank must skip that step and halve the scale, and later steps go on."""
    import warnings
    cls, kwargs = OPTIMIZERS[optimizer]
    _, fast, ref, _ = _make_models()
    fast_opt = ShardedOptimizer(fast, cls, **kwargs)
    ref_opt = cls(ref.parameters(), **kwargs)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    scales = []
    for step in range(steps):
        inputs, target = vector_batch(step)
        if step == overflow_at and dist.get_rank() == dist.get_world_size() - 1:
            inputs[0, 0] = float("inf")
        for (model, opt), scaler in zip(((fast, fast_opt), (ref, ref_opt)), scalers):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(inputs), target)
            scaler.scale(loss.float()).backward()
            with warnings.catch_warnings():  # GradScaler's notice that grad_scaler= goes
                warnings.simplefilter("ignore", FutureWarning)
                scaler.step(opt)
            scaler.update()
        scales.append(tuple(sc.get_scale() for sc in scalers))
    bound = _bound(dist.get_world_size(), False, optimizer)
    diff = _max_diff(fast.module.parameters(), ref.module.parameters())
    return {"within_bound": diff <= bound, "diff": diff, "exact": bound == 0.0,
            "scales_equal": all(a == b for a, b in scales),
            "skipped": scales[overflow_at][0] < scales[overflow_at - 1][0],
            "finite": all(torch.isfinite(p).all() for p in fast.module.parameters())}


def first_user_waits() -> dict:
    """overlap_all_gather: when the first layer's forward starts after a step, the
    all-gathers of its own buckets have been waited for and the others' not yet (each
    bucket's is waited for by the first module that uses it, Note [sharded optimizer])."""
    _, fast, _, _ = _make_models()
    opt = ShardedOptimizer(fast, torch.optim.AdamW, lr=0.01, overlap_all_gather=True)
    first = fast.module[0]
    mine = sorted({b for b, bucket in enumerate(fast._sharded)
                   for p in bucket.params if any(p is q for q in first.parameters())})
    seen = []
    first.register_forward_pre_hook(  # after the optimizer's own hook on this module
        lambda module, args: seen.append([g is None for g in opt._gathers]))
    for step in range(2):
        inputs, target = vector_batch(step)
        opt.zero_grad()
        F.mse_loss(fast(inputs), target).backward()
        opt.step()
    opt.wait()
    done = seen[-1]  # the second forward, after the first step
    return {"own_waited": all(done[b] for b in mine),
            "others_pending": [b for b, d in enumerate(done) if not d and b not in mine],
            "buckets": len(done)}


def zero_redundancy_over_fastddp(optimizer: str = "adamw", steps: int = 10) -> dict:
    """torch's ZeroRedundancyOptimizer over fastddp's model works as over torch DDP's: the
    same weights after ten steps (both allreduce the whole gradient; ZeRO steps its own
    parameters and broadcasts them)."""
    cls, kwargs = OPTIMIZERS[optimizer]
    _, fast, _, zero = _make_models()
    fast_opt = ZeroRedundancyOptimizer(fast.parameters(), optimizer_class=cls, **kwargs)
    zero_opt = ZeroRedundancyOptimizer(zero.parameters(), optimizer_class=cls, **kwargs)
    for step in range(steps):
        inputs, target = vector_batch(step)
        for model, opt in ((fast, fast_opt), (zero, zero_opt)):
            opt.zero_grad()
            F.mse_loss(model(inputs), target).backward()
            opt.step()
    fast_opt.consolidate_state_dict(to=0)
    zero_opt.consolidate_state_dict(to=0)
    states_equal = True
    if dist.get_rank() == 0:
        a, b = fast_opt.state_dict()["state"], zero_opt.state_dict()["state"]
        states_equal = sorted(a) == sorted(b) and all(
            torch.equal(a[i][k], b[i][k]) for i in b for k in b[i])
    return {"diff": _max_diff(fast.module.parameters(), zero.module.parameters()),
            "states_equal": states_equal}


def dcp_resume(path: str, optimizer: str = "adamw", steps: int = 5) -> dict:
    """torch.distributed.checkpoint, sharded: after five steps each rank saves its shards
    (save_sharded); a new model with the same weights and a new ShardedOptimizer load them,
    and five more steps of both runs agree bit for bit. A model laid out in other buckets
    refuses the checkpoint with a ValueError naming both layouts."""
    cls, kwargs = OPTIMIZERS[optimizer]
    _, fast, _, _ = _make_models()
    opt = ShardedOptimizer(fast, cls, [{"params": list(fast.parameters())[:2], "lr": 0.003},
                                       {"params": list(fast.parameters())[2:]}], **kwargs)

    def train(model, o, first):
        for step in range(first, first + steps):
            inputs, target = vector_batch(step)
            o.zero_grad()
            F.mse_loss(model(inputs), target).backward()
            o.step()

    train(fast, opt, 0)
    opt.save_sharded(path)
    weights = copy.deepcopy(fast.module.state_dict())
    torch.manual_seed(0)
    again = fastddp.DistributedDataParallel(mlp(), bucket_cap_mb=CAP_MB)
    again.module.load_state_dict(weights)
    again_opt = ShardedOptimizer(again, cls, [{"params": list(again.parameters())[:2],
                                               "lr": 0.5}, {"params": list(again.parameters())[2:]}],
                                 **kwargs)
    again_opt.load_sharded(path)
    lr_restored = again_opt.param_groups[0]["lr"] == 0.003
    train(fast, opt, steps)
    train(again, again_opt, steps)
    out = {"diff": _max_diff(fast.module.parameters(), again.module.parameters()),
           "lr_restored": lr_restored}
    other = fastddp.DistributedDataParallel(mlp(), bucket_cap_mb=CAP_MB / 2)
    try:
        ShardedOptimizer(other, cls, **kwargs).load_sharded(path)
        out["other_layout"] = None
    except ValueError as e:
        out["other_layout"] = str(e)
    return out
