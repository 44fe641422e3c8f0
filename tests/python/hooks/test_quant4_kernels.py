"""The 4-bit block quantization kernels (`_C.quantize4` / `_C.dequantize4` /
`_C.sum_shards4`, CPU) against the reference written from torch ops (quant4_reference.py:
``torch.clamp(torch.round(x / scale), -7, 7)``), bit for bit: codes, scales, dequantized
values, errors, shard sums, on adversarial blocks (zeros, negative zeros, an outlier,
subnormals, ties, NaN/Inf, odd n, a short last block). Under -m gpu the CUDA kernels
against the CPU ones and against the same torch reference run on CUDA tensors."""

import math

import pytest
import torch

from fastddp import _C
from tests.python.hooks import quant4_reference as ref
from tests.python.hooks.test_quant8_kernels import adversarial as adversarial8

BLOCKS = [256, 64, 100, 2]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def quantize4(x: torch.Tensor, block: int, error: bool = False):
    n = x.numel()
    codes = torch.empty((n + 1) // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(math.ceil(n / block), device=x.device)
    err = torch.empty_like(x) if error else None
    _C.quantize4(x, block, codes, scales, err)
    return (codes, scales, err) if error else (codes, scales)


def dequantize4(codes: torch.Tensor, scales: torch.Tensor, n: int, block: int) -> torch.Tensor:
    return _C.dequantize4(codes, scales, n, block, torch.empty(n, device=codes.device))


def adversarial(n: int = 256 * 12 + 101) -> torch.Tensor:
    """quant8's adversarial blocks (very different magnitudes, a zero block, a huge outlier,
    subnormals, values near float32's largest, one sign), then int4's own edges; n odd."""
    x = adversarial8(n)
    g = torch.Generator().manual_seed(5)
    x[1536:1792] = (torch.arange(256) % 15) - 7.0            # exact codes at scale 1
    x[1792:2048] = ((torch.arange(256) % 14) - 7.0) + 0.5    # ties at scale 1 ...
    x[1792] = 7.0                                            # ... the block's absmax
    # At most 3 of the least subnormal: absmax / 7 underflows to a 0 scale (divisor 1).
    x[2560:2816] = torch.randint(-3, 4, (256,), generator=g).float() * 2.0 ** -149
    x[2816:3072] = -0.0                                      # negative zeros
    return x


@pytest.mark.parametrize("block", BLOCKS)
def test_codes_scales_and_values_match_torch(block):
    x = adversarial()
    codes, scales, err = quantize4(x, block, error=True)
    want_codes, want_scales = ref.quantize(x, block)
    assert codes.shape == want_codes.shape and scales.shape == want_scales.shape
    assert same(scales, want_scales)
    bad = (codes != want_codes).nonzero().flatten()
    assert bad.numel() == 0, (bad[:5], codes[bad[:5]], want_codes[bad[:5]])
    want_back = ref.dequantize(codes, scales, x.numel(), block)
    assert same(dequantize4(codes, scales, x.numel(), block), want_back)
    assert same(err, x - want_back)  # the same two roundings as torch's separate ops


def test_ties_round_half_to_even_and_nibble_order():
    # absmax 7: scale 1 exactly, so the values are the codes before rounding.
    x = torch.tensor([7.0, -7.0, 0.5, 1.5, 2.5, -0.5, -2.5, 6.5, -6.5, 3.5, -3.5])
    even = torch.tensor([7.0, -7.0, 0.0, 2.0, 2.0, -0.0, -2.0, 6.0, -6.0, 4.0, -4.0])
    codes, scales = quantize4(x, 256)
    assert scales.item() == 1.0
    assert codes[0].item() == 0x97  # 7 in the low nibble, -7 (0b1001) in the high one
    assert codes[-1].item() >> 4 == 0  # odd n: the last high nibble is 0
    assert torch.equal(dequantize4(codes, scales, x.numel(), 256), even)


def test_all_256_bytes_unpack_like_torch():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = dequantize4(codes, torch.ones(1), 512, 512)
    assert torch.equal(got, ref.unpack(codes, 512).float())


def test_zero_negative_zero_and_nonfinite_blocks():
    x = torch.randn(256 * 5, generator=torch.Generator().manual_seed(1))
    x[:256] = 0.0
    x[1:256:2] = -0.0
    x[256 + 7] = float("nan")
    x[512 + 3] = float("inf")
    x[768 + 9] = -float("inf")
    codes, scales, err = quantize4(x, 256, error=True)
    back = dequantize4(codes, scales, x.numel(), 256)
    assert scales[0].item() == 0.0 and bool((codes[:128] == 0).all())
    assert bool((back[:256] == 0).all()) and not bool(back[:256].signbit().any())
    assert torch.equal(err[:256].signbit(), x[:256].signbit())  # -0 - 0 keeps the sign
    # A block with a NaN or an infinity reads back as NaN, all of it, not as finite junk.
    assert bool(scales[1:4].isnan().all()) and bool((codes[128:512] == 0).all())
    assert bool(back[256:1024].isnan().all()) and bool(err[256:1024].isnan().all())
    assert bool(torch.isfinite(back[1024:]).all())


def test_short_odd_last_block():
    x = torch.randn(301, generator=torch.Generator().manual_seed(3))
    x[300] = 50.0  # the short block's own absmax
    codes, scales = quantize4(x, 256)
    assert scales.numel() == 2 and codes.numel() == 151
    assert scales[1].item() == torch.tensor(50.0).div(torch.tensor(7.0)).item()
    assert codes[150].item() == 7  # code 7 low, nothing high


@pytest.mark.parametrize("block", BLOCKS)
def test_error_feedback_identity_is_exact(block):
    """back + err == x in float32, no tolerance: for a finite block the dequantized value is
    0 or within a factor 2 of x, so x - back is exact (Sterbenz) and adding it back is too."""
    x = adversarial()
    finite = torch.isfinite(x)
    assert bool(finite.all())  # adversarial() holds no NaN/Inf: every block is finite
    codes, scales, err = quantize4(x, block, error=True)
    back = dequantize4(codes, scales, x.numel(), block)
    assert torch.equal(back + err, x)


def test_error_in_place_and_bound():
    x = torch.randn(256 * 40 + 17, generator=torch.Generator().manual_seed(2)) * 3
    codes, scales, err = quantize4(x, 256, error=True)
    inplace = x.clone()
    codes2 = torch.empty_like(codes)
    scales2 = torch.empty_like(scales)
    _C.quantize4(inplace, 256, codes2, scales2, inplace)  # err aliasing the source
    assert torch.equal(codes2, codes) and torch.equal(scales2, scales)
    assert torch.equal(inplace, err)
    # Half a step, plus two roundings: x / scale's (at most 7 * 2^-24 of the scale, the
    # quotient being at most 7) and code * scale's (the same), 28 * 2^-24 < 2^-19 of 0.5 s.
    s = scales.repeat_interleave(256)[:x.numel()]
    assert bool((err.abs() <= 0.5 * s * (1 + 2.0 ** -19)).all())


@pytest.mark.parametrize("n,block", [(301, 64), (1000, 256), (7, 2)])
def test_sum_shards_match_torch_sums_in_shard_order(n, block):
    g = torch.Generator().manual_seed(n)
    shards, total = [], None
    for r in range(4):
        x = torch.randn(n, generator=g) * (r + 1) * 10.0 ** (r - 2)
        codes, scales = ref.quantize(x, block)
        shards.append(ref.shard(codes, scales))
        values = ref.dequantize(codes, scales, n, block)
        total = values if total is None else total + values  # float32 adds, shard order
    packed = torch.cat(shards)
    assert packed.numel() == 4 * _C.quant4_shard_bytes(n, block)
    assert _C.quant4_scales_offset(n) == shards[0].numel() - 4 * math.ceil(n / block)
    out = _C.sum_shards4(packed, 4, n, block, torch.empty(n))
    assert torch.equal(out, total)


def test_bad_arguments():
    codes, scales = torch.empty(2, dtype=torch.uint8), torch.empty(1)
    with pytest.raises(RuntimeError, match="block must be even"):
        _C.quantize4(torch.ones(4), 3, codes, scales)
    with pytest.raises(RuntimeError, match="src must be Float"):
        _C.quantize4(torch.ones(4, dtype=torch.float64), 256, codes, scales)
    with pytest.raises(RuntimeError, match="codes must have 2 elements"):
        _C.quantize4(torch.ones(4), 256, torch.empty(4, dtype=torch.uint8), scales)
    with pytest.raises(RuntimeError, match="err must have 4 elements"):
        _C.quantize4(torch.ones(4), 256, codes, scales, torch.empty(3))
    with pytest.raises(RuntimeError, match="values need 3 code bytes"):
        _C.dequantize4(codes, scales, 5, 256, torch.empty(5))
    with pytest.raises(RuntimeError, match="shards must have"):
        _C.sum_shards4(torch.empty(9, dtype=torch.uint8), 1, 4, 256, torch.empty(4))


@pytest.mark.gpu
@pytest.mark.parametrize("block", BLOCKS)
def test_cuda_kernels_match_cpu_and_torch_on_cuda(block):
    """The CUDA kernels (csrc/kernels/cuda/quant4.cu) give the CPU's codes, scales, values
    and errors bit for bit, and the torch reference computed by torch's CUDA ops."""
    x = adversarial()
    codes, scales, err = quantize4(x, block, error=True)
    c_cuda, s_cuda, e_cuda = quantize4(x.cuda(), block, error=True)
    assert torch.equal(c_cuda.cpu(), codes)
    assert same(s_cuda.cpu(), scales) and same(e_cuda.cpu(), err)
    want_codes, want_scales = ref.quantize(x.cuda(), block)
    assert torch.equal(c_cuda, want_codes) and same(s_cuda, want_scales)
    back = dequantize4(c_cuda, s_cuda, x.numel(), block)
    assert same(back.cpu(), dequantize4(codes, scales, x.numel(), block))
    assert same(back, ref.dequantize(c_cuda, s_cuda, x.numel(), block))


@pytest.mark.gpu
@pytest.mark.parametrize("n,offset", [(256 * 9000 + 37, 0), (256 * 40 + 3, 1)])
def test_cuda_grid_stride_unaligned_in_place_and_shard_sum(n, offset):
    # 9000 blocks: more warps than one wave (the grid strides); offset 1: a source 4 bytes
    # past 16-byte alignment; the error written over the source.
    x = adversarial(n + offset)[offset:]
    codes, scales, err = quantize4(x, 256, error=True)
    xc = adversarial(n + offset).cuda()[offset:]
    c_cuda = torch.empty_like(codes, device="cuda")
    s_cuda = torch.empty_like(scales, device="cuda")
    _C.quantize4(xc, 256, c_cuda, s_cuda, xc)
    assert torch.equal(c_cuda.cpu(), codes) and same(s_cuda.cpu(), scales)
    assert same(xc.cpu(), err)
    packed = torch.cat([ref.shard(codes, scales), ref.shard(codes, scales * 0.5)])
    want = _C.sum_shards4(packed, 2, n, 256, torch.empty(n))
    got = _C.sum_shards4(packed.cuda(), 2, n, 256, torch.empty(n, device="cuda"))
    assert same(got.cpu(), want)
