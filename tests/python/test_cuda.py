"""GPU tests: the write-back kernel and DDP on CUDA against torch.

Every test carries the `gpu` marker; conftest.py skips them, at run time, where no GPU is
visible or fastddp was built without CUDA. Nothing here touches CUDA at import.
"""

import pytest
import torch

import scenarios
from fastddp import _C
from harness import World

pytestmark = pytest.mark.gpu

# Odd element counts, so that sizes in bytes are not multiples of the kernel's widest word.
ODD_SIZES = [1, 3, 7, 17, 255, 1023, 65_537, 200_003]


def copy_pairs(dtype: torch.dtype, src_shift: int, dst_shift: int, sizes: list[int]):
    """Sources and destinations carved from two flat buffers at shifted offsets (unaligned
    addresses for 1- and 2-byte types), with gaps that the copy must not touch."""
    gap = 5
    total = sum(sizes) + gap * (len(sizes) + 1) + max(src_shift, dst_shift)
    src_flat = (torch.arange(total, device="cuda") % 251).to(dtype)
    dst_flat = torch.full((total,), 7, device="cuda").to(dtype)
    srcs, dsts, offset = [], [], gap
    for n in sizes:
        srcs.append(src_flat[src_shift + offset : src_shift + offset + n])
        dsts.append(dst_flat[dst_shift + offset : dst_shift + offset + n])
        offset += n + gap
    return srcs, dsts, dst_flat


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shifts", [(0, 0), (1, 0), (0, 3), (5, 2)])
def test_multi_tensor_copy_odd_sizes_unaligned(dtype, shifts):
    srcs, dsts, dst_flat = copy_pairs(dtype, *shifts, ODD_SIZES)
    expected = dst_flat.clone()
    for s, d in zip(srcs, dsts):
        # What torch's own copy does to the same destination range.
        expected[d.storage_offset() : d.storage_offset() + d.numel()] = s
    _C.multi_tensor_copy(srcs, dsts)
    torch.cuda.synchronize()
    for s, d in zip(srcs, dsts):
        assert torch.equal(d, s)
    assert torch.equal(dst_flat, expected), "bytes outside the destination ranges changed"


def test_multi_tensor_copy_many_and_large_ranges():
    # More ranges than one launch carries (64) and more chunks than one launch's blocks
    # (320 x 64 KiB), plus empty ranges: the copy must split into several launches.
    sizes = [0, 3] + [1000 + 37 * i for i in range(150)] + [0, 6_000_001]
    srcs, dsts, _ = copy_pairs(torch.float32, 1, 2, sizes)
    _C.multi_tensor_copy(srcs, dsts)
    torch.cuda.synchronize()
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        assert torch.equal(d, s), f"range {i} of {len(sizes)} ({s.numel()} elements)"


def test_multi_tensor_copy_rejects_mismatched_pairs():
    a, b = torch.zeros(4, device="cuda"), torch.zeros(5, device="cuda")
    with pytest.raises(RuntimeError, match="pair 0"):
        _C.multi_tensor_copy([a], [b])


def test_nccl_single_process_ddp_matches_torch():
    world = World(1, backend="nccl")
    try:
        world.check(scenarios.cuda_parity)
        world.check(scenarios.cuda_parity, bucket_cap_mb=0.0001, gradient_as_bucket_view=True)
    finally:
        world.close()


def test_two_ranks_on_one_gpu_match_torch():
    # NCCL will not put two ranks on one GPU; gloo reduces CUDA tensors (through host
    # memory), which is enough to drive fastddp's CUDA write-back with a real reducer.
    world = World(2, backend="gloo")
    try:
        world.check(scenarios.cuda_parity)
        world.check(scenarios.cuda_parity, bucket_cap_mb=0.0001)
        world.check(scenarios.cuda_parity, bucket_cap_mb=0.0001, gradient_as_bucket_view=True)
        # The used-bitmap upload (pinned staging) and the delayed first static reduce.
        world.check(scenarios.cuda_parity, bucket_cap_mb=0.0001, find_unused_parameters=True)
        world.check(scenarios.cuda_parity, bucket_cap_mb=0.0001, static_graph=True)
    finally:
        world.close()


@pytest.mark.parametrize(("hook", "rank", "warm_start"), [
    ("powersgd", 1, True), ("powersgd", 4, True), ("powersgd", 2, False),
    ("batched_powersgd", 2, True)])
def test_powersgd_cuda_matches_cpu(hook, rank, warm_start):
    import hook_runner_scenarios

    world = World(2, backend="gloo")  # gloo reduces CUDA tensors through host memory
    try:
        assert world.check(hook_runner_scenarios.cuda_matches_cpu, hook=hook, rank=rank,
                           warm_start=warm_start)[0] == 3
    finally:
        world.close()
