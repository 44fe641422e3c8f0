"""DDP's contract beyond plain data parallelism, fastddp against torch DDP on the same
data: static graphs (with reentrant checkpointing and parameters used twice), unused
parameters, uneven inputs under join(), low-precision modules and the logging data.
Run on every rank of a harness world (see harness.py)."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import fastddp
from tests.python.ddp.errors_scenarios import TwoHeads
from tests.python.scenarios import (Tied, agree, compare_grads, compare_state, mlp, side_by_side,
                                    train, vector_batch)


class Checkpointed(nn.Module):
    """A block recomputed by reentrant checkpointing, and a weight used twice: its hook
    fires more than once per backward, so only static_graph knows when it is final."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        h = checkpoint(self.block, h, use_reentrant=True)
        h = checkpoint(self.block, h, use_reentrant=True)  # the same block again
        return self.head(h)


class Branchy(nn.Module):
    """`sometimes` is used on odd steps only (unless not `dynamic`), `never` never,
    `one_rank` on rank 0 only (the other ranks have no local gradient for it, but its
    average is not zero)."""

    def __init__(self, dynamic: bool = True):
        super().__init__()
        self.step = 0
        self.dynamic = dynamic
        self.trunk = nn.Linear(8, 16)
        self.sometimes = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.one_rank = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if self.dynamic and self.step % 2 == 1:
            h = torch.tanh(self.sometimes(h))
        if dist.get_rank() == 0:
            h = torch.tanh(self.one_rank(h))
        return self.head(h)


class TwoOutputs(TwoHeads):
    """TwoHeads with its outputs in a dict; the loss uses only "out"."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out, aux = super().forward(x)
        return {"out": out, "aux": aux}


def static_graph(model: str, set_later: bool) -> None:
    build = {"mlp": mlp, "tied": Tied, "checkpointed": Checkpointed}[model]
    kwargs = {} if set_later else {"static_graph": True}
    ref, fast = side_by_side(build, bucket_cap_mb=0.001, **kwargs)
    if set_later:
        ref._set_static_graph()
        fast._set_static_graph()
    assert fast.static_graph and fast._get_ddp_logging_data()["static_graph"] == 1
    train(ref, fast, steps=6)


def unused_parameters(gradient_as_bucket_view: bool) -> None:
    ref, fast = side_by_side(Branchy, find_unused_parameters=True, bucket_cap_mb=0.001,
                             gradient_as_bucket_view=gradient_as_bucket_view)
    modules = (ref.module, fast.module)

    def advance(step: int) -> None:
        for m in modules:
            m.step = step + 1

    for m in modules:
        m.step = 0
    train(ref, fast, steps=5, after_backward=advance)
    # Used on no rank: never a grad. Used on rank 0 only: every rank gets the average.
    assert fast.module.never.weight.grad is None
    assert fast.module.one_rank.weight.grad is not None


def outputs_not_in_loss() -> None:
    ref, fast = side_by_side(TwoOutputs, find_unused_parameters=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, fast)]
    for step in range(3):
        inputs, target = vector_batch(step)
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad()
            F.mse_loss(model(inputs)["out"], target).backward()
        agree(lambda: compare_grads(ref.module, fast.module, f"step {step}"))
        for opt in opts:
            opt.step()
    assert fast.module.unused.weight.grad is None


def uneven_inputs(divide_by_initial_world_size: bool, find_unused_parameters: bool) -> None:
    """Rank r has 3 + 2r batches. Both implementations train under their join()."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    results = []
    for wrap in (TorchDDP, fastddp.DistributedDataParallel):
        model = wrap(copy.deepcopy(base), bucket_cap_mb=0.001,
                     find_unused_parameters=find_unused_parameters)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with model.join(divide_by_initial_world_size=divide_by_initial_world_size):
            for step in range(3 + 2 * dist.get_rank()):
                inputs, target = vector_batch(step)
                opt.zero_grad()
                F.mse_loss(model(inputs), target).backward()
                opt.step()
        results.append(model.module)
    agree(lambda: compare_state(results[0], results[1], "after join"))


def low_precision(dtype_name: str) -> None:
    """A module cast with model.to(dtype): buckets, sums and grads in that dtype."""
    dtype = getattr(torch, dtype_name)
    ref, fast = side_by_side(lambda: mlp().to(dtype), bucket_cap_mb=0.0005)

    def batch(step: int):
        inputs, target = vector_batch(step)
        return inputs.to(dtype), target.to(dtype)

    train(ref, fast, batch=batch)
    assert all(p.grad.dtype == dtype for p in fast.module.parameters())


class BfloatHead(nn.Module):
    """float32 trunk, bfloat16 head: two dtypes, so at least two buckets."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4).bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.trunk(x)).bfloat16()).float()


def mixed_low_precision() -> None:
    ref, fast = side_by_side(BfloatHead)
    train(ref, fast)
    params = dict(fast.module.named_parameters())
    for bucket in fast.bucket_plan():
        assert len({params[n].dtype for n in bucket}) == 1, f"bucket {bucket} mixes dtypes"
    assert len(fast.bucket_plan()) >= 2


LOGGING_KEYS = ("bucket_sizes", "rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices",
                "has_rebuilt_buckets", "num_parameter_tensors", "total_parameter_size_bytes",
                "bucket_cap_bytes", "world_size", "rank", "find_unused_parameters",
                "gradient_as_bucket_view", "broadcast_buffers", "dtypes", "module_name",
                "prev_iteration_grad_ready_order_indices", "iteration", "num_buckets_reduced")


def logging_data(find_unused_parameters: bool) -> dict:
    ref, fast = side_by_side(mlp, bucket_cap_mb=0.001,
                             find_unused_parameters=find_unused_parameters)
    train(ref, fast, steps=3)
    theirs, ours = ref._get_ddp_logging_data(), fast._get_ddp_logging_data()
    for key in LOGGING_KEYS:
        if key in theirs or key in ours:
            assert ours.get(key) == theirs.get(key), f"{key}: fastddp {ours.get(key)!r} != torch {theirs.get(key)!r}"
    stats = fast.comm_stats()
    return {"stats": stats, "numel": sum(p.numel() for p in fast.module.parameters())}


def comm_stats(dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    ref, fast = side_by_side(lambda: mlp().to(dtype), bucket_cap_mb=0.001)
    for step in range(2):
        inputs, target = vector_batch(step)
        F.mse_loss(fast(inputs.to(dtype)), target.to(dtype)).backward()
    return fast.comm_stats()



def collective_counts(case: str, steps: int = 4) -> list[tuple[int, int | None]]:
    """Per step after the first two (the second forward rebuilds the buckets and
    broadcasts the new plan, outside the counted span), the c10d collectives torch's
    profiler records (torch's own instrumentation of its ops, on every thread) and
    comm_stats()["collectives"]; then the bucket count as the last item."""
    from torch.profiler import ProfilerActivity, profile
    hooks = {"allreduce": None, "bf16": lambda: fastddp.hooks.bf16(),
             "int8": lambda: fastddp.hooks.int8(),
             "powersgd": lambda: fastddp.hooks.powersgd(2, start_powerSGD_iter=2),
             "python hook": lambda: _allreduce, "find_unused_parameters": None}
    torch.manual_seed(0)
    fast = fastddp.DistributedDataParallel(
        mlp(), bucket_cap_mb=0.001, find_unused_parameters=case == "find_unused_parameters")
    if hooks[case] is not None:
        fast.register_comm_hook(None, hooks[case]())
    counts = []
    for step in range(steps):
        inputs, target = vector_batch(step)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            F.mse_loss(fast(inputs), target).backward()
        seen = sum(e.count for e in prof.key_averages() if e.key.startswith("c10d::"))
        counts.append((seen, fast.comm_stats()["collectives"]))
    return counts[2:] + [len(fast.bucket_plan())]


def _returns_list(state: object, bucket: dist.GradBucket) -> list:
    return [bucket.buffer()]


def _bucket_is_tensor(state: object, bucket: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    return torch.futures.Future()


def _allreduce(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future()


def hook_registration_errors() -> list[dict]:
    """Hooks torch refuses at registration (not callable, a wrong annotation, a second
    registration), on torch DDP and on fastddp: the exception's type and message, and what
    _get_ddp_logging_data() then says (``has_error``, ``error``)."""
    cases = {"not callable": [42], "return annotation": [_returns_list],
             "bucket annotation": [_bucket_is_tensor],
             "registered twice": [_allreduce, _allreduce]}
    out = []
    for case, hooks in cases.items():
        ref, fast = side_by_side(mlp)
        seen = []
        for model in (ref, fast):
            try:
                for hook in hooks:
                    model.register_comm_hook(None, hook)
                raised = None
            except Exception as e:  # noqa: BLE001  (the type is what is compared)
                raised = (type(e).__name__, str(e))
            data = model._get_ddp_logging_data()
            seen.append({"raised": raised, "has_error": data.get("has_error"),
                         "error": data.get("error")})
        assert seen[0]["raised"] is not None, f"{case}: torch DDP accepted it"
        assert seen[1] == seen[0], f"{case}: fastddp {seen[1]} != torch DDP {seen[0]}"
        out.append(seen[1])
    return out
