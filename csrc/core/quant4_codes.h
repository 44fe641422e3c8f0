// Float32 <-> 4-bit codes of the block-scaled int4 wire (Note [int4 wire
// format] in kernels/quant4.h), one value at a time, shared by the CPU and
// CUDA kernels and the Catch2 tests. Torch-free and header-only like
// quant8_codes.h, whose clamp, int8 rounding and divisor rules it reuses.
//
// A code is a 4-bit two's complement integer in [-7, 7] (-8 is never
// produced: the grid stays symmetric, so x and -x quantize to opposite codes);
// two codes share a byte, the even element in the low nibble. Nothing here may
// be built with -ffast-math / --use_fast_math (quant8_codes.h says why).
#pragma once

#include <cstdint>

#include "quant8_codes.h"

namespace fastddp {

// The largest code magnitude: a block's absmax maps here.
constexpr float kQuant4Max = 7.0f;
constexpr uint32_t kInt4MaxBits = 0x40E00000u;  // 7.0f

// Round half to even (as torch.round) of a finite v, clamped to [-7, 7], as a
// nibble (0..15, two's complement): int8's rounding of the clamped value, its
// low 4 bits. Clamping before rounding equals rounding before clamping: 7 is
// an integer and rounding is monotonic.
FASTDDP_HOST_DEVICE uint8_t int4_code_from_float(float v) {
  return static_cast<uint8_t>(int8_code_from_float(quant8_clamp(v, kInt4MaxBits)) & 0xFu);
}

// The value of a nibble (the low 4 bits of `nibble`): 0..7, then -8..-1.
FASTDDP_HOST_DEVICE float float_from_int4_code(uint32_t nibble) {
  return static_cast<float>(static_cast<int32_t>((nibble & 0xFu) ^ 8u) - 8);
}

// A block's scale from the largest |x| bit pattern of its values, as
// quant8_scale_from_absmax_bits: NaN for a block holding a NaN or an infinity
// (its codes are then 0 and it reads back as NaN), else absmax / 7 (0 for an
// all-zero block; quant8_divisor turns a 0 scale into a divisor of 1).
FASTDDP_HOST_DEVICE float quant4_scale_from_absmax_bits(uint32_t absmax_bits) {
  if (absmax_bits >= 0x7F800000u) return float_from_bits(0x7FC00000u);
  return float_from_bits(absmax_bits) / kQuant4Max;
}

}  // namespace fastddp
