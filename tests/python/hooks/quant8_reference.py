"""The block-scaled 8-bit formats of the "int8" / "fp8" hooks (Note [8-bit wire formats] in
csrc/hooks/quant8/quant8_hook.h) written again from torch ops, as the independent reference of
the tests: torch.round (half to even) for int8, torch's own ``.to(torch.float8_*)`` for fp8.
"""

import math

import torch

BLOCK = 256
QMAX = {"int8": 127.0, "e4m3": 448.0, "e5m2": 57344.0}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def block_scales(x: torch.Tensor, qmax: float,
                 block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks, bad, scales, divisors) of a 1-D float32 tensor: its blocks as rows (the last
    one zero padded), whether a row holds a NaN or an infinity, absmax / qmax per row (NaN
    for a bad row), and what a row is divided by (its scale, or 1 for a 0 scale). Shared
    with the int4 reference (quant4_reference.py)."""
    n = x.numel()
    nb = math.ceil(n / block)
    padded = torch.zeros(nb * block, dtype=torch.float32, device=x.device)
    padded[:n] = x
    blocks = padded.view(nb, block)
    bad = ~torch.isfinite(blocks).all(dim=1)
    absmax = blocks.abs().amax(dim=1)
    # A tensor divisor: torch may turn a division by a Python scalar into a multiplication.
    scale = absmax / torch.full_like(absmax, qmax)
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    return blocks, bad, scale, divisor


def quantize(x: torch.Tensor, fmt: str, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, scales float32) of a 1-D float32 tensor; the last block may be short."""
    n = x.numel()
    blocks, bad, scale, divisor = block_scales(x, QMAX[fmt], block)
    v = (blocks / divisor[:, None]).clamp(-QMAX[fmt], QMAX[fmt])
    if fmt == "int8":
        codes = torch.round(v).to(torch.int8).view(torch.uint8)
    else:
        codes = v.to(FP8[fmt]).view(torch.uint8)
    codes[bad] = 0
    return codes.flatten()[:n].clone(), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str,
               block: int = BLOCK) -> torch.Tensor:
    values = codes.view(torch.int8).float() if fmt == "int8" else codes.view(FP8[fmt]).float()
    return values * scales.repeat_interleave(block)[:codes.numel()]


def pack(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One shard on the wire: its codes, then its scales' bytes."""
    return torch.cat([codes, scales.view(torch.uint8)])


def unpack(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return packed[:n], packed[n:].clone().view(torch.float32)


def decode_fp8_by_hand(code: int, fmt: str) -> float:
    """One fp8 byte from its fields: sign, biased exponent, mantissa (subnormals at exponent
    0; e4m3fn: no infinity, S.1111.111 is NaN; e5m2: IEEE-like, exponent 31 is Inf/NaN)."""
    sign = -1.0 if code & 0x80 else 1.0
    if fmt == "e4m3":
        e, m, bias, mbits = (code >> 3) & 0xF, code & 0x7, 7, 3
        if e == 0xF and m == 0x7:
            return math.nan
    else:
        e, m, bias, mbits = (code >> 2) & 0x1F, code & 0x3, 15, 2
        if e == 0x1F:
            return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * (m / 2 ** mbits) * 2.0 ** (1 - bias)
    return sign * (1 + m / 2 ** mbits) * 2.0 ** (e - bias)
