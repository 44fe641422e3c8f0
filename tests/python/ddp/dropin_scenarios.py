"""Scenarios for the places where fastddp used to differ from torch DDP, each run side by
side with torch DDP (the reference) on every rank of a harness world."""

import copy
import io
import os
import pickle
import threading
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.ddp.errors_scenarios import TwoHeads
from tests.python.scenarios import (ConvNet, agree, compare_grads, image_batch, mlp, side_by_side,
                                    train, vector_batch)


def clone_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages a clone of the bucket: the result is a new tensor, not the bucket."""
    flat = bucket.buffer().clone()
    work = dist.all_reduce(flat, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0] / dist.get_world_size())


def hook_returns_new_tensor() -> None:
    """channels_last parameters: the hook's flat result must be read through each
    parameter's strides, as the bucket was filled."""
    ref, fast = side_by_side(lambda: ConvNet().to(memory_format=torch.channels_last),
                             bucket_cap_mb=0.001)
    for model in (ref, fast):
        model.register_comm_hook(None, clone_hook)
    train(ref, fast, batch=image_batch, strides=True)


def counting_hook(calls: list[int]):
    """A user hook with a side effect: it counts its calls (in `calls`)."""

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(bucket.index())
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer() * 0.5)  # visible in the grads: halves them
        return fut

    return hook


def hook_at_world_size_one() -> dict[str, int]:
    assert dist.get_world_size() == 1
    ref, fast = side_by_side(mlp)
    calls: tuple[list[int], list[int]] = ([], [])
    ref.register_comm_hook(None, counting_hook(calls[0]))
    fast.register_comm_hook(None, counting_hook(calls[1]))
    train(ref, fast)
    assert calls[1] and len(calls[1]) == len(calls[0]), (
        f"the hook ran {len(calls[1])} times under fastddp, {len(calls[0])} under torch")
    return {"torch": len(calls[0]), "fastddp": len(calls[1])}


def world1_reducer_requested() -> list[list[str]]:
    """FASTDDP_WORLD1_REDUCER=1: the full reducer path on one rank, no hook registered,
    trains as torch DDP does."""
    assert dist.get_world_size() == 1
    os.environ["FASTDDP_WORLD1_REDUCER"] = "1"
    try:
        ref, fast = side_by_side(mlp, bucket_cap_mb=0.001)
    finally:
        del os.environ["FASTDDP_WORLD1_REDUCER"]
    assert fast._reducer is not None, "FASTDDP_WORLD1_REDUCER=1 built no reducer"
    train(ref, fast)
    assert fast.comm_stats()["steps"] == 5, fast.comm_stats()
    return fast.bucket_plan()


def powersgd_at_world_size_one() -> None:
    """PowerSGD compresses at world size 1 under torch: the grads are low-rank."""
    assert dist.get_world_size() == 1
    ref, fast = side_by_side(mlp, bucket_cap_mb=100)  # one bucket: torch's hook waits inside
    for model in (ref, fast):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2, min_compression_rate=0.5,
                                            use_error_feedback=False, warm_start=False)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    # fastddp runs torch's hook natively: its P = M Q, norm and Q = M^T P are float sums of
    # at most 32 terms in other orders than torch's (the norm in double), each off by about
    # sqrt(32) u: 8 ulps of the largest gradient (measured 2.8).
    train(ref, fast, steps=4, ulps=8)
    assert torch.linalg.matrix_rank(fast.module[2].weight.grad) == 1


def inplace_on_output(find_unused_parameters: bool, static_graph: bool) -> None:
    """HF Trainer scales the loss in place; torch's output sink clones, so that works."""
    ref, fast = side_by_side(mlp, find_unused_parameters=find_unused_parameters,
                             static_graph=static_graph)
    for step in range(3):
        inputs, target = vector_batch(step)
        for model in (ref, fast):
            out = model(inputs)
            out.mul_(0.5)
            F.mse_loss(out, target).backward()
        agree(lambda: compare_grads(ref.module, fast.module, f"step {step}"))


def raising_hook_then_recovery() -> str:
    """A hook that raises: backward raises that error, and the next iteration works."""
    calls = {"n": 0}

    def flaky(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("flaky hook failed on purpose")
        return clone_hook(state, bucket)

    torch.manual_seed(0)
    fast = fastddp.DistributedDataParallel(mlp())
    fast.register_comm_hook(None, flaky)
    inputs, target = vector_batch(0)
    try:
        F.mse_loss(fast(inputs), target).backward()
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError("the hook's error did not reach backward()")
    ref = TorchDDP(copy.deepcopy(fast.module))
    ref.register_comm_hook(None, clone_hook)
    train(ref, fast, steps=2)
    return message


def comm_stats_reader_thread() -> int:
    """A thread reading comm_stats() while another trains with a Python hook: no deadlock."""
    torch.manual_seed(0)
    fast = fastddp.DistributedDataParallel(mlp(), bucket_cap_mb=0.001)
    fast.register_comm_hook(None, clone_hook)
    stop = threading.Event()
    reads = {"n": 0}

    def reader() -> None:
        while not stop.is_set():
            fast.comm_stats()
            fast.bucket_plan()
            reads["n"] += 1

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    opt = torch.optim.SGD(fast.parameters(), lr=0.01)
    for step in range(20):
        inputs, target = vector_batch(step)
        opt.zero_grad()
        F.mse_loss(fast(inputs), target).backward()
        opt.step()
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the comm_stats() reader did not finish"
    return reads["n"]


class SparseModel(nn.Module):
    """An nn.Embedding with sparse gradients beside dense layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8, sparse=True)
        self.dense = nn.Linear(8, 4)
        self.unused = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(torch.tanh(self.embed(x).mean(1)))


def sparse_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(0, 50, (6, 3), generator=g), torch.randn(6, 4, generator=g)


def sparse_gradients(hook: str, find_unused_parameters: bool) -> None:
    """Sparse gradients get a bucket of their own and a sparse allreduce, as in torch."""
    torch.manual_seed(0)
    base = SparseModel()
    if not find_unused_parameters:
        base.unused.requires_grad_(False)
    models = [cls(copy.deepcopy(base), find_unused_parameters=find_unused_parameters)
              for cls in (TorchDDP, fastddp.DistributedDataParallel)]
    if hook == "python":
        for model in models:
            model.register_comm_hook(None, clone_sparse_hook)
    for step in range(3):
        inputs, target = sparse_batch(step)
        for model in models:
            model.zero_grad()
            F.mse_loss(model(inputs), target).backward()
        ref, fast = (m.module.embed.weight.grad for m in models)
        agree(lambda: _same_sparse(ref, fast, step))
        agree(lambda: compare_grads(models[0].module.dense, models[1].module.dense, f"{step}"))


def clone_sparse_hook(state: object,
                      bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A Python hook on any bucket: a new averaged tensor (sparse or dense)."""
    tensor = bucket.buffer().clone() / dist.get_world_size()
    work = dist.all_reduce(tensor, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _same_sparse(ref: torch.Tensor, fast: torch.Tensor, step: int) -> None:
    assert fast.is_sparse, f"step {step}: fastddp's embedding grad is dense"
    # Bit for bit: both gather every rank's indices and values and sum the same duplicates
    # in the same order.
    torch.testing.assert_close(fast.to_dense(), ref.to_dense(), rtol=0, atol=0,
                               msg=lambda m: f"step {step}: sparse grad: {m}")


def serialized(how: str) -> None:
    """torch.save(model), copy.deepcopy and pickle give a model that trains as torch's
    copy does."""
    ref, fast = side_by_side(mlp)
    train(ref, fast, steps=2)
    copies = []
    for model in (ref, fast):
        if how == "deepcopy":
            copies.append(copy.deepcopy(model))
        elif how == "pickle":
            copies.append(pickle.loads(pickle.dumps(model)))
        else:
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            copies.append(torch.load(buffer, weights_only=False))
    assert type(copies[1]) is type(fast), type(copies[1])
    train(*copies, steps=3)


def serialized_with_hook() -> None:
    """The registered hook survives a deepcopy (torch drops it with its reducer; fastddp
    keeps what goes on the wire)."""
    torch.manual_seed(0)
    fast = fastddp.DistributedDataParallel(mlp())
    fast.register_comm_hook(None, fastddp.hooks.bf16())
    twin = copy.deepcopy(fast)
    assert twin._reducer.hook_name == "bf16", twin._reducer.hook_name


def pickle_with_subgroup() -> str:
    group = dist.new_group(list(range(dist.get_world_size())))
    fast = fastddp.DistributedDataParallel(mlp(), process_group=group)
    try:
        pickle.dumps(fast)
    except RuntimeError as e:
        return str(e)
    raise AssertionError("pickling a model on a non-default group did not raise")


def create_graph() -> list[str]:
    """torch's test_ddp_create_graph, side by side: grads equal, grads require grad."""

    class Square(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Parameter(torch.tensor(1.0 + dist.get_rank()))

        def forward(self) -> torch.Tensor:
            return self.p.pow(2)

    torch.manual_seed(0)
    ref, fast = TorchDDP(Square()), fastddp.DistributedDataParallel(Square())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            for model in (ref, fast):
                model().backward(create_graph=True)
            agree(lambda: compare_grads(ref.module, fast.module, f"step {step}"))
            assert fast.module.p.grad.requires_grad
    return [str(w.message) for w in caught if "create_graph" in str(w.message)]


def logging_data_any_group() -> list[int]:
    """A process group built directly (not through new_group, so dist.get_rank(group)
    does not know it) still gives logging data, as under torch DDP."""
    store = dist.PrefixStore("fastddp_direct_group", dist.distributed_c10d._get_default_store())
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.ProcessGroup(store, rank, size)
    backend = dist.ProcessGroupGloo(store, rank, size)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    torch.manual_seed(0)
    ref = TorchDDP(mlp(), process_group=group)
    fast = fastddp.DistributedDataParallel(mlp(), process_group=group)
    return [model._get_ddp_logging_data()["rank"] for model in (ref, fast)]


def error_logged() -> None:
    """torch's verify_ddp_error_logged on the prior-reduction error."""
    # Imported here: torch's test utilities need expecttest, which a bare GPU machine lacks,
    # and this module's GPU scenarios must import there (test_error_logged_as_torch skips).
    from torch.testing._internal.common_distributed import verify_ddp_error_logged

    fast = fastddp.DistributedDataParallel(TwoHeads())
    inputs, _ = vector_batch(0)
    fast(inputs)[0].sum().backward()
    try:
        fast(inputs)
    except RuntimeError as e:
        verify_ddp_error_logged(fast, str(e))
    else:
        raise AssertionError("no prior-reduction error")


def device_clock_stats() -> dict:
    """comm_stats() on a GPU: device times (CUDA events), in the order the points happen."""
    os.environ["FASTDDP_WORLD1_REDUCER"] = "1"
    try:
        torch.manual_seed(0)
        fast = fastddp.DistributedDataParallel(mlp().cuda(), bucket_cap_mb=0.001)
    finally:
        del os.environ["FASTDDP_WORLD1_REDUCER"]
    for step in range(3):
        inputs, target = vector_batch(step, device="cuda")
        F.mse_loss(fast(inputs), target).backward()
        torch.cuda.synchronize()  # so that the reads find this step's events complete
    stats = fast.comm_stats()
    assert stats["clock"] == "device", stats
    # Steps 1-3 are sampled (torch's logger samples 1 to 10): the figures are the last one's.
    assert stats["timed_iteration"] == 3, stats
    for b in stats["buckets"]:
        assert 0 <= b["ready_ms"] <= b["launched_ms"] <= b["done_ms"], b
    # The device mean, over the 3 steps; a host mean would include launch latency. Under
    # 1 s: a check of the unit (ms, not us), not of speed.
    assert 0 <= stats["mean_exposed_comm_ms"] < 1e3, stats
    return stats


class StoresLoss(nn.Module):
    """A forward that returns no tensor: the loss is left on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.loss: torch.Tensor | None = None

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> None:
        self.loss = F.mse_loss(self.net(inputs), target)


def static_graph_without_outputs() -> None:
    """static_graph=True when forward returns nothing to hang the output sink on: the first
    iteration still reduces (queued from the first gradient hook). Reference: torch DDP
    without static_graph (torch's own static graph leaves that iteration unreduced)."""
    torch.manual_seed(0)
    base = StoresLoss()
    ref = TorchDDP(copy.deepcopy(base))
    fast = fastddp.DistributedDataParallel(copy.deepcopy(base), static_graph=True)
    for step in range(3):
        inputs, target = vector_batch(step)
        for model in (ref, fast):
            model.zero_grad()
            model(inputs, target)
            model.module.loss.backward()
        agree(lambda: compare_grads(ref.module, fast.module, f"step {step}"))

