// Float32 <-> 8-bit codes of the block-scaled wire formats (int8, fp8 e4m3fn,
// fp8 e5m2), one value at a time, shared by the CPU and CUDA kernels and the
// Catch2 tests. Torch-free and header-only like half_rounding.h: codes travel
// as uint8_t bit patterns.
//
// The fp8 encoders round to nearest, ties to even, exactly as c10's
// Float8_e4m3fn / Float8_e5m2 constructors do (the same bit arithmetic,
// written with selects instead of branches so that CPU loops vectorize); they
// take finite inputs already clamped to the format's largest finite value
// (Note [8-bit wire formats] in hooks/quant8/quant8_hook.h), so the saturation and NaN
// branches of c10's versions are never needed. The int8 encoder rounds half
// to even (the magic-number trick: adding and subtracting 1.5 * 2^23 leaves
// the value rounded by the FPU in its default mode). Nothing here may be built
// with -ffast-math / --use_fast_math: the tricks rely on exact IEEE adds.
#pragma once

#include <cstdint>

#include "half_rounding.h"

namespace fastddp {

enum class Quant8Format : int { kInt8 = 0, kFp8E4M3 = 1, kFp8E5M2 = 2 };

// The largest code magnitude: values are scaled so that a block's absmax maps here.
FASTDDP_HOST_DEVICE constexpr float quant8_max(Quant8Format f) {
  return f == Quant8Format::kInt8 ? 127.0f : (f == Quant8Format::kFp8E4M3 ? 448.0f : 57344.0f);
}

// Branch-free selects and clamps (integer masks): GCC does not if-convert the
// float ternaries of these helpers (-ftrapping-math), and a branch in a loop
// body stops it from vectorizing the loop.
FASTDDP_HOST_DEVICE uint32_t quant8_select(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

// v clamped to [-limit, limit] for finite v, on the bit patterns: the bits of
// non-negative floats order as the floats do. limit_bits = float_bits(limit).
FASTDDP_HOST_DEVICE float quant8_clamp(float v, uint32_t limit_bits) {
  const uint32_t bits = float_bits(v);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t magnitude = bits ^ sign;
  return float_from_bits((magnitude < limit_bits ? magnitude : limit_bits) | sign);
}

constexpr uint32_t kInt8MaxBits = 0x42FE0000u;  // 127.0f
constexpr uint32_t kE4M3MaxBits = 0x43E00000u;  // 448.0f
constexpr uint32_t kE5M2MaxBits = 0x47600000u;  // 57344.0f

// Round half to even of a finite |v| <= 127, as an int8 bit pattern.
FASTDDP_HOST_DEVICE uint8_t int8_code_from_float(float v) {
  const float c = quant8_clamp(v, kInt8MaxBits);
#if defined(__CUDA_ARCH__)
  const float r = rintf(c);
#else
  const float magic = 12582912.0f;  // 1.5 * 2^23: ulp 1 at this magnitude
  const float r = (c + magic) - magic;
#endif
  return static_cast<uint8_t>(static_cast<int8_t>(static_cast<int32_t>(r)));
}

FASTDDP_HOST_DEVICE float float_from_int8_code(uint8_t code) {
  return static_cast<float>(static_cast<int8_t>(code));
}

// c10::detail::fp8e4m3fn_from_fp32_value for finite |v| <= 448.
FASTDDP_HOST_DEVICE uint8_t e4m3_code_from_float(float v) {
  uint32_t bits = float_bits(quant8_clamp(v, kE4M3MaxBits));
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  // Below 2^-6 (the smallest normal): adding 2^14 lets the FPU round the
  // subnormal mantissa into the low bits.
  const uint32_t denorm_mask = 141u << 23;
  const uint32_t subnormal =
      float_bits(float_from_bits(bits) + float_from_bits(denorm_mask)) - denorm_mask;
  const uint32_t mant_odd = (bits >> 20) & 1u;
  const uint32_t normal =
      (bits + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + mant_odd) >> 20;
  const uint32_t code = quant8_select(bits < (121u << 23), subnormal, normal);
  return static_cast<uint8_t>(code | (sign >> 24));
}

// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinity,
// S.1111.111 is NaN.
FASTDDP_HOST_DEVICE float float_from_e4m3_code(uint8_t code) {
  const uint32_t c = code;
  const uint32_t sign = (c & 0x80u) << 24;
  const uint32_t exponent = (c >> 3) & 0xFu;
  const uint32_t mantissa = c & 0x7u;
  const uint32_t normal = sign | ((exponent + 120u) << 23) | (mantissa << 20);
  // mantissa * 2^-9, exact in float32.
  const uint32_t subnormal =
      sign | float_bits(static_cast<float>(static_cast<int32_t>(mantissa)) * 0.001953125f);
  return float_from_bits(quant8_select((c & 0x7Fu) == 0x7Fu, 0x7FC00000u,
                                       quant8_select(exponent == 0, subnormal, normal)));
}

// c10::detail::fp8e5m2_from_fp32_value for finite |v| <= 57344.
FASTDDP_HOST_DEVICE uint8_t e5m2_code_from_float(float v) {
  uint32_t bits = float_bits(quant8_clamp(v, kE5M2MaxBits));
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  const uint32_t denorm_mask = 134u << 23;
  const uint32_t subnormal =
      float_bits(float_from_bits(bits) + float_from_bits(denorm_mask)) - denorm_mask;
  const uint32_t mant_odd = (bits >> 21) & 1u;
  const uint32_t normal =
      (bits + (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFFu + mant_odd) >> 21;
  const uint32_t code = quant8_select(bits < (113u << 23), subnormal, normal);
  return static_cast<uint8_t>(code | (sign >> 24));
}

// e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa bits, the upper byte of an
// IEEE float16: exponent 31 is infinity (mantissa 0) or NaN.
FASTDDP_HOST_DEVICE float float_from_e5m2_code(uint8_t code) {
  const uint32_t c = code;
  const uint32_t sign = (c & 0x80u) << 24;
  const uint32_t exponent = (c >> 2) & 0x1Fu;
  const uint32_t mantissa = c & 0x3u;
  const uint32_t normal = sign | ((exponent + 112u) << 23) | (mantissa << 21);
  const uint32_t special = sign | 0x7F800000u | (mantissa << 21);
  // mantissa * 2^-16, exact in float32.
  const uint32_t subnormal =
      sign | float_bits(static_cast<float>(static_cast<int32_t>(mantissa)) * 1.52587890625e-05f);
  return float_from_bits(quant8_select(exponent == 0x1Fu, special,
                                       quant8_select(exponent == 0, subnormal, normal)));
}

template <Quant8Format F>
FASTDDP_HOST_DEVICE uint8_t quant8_code_from_float(float v) {
  if constexpr (F == Quant8Format::kInt8) {
    return int8_code_from_float(v);
  } else if constexpr (F == Quant8Format::kFp8E4M3) {
    return e4m3_code_from_float(v);
  } else {
    return e5m2_code_from_float(v);
  }
}

template <Quant8Format F>
FASTDDP_HOST_DEVICE float float_from_quant8_code(uint8_t code) {
  if constexpr (F == Quant8Format::kInt8) {
    return float_from_int8_code(code);
  } else if constexpr (F == Quant8Format::kFp8E4M3) {
    return float_from_e4m3_code(code);
  } else {
    return float_from_e5m2_code(code);
  }
}

// A block's scale from the largest |x| bit pattern of its values (the bits of
// a non-negative float order as the float does): NaN when the block holds a
// NaN or an infinity (so that it dequantizes to NaN, visibly), else
// absmax / quant8_max (0 for an all-zero block, whose codes are then 0).
template <Quant8Format F>
FASTDDP_HOST_DEVICE float quant8_scale_from_absmax_bits(uint32_t absmax_bits) {
  if (absmax_bits >= 0x7F800000u) return float_from_bits(0x7FC00000u);
  return float_from_bits(absmax_bits) / quant8_max(F);
}

// What x is divided by before encoding: the scale, or 1 when the scale is 0
// (an all-zero block, or values so small that absmax / max underflowed: they
// encode to 0). A non-finite block (NaN scale) is not encoded at all: the
// kernels write 0 codes for it.
FASTDDP_HOST_DEVICE float quant8_divisor(float scale) { return scale > 0.0f ? scale : 1.0f; }

}  // namespace fastddp
