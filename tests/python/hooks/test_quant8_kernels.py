"""The 8-bit block quantization kernels (`_C._quantize8` / `_C._dequantize8`, CPU) against
independent references: fp8 bytes decoded by hand from their bit fields, codes against
torch's own ``.to(torch.float8_*)`` and ``torch.round``, adversarial blocks (zeros, an
outlier, denormals, NaN/Inf, a short last block), and the error-feedback invariant. Under
-m gpu the CUDA kernels against the CPU ones and against the same torch reference run on
CUDA tensors."""

import math

import pytest
import torch

from fastddp import _C
from tests.python.hooks import quant8_reference as ref

FORMATS = ["int8", "e4m3", "e5m2"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_all_256_codes_decode_by_hand(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = _C._dequantize8(codes, torch.ones(1), fmt, 256)
    want = torch.tensor([ref.decode_fp8_by_hand(c, fmt) for c in range(256)])
    assert same(got, want), [(c, got[c].item(), want[c].item()) for c in range(256)
                             if not same(got[c:c + 1], want[c:c + 1])][:5]
    # The scale multiplies every code (0.5: exact, so the comparison stays exact).
    assert same(_C._dequantize8(codes, torch.full((1,), 0.5), fmt, 256), want * 0.5)


def test_int8_all_256_codes_decode():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = torch.tensor([c - 256 if c > 127 else c for c in range(256)], dtype=torch.float32)
    assert same(_C._dequantize8(codes, torch.ones(1), "int8", 256), want)


def adversarial(n: int = 256 * 12 + 100) -> torch.Tensor:
    """Random blocks of very different magnitudes, and blocks built to hit the edges."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    x[:256] *= 1e-3
    x[256:512] *= 1e4
    x[512:768] = 0.0                                        # a zero block
    x[768:1024] = torch.randn(256, generator=g)
    x[900] = 3e30                                           # one huge outlier
    x[1024:1280] = torch.randn(256, generator=g) * 1e-41    # subnormal floats
    x[1280:1536] = torch.randn(256, generator=g) * 1e-38    # near the subnormal range
    x[1536:1792] = torch.arange(256) - 128.0                # exact integers
    x[1792:2048] = (torch.arange(256) - 128.0) + 0.5        # ties for int8 at scale 1
    x[2048:2304] = 3e38                                     # near float32's largest
    x[2304:2560] = -torch.rand(256, generator=g)            # one sign
    return x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block", [256, 64, 100])
def test_codes_and_scales_match_torch(fmt, block):
    x = adversarial()
    codes, scales = _C._quantize8(x, fmt, block)
    want_codes, want_scales = ref.quantize(x, fmt, block)
    assert scales.shape == want_scales.shape and codes.dtype == torch.uint8
    assert same(scales, want_scales)
    bad = (codes != want_codes).nonzero().flatten()
    assert bad.numel() == 0, (bad[:5], x[bad[:5]], codes[bad[:5]], want_codes[bad[:5]])
    assert same(_C._dequantize8(codes, scales, fmt, block),
                ref.dequantize(codes, scales, fmt, block))


@pytest.mark.parametrize("fmt", FORMATS)
def test_ties_round_to_even(fmt):
    # Scale 1 exactly (absmax = the format's max), then values halfway between two codes.
    top = ref.QMAX[fmt]
    if fmt == "int8":
        ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5])
        even = torch.tensor([0.0, 2.0, 2.0, 0.0, -2.0, 126.0])
    elif fmt == "e4m3":  # 3 mantissa bits: between 8 and 9 ulps 1; 2**-9 is the least
        ties = torch.tensor([8.5, 9.5, 2.0 ** -10, 3 * 2.0 ** -10, 240.0 + 8])
        even = torch.tensor([8.0, 10.0, 0.0, 2.0 ** -8, 256.0])
    else:  # 2 mantissa bits
        ties = torch.tensor([4.5, 5.5, 2.0 ** -17, 3 * 2.0 ** -17])
        even = torch.tensor([4.0, 6.0, 0.0, 2.0 ** -15])
    x = torch.cat([torch.tensor([top]), ties])
    codes, scales = _C._quantize8(x, fmt, 256)
    assert scales.item() == 1.0
    assert same(_C._dequantize8(codes, scales, fmt, 256)[1:], even)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_block_is_exact_and_nonfinite_stays_visible(fmt):
    x = torch.randn(256 * 5, generator=torch.Generator().manual_seed(1))
    x[:256] = 0.0
    x[256 + 7] = float("nan")
    x[512 + 3] = float("inf")
    x[768 + 9] = -float("inf")
    codes, scales = _C._quantize8(x, fmt, 256)
    back = _C._dequantize8(codes, scales, fmt, 256)
    assert scales[0].item() == 0.0 and bool((codes[:256] == 0).all())
    assert bool((back[:256] == 0).all())
    # A block with a NaN or an infinity reads back as NaN, all of it, not as finite junk.
    assert bool(back[256:1024].isnan().all())
    assert bool(torch.isfinite(back[1024:]).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_within_format_bound(fmt):
    x = torch.randn(256 * 40 + 17, generator=torch.Generator().manual_seed(2)) * 3
    codes, scales = _C._quantize8(x, fmt, 256)
    err = (_C._dequantize8(codes, scales, fmt, 256) - x).abs()
    s = scales.repeat_interleave(256)[:x.numel()]
    if fmt == "int8":
        bound = 0.5 * s
    else:  # half an ulp: 2^-4 (e4m3) / 2^-3 (e5m2) relative, or half the least subnormal
        mbits, least = (3, 2.0 ** -9) if fmt == "e4m3" else (2, 2.0 ** -16)
        bound = torch.maximum(x.abs() * 2.0 ** -(mbits + 1), 0.5 * least * s)
    assert bool((err <= bound * (1 + 1e-6) + 1e-30).all()), (err - bound).max()


def test_short_last_block():
    x = torch.randn(300, generator=torch.Generator().manual_seed(3))
    x[299] = 50.0  # the short block's own absmax
    codes, scales = _C._quantize8(x, "int8", 256)
    assert scales.numel() == 2 and codes.numel() == 300
    assert scales[1].item() == pytest.approx(50.0 / 127, rel=1e-7)


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_feedback_invariant(fmt):
    """Over steps, what was sent (dequantized) plus the final residual is what came in."""
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(1000, generator=g) * (1 + step) for step in range(6)]
    residual = torch.zeros(1000)
    sent = torch.zeros(1000, dtype=torch.float64)
    for grad in inputs:
        v = grad + residual
        codes, scales, residual = _C._quantize8(v, fmt, 256, error=True)
        sent += _C._dequantize8(codes, scales, fmt, 256).double()
        assert same(residual, v - ref.dequantize(codes, scales, fmt))
    total = torch.stack(inputs).double().sum(0)
    scale = torch.stack(inputs).abs().sum().item() / 1000
    assert (sent + residual.double() - total).abs().max().item() <= 1e-5 * scale


def test_bad_arguments():
    with pytest.raises(ValueError, match="format"):
        _C._quantize8(torch.ones(4), "fp4", 256)
    with pytest.raises(RuntimeError, match="block"):
        _C._quantize8(torch.ones(4), "int8", 0)
    with pytest.raises(RuntimeError, match="src must be"):
        _C._quantize8(torch.ones(4, dtype=torch.float64), "int8", 256)
    assert math.isnan(_C._dequantize8(torch.zeros(1, dtype=torch.uint8),
                                      torch.tensor([float("nan")]), "int8", 256).item())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_kernels_match_cpu(fmt):
    """The CUDA kernels (csrc/kernels/cuda/quant8.cu) give the CPU's codes, scales and
    errors bit for bit (run by `make gpu-check`; skipped without a GPU)."""
    x = adversarial()
    for block in (256, 100):
        codes, scales, err = _C._quantize8(x, fmt, block, error=True)
        c_cuda, s_cuda, e_cuda = _C._quantize8(x.cuda(), fmt, block, error=True)
        assert torch.equal(c_cuda.cpu(), codes)
        assert same(s_cuda.cpu(), scales) and same(e_cuda.cpu(), err)
        assert same(_C._dequantize8(c_cuda, s_cuda, fmt, block).cpu(),
                    _C._dequantize8(codes, scales, fmt, block))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_kernels_match_torch_on_cuda(fmt):
    """The CUDA kernels against the reference computed by torch's CUDA ops (ATen's CUDA
    float8 casts, torch.round, the division by the scale), bit for bit."""
    x = adversarial().cuda()
    for block in (256, 64, 100):
        codes, scales = _C._quantize8(x, fmt, block)
        want_codes, want_scales = ref.quantize(x, fmt, block)
        assert codes.is_cuda and want_codes.is_cuda
        assert same(scales, want_scales), f"{fmt} block {block}: scales"
        bad = (codes != want_codes).nonzero().flatten().cpu()
        assert bad.numel() == 0, (fmt, block, bad[:5], x.cpu()[bad[:5]])
        assert same(_C._dequantize8(codes, scales, fmt, block),
                    ref.dequantize(codes, scales, fmt, block)), f"{fmt} block {block}"
