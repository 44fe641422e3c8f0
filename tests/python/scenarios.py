"""Training scenarios, run on every rank of a harness world (see harness.py).

A module shared by every folder, not one test's: ddp/test_parity.py runs its scenarios, and
the scenario modules beside the other tests build on its models, batches and comparisons
(``from tests.python.scenarios import agree, mlp``).

Each builds one model from a seed, wraps a deep copy in torch DDP and another in
fastddp.DistributedDataParallel with the same arguments, trains both with the same
per-rank data, and compares grads after every backward and parameters and buffers
after every optimizer step.
"""

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp

# Gradients and parameters against torch DDP's. 2 ranks add their gradients in the one
# order there is (a + b = b + a), so every number is torch's, bit for bit. On 3 or more,
# gloo's ring adds the ranks in an order set by how it chunks each buffer, which follows
# the bucket layout (a rebuilt or padded layout is not torch's): each of a sum's additions
# may then round differently, at most 2 eps of the ranks' sum of |gradients| per element on
# 3 ranks, about the largest |gradient|; an SGD step (lr 0.05) passes on no more. ULPS of
# a tensor's largest |element| (float32 ulps for the half types, which reduce in one order
# here: bit for bit); measured at most 1.6.
ULPS = 4
STEPS = 5
MIB = 1024 * 1024
Batch = tuple[torch.Tensor, torch.Tensor]


# --- models -------------------------------------------------------------------------

def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


class Tied(nn.Module):
    """`mix.weight` is also `decode.weight`: one parameter used twice per forward."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(8, 16)
        self.mix = nn.Linear(16, 16)
        self.decode = nn.Linear(16, 16)
        self.decode.weight = self.mix.weight
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(torch.tanh(self.encode(x))))
        return self.head(torch.tanh(self.decode(h)))


def with_batchnorm() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def partly_frozen() -> nn.Module:
    model = mlp()
    model[2].requires_grad_(False)  # in the middle: its input still needs a grad
    model[0].bias.requires_grad_(False)
    return model


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.head = nn.Linear(8 * 3 * 3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.head(h.flatten(1))


class MixedDtypes(nn.Module):
    """A float64 submodule between float32 ones: buckets must not mix dtypes."""

    def __init__(self):
        super().__init__()
        self.single = nn.Linear(8, 16)
        self.precise = nn.Linear(16, 16).double()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.precise(torch.tanh(self.single(x)).double()))
        return self.head(h.float())


class OutOfOrder(nn.Module):
    """Registered head first but used last: the grad-ready order is neither the
    registration order nor its reverse, so a rebuild visibly changes the buckets."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(32, 4)
        self.body1 = nn.Linear(8, 32)
        self.body2 = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body2(torch.tanh(self.body1(x)))))


class RankDependentOrder(nn.Module):
    """Even ranks apply `a` then `b`, odd ranks `b` then `a`: their grads become ready in
    different orders, so the ranks' own rebuilt plans differ."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.a, self.b) if dist.get_rank() % 2 == 0 else (self.b, self.a)
        return self.head(torch.tanh(second(torch.tanh(first(torch.tanh(self.stem(x)))))))


# --- data and checks ----------------------------------------------------------------

def vector_batch(step: int, features: int = 8, device: str = "cpu") -> Batch:
    """Six samples, different on every rank and every step."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return (torch.randn(6, features, generator=g).to(device),
            torch.randn(6, 4, generator=g).to(device))


def image_batch(step: int) -> Batch:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    images = torch.randn(4, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
    return images, torch.randn(4, 4, generator=g)


def agree(check: Callable[[], None]) -> None:
    """Runs a local check, then fails on every rank if it failed on any: no rank walks on
    into a collective that a failed rank would never join."""
    try:
        check()
        mine = None
    except AssertionError as e:
        mine = str(e)
    failures: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, mine)
    bad = [f"rank {r}: {m}" for r, m in enumerate(failures) if m is not None]
    if bad:
        raise AssertionError("\n".join(bad))


def rounding_ulps() -> int:
    """What ULPS allows in this world: nothing on 1 or 2 ranks."""
    return 0 if dist.get_world_size() <= 2 else ULPS


def assert_close_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int,
                      msg: Callable[[str], str] | str | None = None) -> None:
    """Within `ulps` ulps of `expected`'s largest |element| (0: bit for bit)."""
    atol = 0.0
    if ulps and expected.is_floating_point() and expected.numel():
        eps = min(torch.finfo(expected.dtype).eps, torch.finfo(torch.float32).eps)
        atol = ulps * eps * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, msg=msg)


def compare_grads(ref: nn.Module, fast: nn.Module, where: str, strides: bool = False,
                  ulps: int | None = None) -> None:
    ulps = rounding_ulps() if ulps is None else ulps
    for (name, p), q in zip(ref.named_parameters(), fast.parameters(), strict=True):
        if p.grad is None or q.grad is None:
            assert p.grad is None and q.grad is None, (
                f"{where}: {name}.grad is {_none(q.grad)} under fastddp but "
                f"{_none(p.grad)} under torch DDP")
            continue
        assert_close_ulps(q.grad, p.grad, ulps, msg=lambda m: f"{where}: grad of {name}: {m}")
        if strides:
            assert q.grad.stride() == p.grad.stride(), (
                f"{where}: grad of {name} has strides {q.grad.stride()} under fastddp but "
                f"{p.grad.stride()} under torch DDP")


def compare_state(ref: nn.Module, fast: nn.Module, where: str, ulps: int | None = None) -> None:
    """Parameters and buffers (BatchNorm statistics included)."""
    ulps = rounding_ulps() if ulps is None else ulps
    theirs, ours = ref.state_dict(), fast.state_dict()
    assert list(ours) == list(theirs), f"{where}: state_dict keys differ"
    for name, value in theirs.items():
        assert_close_ulps(ours[name], value, ulps, msg=lambda m: f"{where}: {name}: {m}")


def _none(grad: torch.Tensor | None) -> str:
    return "None" if grad is None else "set"


def side_by_side(build: Callable[[], nn.Module], device: str = "cpu",
                 **ddp_kwargs) -> tuple[TorchDDP, fastddp.DistributedDataParallel]:
    torch.manual_seed(0)
    base = build().to(device)
    return (TorchDDP(copy.deepcopy(base), **ddp_kwargs),
            fastddp.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs))


def train(ref: nn.Module, fast: nn.Module, batch: Callable[[int], Batch] = vector_batch,
          steps: int = STEPS, set_to_none: bool = True, strides: bool = False,
          after_backward: Callable[[int], None] | None = None, ulps: int | None = None) -> None:
    """Trains `ref` and `fast` side by side; compares after each backward and step (within
    `ulps`, by default rounding_ulps()). Works on DDP wrappers and on bare modules alike."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fast)]
    for step in range(steps):
        inputs, target = batch(step)
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad(set_to_none=set_to_none)
            F.mse_loss(model(inputs), target).backward()
        agree(lambda: compare_grads(unwrap(ref), unwrap(fast), f"step {step}", strides, ulps))
        if after_backward is not None:
            agree(lambda: after_backward(step))
        for opt in opts:
            opt.step()
        agree(lambda: compare_state(unwrap(ref), unwrap(fast), f"after step {step}", ulps))


def step_grads(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> list[torch.Tensor]:
    """One training step (zero_grad, MSE loss, backward, opt.step) on `batch`; returns
    clones of the gradients the step applied."""
    inputs, target = batch
    opt.zero_grad()
    F.mse_loss(model(inputs), target).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return grads


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def torch_rebuilt_plan(ref: TorchDDP) -> list[list[str]]:
    """Torch's rebuilt buckets, as parameter names, from its logging data."""
    names = [n for n, p in ref.module.named_parameters() if p.requires_grad]
    text = ref._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    return [[names[int(i)] for i in bucket.split()] for bucket in text.split(",")]


def same_on_all_ranks(value: object) -> None:
    values: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    assert all(v == values[0] for v in values), f"ranks disagree: {values}"


# --- scenarios ----------------------------------------------------------------------

def train_mlp(**ddp_kwargs) -> None:
    train(*side_by_side(mlp, **ddp_kwargs))


def tiny_buckets() -> list[list[str]]:
    # 0.0001 MiB = 104 bytes: every weight and most biases get a bucket of their own.
    ref, fast = side_by_side(mlp, bucket_cap_mb=0.0001)
    train(ref, fast)
    plan = fast.bucket_plan()
    agree(lambda: _expect(len(plan) > 3, f"only {len(plan)} buckets: {plan}"))
    agree(lambda: _expect(plan == torch_rebuilt_plan(ref),
                          f"fastddp {plan} != torch {torch_rebuilt_plan(ref)}"))
    return plan


def bucket_view(set_to_none: bool) -> None:
    ref, fast = side_by_side(mlp, bucket_cap_mb=0.001, gradient_as_bucket_view=True)
    params = dict(fast.module.named_parameters())

    def grads_live_in_buckets(step: int) -> None:
        # One flat buffer per dtype (Note [aligned flat buffer]): each bucket a range of it.
        storages, ranges = set(), []
        for bucket in fast.bucket_plan():
            grads = [params[n].grad for n in bucket]
            storages |= {g.untyped_storage().data_ptr() for g in grads}
            ranges.append((min(g.data_ptr() for g in grads),
                           max(g.data_ptr() + g.numel() * g.element_size() for g in grads)))
        assert len(storages) == 1, f"step {step}: grads in {len(storages)} storages"
        ranges.sort()
        overlaps = [(a, b) for a, b in zip(ranges, ranges[1:]) if a[1] > b[0]]
        assert not overlaps, f"step {step}: buckets overlap: {overlaps}"

    train(ref, fast, set_to_none=set_to_none, after_backward=grads_live_in_buckets)
    agree(lambda: _expect(len(fast.bucket_plan()) > 1, "expected several buckets"))


def no_sync_accumulation(micro_batches: int, set_to_none: bool = True, **ddp_kwargs) -> None:
    # BatchNorm too: buffers broadcast only in the first forward after a synced one, so
    # the no_sync bookkeeping shows in the running statistics as well as in the grads.
    ref, fast = side_by_side(with_batchnorm, **ddp_kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fast)]
    for step in range(4):
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad(set_to_none=set_to_none)
            with model.no_sync():
                for k in range(micro_batches):
                    F.mse_loss(*_forward(model, vector_batch(10 * step + k))).backward()
        # Local sums only so far: compared before any synchronized backward mixes ranks.
        agree(lambda: compare_grads(ref.module, fast.module, f"step {step} under no_sync"))
        for model in (ref, fast):
            F.mse_loss(*_forward(model, vector_batch(10 * step + micro_batches))).backward()
        agree(lambda: compare_grads(ref.module, fast.module, f"step {step} synced"))
        for opt in opts:
            opt.step()
        agree(lambda: compare_state(ref.module, fast.module, f"after step {step}"))


def tied_weights() -> None:
    ref, fast = side_by_side(Tied, bucket_cap_mb=0.001)
    assert fast.module.decode.weight is fast.module.mix.weight
    train(ref, fast)


def batchnorm_buffers(broadcast_buffers: bool) -> None:
    ref, fast = side_by_side(with_batchnorm, broadcast_buffers=broadcast_buffers)
    train(ref, fast)
    # Eval mode uses the running statistics that the buffer broadcasts shaped.
    inputs, _ = vector_batch(99)
    with torch.no_grad():
        assert_close_ulps(fast.eval()(inputs), ref.eval()(inputs), rounding_ulps())


def frozen_parameters() -> None:
    ref, fast = side_by_side(partly_frozen)
    frozen = {n: p.detach().clone() for n, p in fast.module.named_parameters()
              if not p.requires_grad}
    train(ref, fast)
    for name, p in fast.module.named_parameters():
        if name in frozen:
            assert p.grad is None, f"frozen {name} got a grad"
            assert torch.equal(p, frozen[name]), f"frozen {name} changed"
    assert all(name not in frozen for bucket in fast.bucket_plan() for name in bucket)


def channels_last(gradient_as_bucket_view: bool) -> None:
    ref, fast = side_by_side(lambda: ConvNet().to(memory_format=torch.channels_last),
                             bucket_cap_mb=0.001,
                             gradient_as_bucket_view=gradient_as_bucket_view)
    train(ref, fast, batch=image_batch, strides=True)
    weight = fast.module.conv1.weight
    assert weight.grad.is_contiguous(memory_format=torch.channels_last), weight.grad.stride()


def mixed_dtypes(**ddp_kwargs) -> None:
    ref, fast = side_by_side(MixedDtypes, **ddp_kwargs)
    assert fast.module.precise.weight.dtype == torch.float64
    train(ref, fast)
    params = dict(fast.module.named_parameters())
    for bucket in fast.bucket_plan():
        assert len({params[n].dtype for n in bucket}) == 1, f"bucket {bucket} mixes dtypes"


def world_size_one() -> None:
    assert dist.get_world_size() == 1
    torch.manual_seed(0)
    base = mlp()
    plain, fast = copy.deepcopy(base), fastddp.DistributedDataParallel(copy.deepcopy(base))
    assert fast._reducer is None, "a 1-rank world needs no reducer"
    assert fast.bucket_plan() == []
    train(plain, fast)


def bucket_rebuild(model: str) -> list[list[str]]:
    """`out_of_order`: the ready order differs from registration order. `rank_dependent`:
    it also differs between ranks, and every rank must adopt rank 0's plan, as torch does."""
    build, cap_mb = {"out_of_order": (OutOfOrder, 0.002),
                     "rank_dependent": (RankDependentOrder, 0.001)}[model]
    ref, fast = side_by_side(build, bucket_cap_mb=cap_mb)
    names = [n for n, _ in fast.module.named_parameters()]
    # Before any backward, one bucket per dtype, as torch starts.
    assert fast.bucket_plan() == [names], fast.bucket_plan()

    # The plan torch's rebuild makes from the grad-ready order, seen on a bare copy.
    probe = copy.deepcopy(fast.module)
    params, order = list(probe.parameters()), []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _, i=i: order.append(i))
    F.mse_loss(*_forward(probe, vector_batch(0))).backward()
    limits = [int(cap_mb * MIB)] * 2  # an explicit bucket_cap_mb also caps the first bucket
    indices, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], limits, tensor_indices=order)
    local = [[names[i] for i in bucket] for bucket in indices]
    plans: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(plans, local)
    expected = plans[0]
    assert expected != [names], "the model should make the rebuild visible"
    if model == "rank_dependent" and dist.get_rank() % 2 == 1:
        assert local != expected, "rank 1's own plan should differ from rank 0's"

    def plan_is_rebuilt(step: int) -> None:
        # The rebuild happens in the second forward; from then on the plan stays. Torch's
        # logger publishes its rebuilt plan one forward later.
        if step >= 1:
            assert fast.bucket_plan() == expected, f"{fast.bucket_plan()} != {expected}"
        if step >= 2:
            assert fast.bucket_plan() == torch_rebuilt_plan(ref)

    train(ref, fast, after_backward=plan_is_rebuilt)
    agree(lambda: same_on_all_ranks(fast.bucket_plan()))
    return fast.bucket_plan()


def identity() -> list[str]:
    torch.manual_seed(0)
    module = nn.Sequential(Tied(), nn.BatchNorm1d(4))
    ref = TorchDDP(copy.deepcopy(module))
    fast = fastddp.DistributedDataParallel(module)
    assert isinstance(fast, TorchDDP)
    assert fast.module is module
    keys = list(fast.state_dict())
    assert keys == list(ref.state_dict()), f"{keys} != {list(ref.state_dict())}"
    ref.load_state_dict(fast.state_dict())  # strict: the same keys and shapes
    return keys


def cuda_parity(**ddp_kwargs) -> None:
    """On the GPU: grads, params and write-back (multi-tensor copy) against torch DDP."""
    ref, fast = side_by_side(mlp, device="cuda", device_ids=[0], **ddp_kwargs)
    train(ref, fast, batch=lambda step: vector_batch(step, device="cuda"))


def _forward(model: nn.Module, batch: Batch) -> Batch:
    inputs, target = batch
    return model(inputs), target


def _expect(condition: bool, message: str) -> None:
    assert condition, message
