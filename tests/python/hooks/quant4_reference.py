"""The block-scaled int4 wire (Note [int4 wire format] in csrc/kernels/quant4.h) written
again from torch ops, as the independent reference of the tests: scale = absmax / 7,
codes = ``torch.clamp(torch.round(x / scale), -7, 7)`` (torch.round rounds half to even),
two 4-bit two's complement codes a byte, the even element in the low nibble.
"""

import torch

from tests.python.hooks.quant8_reference import BLOCK, block_scales


def pack(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7] -> bytes, element 2k low, 2k + 1 high (0 past an odd end)."""
    nibbles = codes.view(torch.uint8) & 0xF
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
    return nibbles[0::2] | (nibbles[1::2] << 4)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """bytes -> the first n codes as int8 (sign extended from 4 bits)."""
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=1).flatten()[:n].to(torch.int16)
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.int8)


def quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes uint8, scales float32) of a 1-D float32 tensor; the last block may be
    short. A block with a NaN or an infinity: NaN scale, codes 0."""
    blocks, bad, scale, divisor = block_scales(x, 7.0, block)
    q = torch.clamp(torch.round(blocks / divisor[:, None]), -7, 7)
    q[bad] = 0
    return pack(q.flatten()[:x.numel()].to(torch.int8)), scale


def dequantize(packed: torch.Tensor, scales: torch.Tensor, n: int,
               block: int = BLOCK) -> torch.Tensor:
    return unpack(packed, n).float() * scales.repeat_interleave(block)[:n]


def shard(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One packed shard: the codes, zero bytes up to a multiple of 4, the scales' bytes."""
    pad = packed.new_zeros(-packed.numel() % 4)
    return torch.cat([packed, pad, scales.view(torch.uint8)])
