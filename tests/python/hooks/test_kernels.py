"""Half-cast kernels (fastddp._C.half_*) against torch's casts, bit for bit.

Non-NaN values must have torch's exact bits; NaN must stay NaN (torch's own scalar and
vector paths disagree on NaN payloads). CUDA versions run the same checks on a GPU against
torch's CUDA ops (ATen's CUDA casts and its CUDA division, which rounds otherwise than the
CPU's: Note [torch's half rounding]).
"""

import pytest
import torch

from fastddp import _C

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def special_values(n: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45,
                             -3e-39, 6e-8, 3e-8, 65504.0, 65520.0, 3.4e38, 1.0 + 2**-8])
    k = min(n, specials.numel())
    x[:k] = specials[:k]
    # Random bit patterns: every exponent, float32 subnormals, NaN payloads.
    bits = torch.randint(-2**31, 2**31 - 1, (n // 4,), generator=g, dtype=torch.int64)
    x[n - n // 4:] = bits.to(torch.int32).view(torch.float32)
    return x.to(device)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN positions differ"
    same = got[~nan].view(torch.int16 if got.element_size() == 2 else torch.int32) == \
        want[~nan].view(torch.int16 if want.element_size() == 2 else torch.int32)
    assert bool(same.all()), f"{what}: {int((~same).sum())} values differ from torch's bits"


# World sizes; at 14 the CPU's quotient and CUDA's product by the reciprocal round some
# float16 values differently (test_cast_divide_rounds_as_each_device).
DIVISORS = (1, 2, 3, 7, 14)


def every_value(dtype: torch.dtype, device: str) -> torch.Tensor:
    """Every finite value of a 16-bit format, as float32 (exact), and each times
    (1 + 2^-12): float32 values between two 16-bit ones, which the cast rounds first."""
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    exact = values[values.isfinite()].float()
    nudged = exact * (1 + 2.0 ** -12)
    return torch.cat([exact, nudged[nudged.isfinite()]]).to(device)


def check_kernels(device: str) -> None:
    for name, dtype in DTYPES.items():
        for n, offset in ((1, 0), (7, 3), (1000, 1), (65537, 5), (300001, 2)):
            x = special_values(n + offset, n, device)[offset:]  # unaligned start
            scale = 1.0 / 3.0
            got = _C.half_compress(x, scale, name)
            assert_same_bits(got, (x * scale).to(dtype), f"{name} compress n={n}+{offset}")
            back = _C.half_decompress(got)
            assert_same_bits(back, got.float(), f"{name} decompress n={n}")
            residual = torch.full_like(x, 0.125)
            v = x * scale + 0.125
            got = _C.half_compress(x, scale, name, residual)
            assert_same_bits(got, v.to(dtype), f"{name} compress with feedback n={n}")
            assert_same_bits(residual, v - v.to(dtype).float(), f"{name} residual n={n}")
            for divisor in DIVISORS:  # torch's fp16/bf16_compress_hook, on this device
                assert_same_bits(_C.half_cast_divide(x, divisor, name),
                                 x.to(dtype).div_(divisor), f"{name} cast, / {divisor}, n={n}")
        every = every_value(dtype, device)
        for divisor in DIVISORS:
            assert_same_bits(_C.half_cast_divide(every, divisor, name),
                             every.to(dtype).div_(divisor), f"{name} every value / {divisor}")
        # Many ranges in one call, into unaligned float views.
        srcs = [special_values(m, m, device).to(dtype) for m in (5, 4096, 33, 70001)]
        flat = torch.empty(sum(s.numel() for s in srcs) + 3, device=device)
        dsts, pos = [], 1
        for s in srcs:
            dsts.append(flat[pos:pos + s.numel()])
            pos += s.numel()
        _C.half_decompress_into(srcs, dsts)
        for s, d in zip(srcs, dsts):
            assert_same_bits(d, s.float(), f"{name} multi-tensor decompress")
        shards = (torch.randn(5, 4099, device=device) * 1e-3).to(dtype)
        total = shards[0].float()
        for r in range(1, 5):
            total = total + shards[r].float()
        assert_same_bits(_C.half_sum_shards(shards), total.to(dtype), f"{name} sum_shards")


def test_cpu_kernels_match_torch():
    check_kernels("cpu")


def test_bad_input_names_the_culprit():
    with pytest.raises(RuntimeError, match="src must be float32"):
        _C.half_compress(torch.zeros(4, dtype=torch.float64), 1.0, "bf16")
    with pytest.raises(ValueError, match="dtype must be 'bf16' or 'fp16'"):
        _C.half_compress(torch.zeros(4), 1.0, "fp8")
    with pytest.raises(RuntimeError, match="residual must match src"):
        _C.half_compress(torch.zeros(4), 1.0, "bf16", torch.zeros(3))
    with pytest.raises(RuntimeError, match="divisor must be positive"):
        _C.half_cast_divide(torch.zeros(4), 0, "fp16")
    with pytest.raises(RuntimeError, match="src must be float32"):
        _C.half_cast_divide(torch.zeros(4, dtype=torch.float16), 2, "fp16")


@pytest.mark.gpu
def test_cuda_kernels_match_torch():
    check_kernels("cuda")


@pytest.mark.gpu
def test_cast_divide_rounds_as_each_device():
    """ATen divides a 16-bit tensor by a scalar in float on the CPU and multiplies by the
    float reciprocal on CUDA; each kernel gives its own device's bits, which differ for
    some values (so a kernel that rounded as the other device would fail above)."""
    x = every_value(torch.float16, "cpu")
    on_cpu = _C.half_cast_divide(x, 14, "fp16")
    on_cuda = _C.half_cast_divide(x.cuda(), 14, "fp16").cpu()
    assert_same_bits(on_cuda, x.cuda().to(torch.float16).div_(14).cpu(), "fp16 cuda / 14")
    assert_same_bits(on_cpu, x.to(torch.float16).div_(14), "fp16 cpu / 14")
    assert not torch.equal(on_cpu, on_cuda), (
        "the CPU and CUDA roundings agree everywhere: the test cannot tell them apart")
