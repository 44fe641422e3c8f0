"""The CUDA kernels' launch paths that issue 32's roofline work added (csrc/kernels/cuda/):
each against torch's own casts and sums or against fastddp's CPU kernels of the same
arithmetic, bit for bit, at sizes that make the grid stride (more work than one wave of
blocks) and with the aligned, unaligned and short-tail cases that choose between the vector
and the scalar paths. GPU-marked: run by `make gpu-check`."""

import pytest
import torch

from fastddp import _C

pytestmark = pytest.mark.gpu

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("name", HALF)
def test_decompress_many_ranges_and_a_long_one(name):
    # 50 ranges: more than one launch's table (48). One of 20M elements: more chunks of
    # 16K than a device-filling grid has blocks, so blocks stride. Odd offsets make some
    # destinations unaligned (the scalar path inside a chunk).
    g = torch.Generator().manual_seed(1)
    sizes = [int(s) for s in torch.randint(1, 70_000, (49,), generator=g)] + [20_000_000]
    srcs = [torch.randn(n, generator=g).to(HALF[name]).cuda() for n in sizes]
    flat = torch.empty(sum(sizes) + 50, device="cuda")
    dsts, pos = [], 0
    for k, n in enumerate(sizes):
        pos += k % 2  # every other range starts one float later
        dsts.append(flat[pos:pos + n])
        pos += n
    _C.half_decompress_into(srcs, dsts)
    torch.cuda.synchronize()
    for s, d in zip(srcs, dsts):
        assert torch.equal(d, s.float())


@pytest.mark.parametrize("name", HALF)
@pytest.mark.parametrize("n", [4 * 3000, 4 * 3_000_000, 4099])
def test_sum_shards_vector_and_scalar(name, n):
    # n % 4 == 0: 8-byte loads from every shard; 4099: the element-by-element kernel.
    g = torch.Generator().manual_seed(n)
    shards = (torch.randn(4, n, generator=g) * 1e-3).to(HALF[name]).cuda()
    total = shards[0].float()
    for r in range(1, 4):  # torch's float32 adds in shard order, rounded once at the end
        total = total + shards[r].float()
    assert torch.equal(_C.half_sum_shards(shards).view(torch.int16),
                       total.to(HALF[name]).view(torch.int16))


def spread(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    x *= torch.exp2(torch.randint(-20, 20, (n // 256 + 1,), generator=g).float()
                    ).repeat_interleave(256)[:n]  # blocks of very different magnitudes
    x[::997] = 0.0
    return x


@pytest.mark.parametrize("fmt", ["int8", "e4m3", "e5m2"])
@pytest.mark.parametrize("n,offset", [(256 * 9000 + 37, 0), (256 * 40 + 3, 1), (256 * 8, 0)])
def test_quantize_and_dequantize_paths(fmt, n, offset):
    # offset 0: the warp-per-block kernel for whole blocks of 256 (9000 blocks: more warps
    # than one wave), then the short last block; offset 1: src 4 bytes past 16-byte
    # alignment, the general kernel throughout. The CPU kernels are the reference.
    x = spread(n + offset)[offset:]
    codes, scales, err = _C._quantize8(x, fmt, 256, error=True)
    xc = spread(n + offset).cuda()[offset:]
    c_cuda, s_cuda, e_cuda = _C._quantize8(xc, fmt, 256, error=True)
    assert torch.equal(c_cuda.cpu(), codes)
    assert same(s_cuda.cpu(), scales) and same(e_cuda.cpu(), err)
    for block in (256, 64, 100):  # shift path, shift path, division path
        c, s = _C._quantize8(x, fmt, block)
        want = _C._dequantize8(c, s, fmt, block)
        assert same(_C._dequantize8(c.cuda(), s.cuda(), fmt, block).cpu(), want)
        # Codes one byte past a 4-byte boundary (the element-by-element kernel), read as
        # blocks that start there: the same on both devices.
        k = -(-(c.numel() - 1) // block)
        got = _C._dequantize8(c.cuda()[1:], s.cuda()[:k], fmt, block)
        assert same(got.cpu(), _C._dequantize8(c[1:], s[:k], fmt, block))


def test_the_side_stream_is_fastddps_own():
    # Note [hook streams]: one stream per device, created by fastddp, so not one of the
    # pool's that torch.cuda.Stream() (and any other library) hands out round-robin, and
    # the same for the life of the process (one cuBLAS workspace for PowerSGD's products).
    ids = _C._side_stream("cuda:0")
    assert ids == _C._side_stream("cuda:0")
    ours = torch.cuda.Stream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])
    assert ours.device == torch.device("cuda:0")
    pool = {torch.cuda.Stream(device=0, priority=p).cuda_stream for p in (0, -1)
            for _ in range(40)}  # the pool has 32 streams per priority
    assert ours.cuda_stream not in pool
    assert ours.cuda_stream not in (0, torch.cuda.current_stream(0).cuda_stream)


def test_tall_orthogonalization_path_runs_on_cuda():
    # From 8192 rows and rank 3 the CUDA kernels take CholeskyQR2 over row blocks (Note
    # [tall orthogonalization]); test_orthogonalize.py checks its numbers against torch's QR.
    from tests.python.hooks.test_orthogonalize import ran_tall_path, random_batch

    assert ran_tall_path(random_batch(2, 70_000, 4, torch.float32, 0).cuda())
    assert not ran_tall_path(random_batch(2, 8191, 4, torch.float32, 0).cuda())
