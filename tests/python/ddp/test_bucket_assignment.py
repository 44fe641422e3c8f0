"""fastddp's bucket planner gives torch's buckets: same arguments, same result as
torch.distributed._compute_bucket_assignment_by_size. No processes needed."""

import random

import pytest
import torch
import torch.distributed as dist

from fastddp import _C

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Byte limits from "close after every tensor" to "never close", small enough to matter
# for the tensor sizes below.
LIMITS = [0, 1, 64, 1000, 4096, 20_000, 1 << 20, 2**63 - 1]


def random_tensors(rng: random.Random, dtypes: list[torch.dtype],
                   devices: tuple[str, ...] = ("cpu",)) -> list[torch.Tensor]:
    # 'meta' tensors have a size and a dtype but no storage: cheap, and a second device.
    return [torch.empty(rng.choice([0, 1, 7, 100, 1000, 5000]), dtype=rng.choice(dtypes),
                        device=rng.choice(devices))
            for _ in range(rng.randint(1, 40))]


def random_limits(rng: random.Random) -> list[int]:
    return [rng.choice(LIMITS) for _ in range(rng.randint(1, 3))]


def both(*args, **kwargs) -> tuple[object, object]:
    ours = _C.compute_bucket_assignment_by_size(*args, **kwargs)
    theirs = dist._compute_bucket_assignment_by_size(*args, **kwargs)
    return tuple(ours), tuple(theirs)


@pytest.mark.parametrize("seed", range(25))
def test_mixed_dtypes_and_devices(seed):
    rng = random.Random(seed)
    tensors = random_tensors(rng, DTYPES, devices=("cpu", "meta"))
    ours, theirs = both(tensors, random_limits(rng))
    assert ours == theirs


@pytest.mark.parametrize("seed", range(10))
def test_expect_sparse_gradient(seed):
    rng = random.Random(seed)
    tensors = random_tensors(rng, DTYPES[:2])
    sparse = [rng.random() < 0.2 for _ in tensors]
    ours, theirs = both(tensors, random_limits(rng), sparse)
    assert ours == theirs


@pytest.mark.parametrize("seed", range(25))
def test_tensor_indices_single_dtype(seed):
    # With tensor_indices (the grad-ready order of a rebuild) torch leaves unfinished
    # buckets in hash-map order across dtypes, so only one dtype has a defined answer.
    rng = random.Random(seed)
    tensors = random_tensors(rng, [rng.choice(DTYPES)])
    order = list(range(len(tensors)))
    rng.shuffle(order)
    sparse = [rng.random() < 0.1 for _ in tensors] if seed % 2 else []
    ours, theirs = both(tensors, random_limits(rng), sparse, order)
    assert ours == theirs


def test_ddp_default_limits():
    # The limits DDP itself uses: 1 MiB first bucket, then 25 MiB, over a model-like list.
    tensors = [torch.empty(n, dtype=torch.float32, device="meta")
               for n in [512 * 512, 512, 1024 * 512, 1024, 4096 * 1024, 4096, 10] * 6]
    ours, theirs = both(tensors, [1 << 20, 25 << 20])
    assert ours == theirs and len(ours[0]) > 2


def test_empty_limit_list_is_rejected():
    with pytest.raises(ValueError):
        _C.compute_bucket_assignment_by_size([torch.empty(3)], [])


@pytest.mark.parametrize("seed", range(10))
def test_initial_plan_is_what_torch_ddp_hands_its_reducer(seed):
    # torch DDP's constructor: `reversed(dist._compute_bucket_assignment_by_size(...)[0])`
    # goes to its Reducer. fastddp's constructor passes _C.initial_bucket_plan on as it is.
    rng = random.Random(seed)
    tensors = random_tensors(rng, DTYPES, devices=("cpu", "meta"))
    limits = random_limits(rng)
    sparse = [rng.random() < 0.2 for _ in tensors] if seed % 2 else []
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, limits, sparse)
    assert _C.initial_bucket_plan(tensors, limits, sparse) == list(reversed(theirs))
    with pytest.raises(ValueError):
        _C.initial_bucket_plan(tensors, [])
