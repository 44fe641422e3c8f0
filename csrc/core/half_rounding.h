// Float32 <-> bfloat16 / float16 conversions, bit for bit as torch does them.
//
// Torch-free and header-only so the CPU kernels, the CUDA kernels and the
// Catch2 tests share one definition. Values travel as uint16_t bit patterns:
// neither c10::BFloat16 nor __nv_bfloat16 may appear in this layer.
//
// Note [half rounding]
// Both conversions round to nearest, ties to even, as torch's
// `x.to(torch.bfloat16)` / `x.to(torch.float16)` do; Inf stays Inf, NaN stays
// NaN (always a quiet NaN; the payload is not kept, and torch's own scalar and
// vector paths disagree on it, so tests compare NaN-ness, not NaN bits),
// float16 subnormals are produced and read exactly. Nothing here may be
// compiled with flush-to-zero (nvcc --use_fast_math, -ffast-math): the float
// arithmetic in fp16_bits_from_float relies on subnormal results.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define FASTDDP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FASTDDP_HOST_DEVICE inline
#endif

namespace fastddp {

FASTDDP_HOST_DEVICE uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

FASTDDP_HOST_DEVICE float float_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// bfloat16 is the upper half of a float32: rounding adds 0x7FFF plus the
// lowest kept bit (ties to even) and truncates. Written without branches so
// that loops over it vectorize.
FASTDDP_HOST_DEVICE uint16_t bf16_bits_from_float(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(is_nan ? 0x7FC0u : rounded);
}

FASTDDP_HOST_DEVICE float float_from_bf16_bits(uint16_t h) {
  return float_from_bits(static_cast<uint32_t>(h) << 16);
}

// IEEE half from float32, after Maratea's FP16 library (what c10 uses where
// the CPU has no F16C): scaling by 2^112 then 2^-110 lets the FPU do the
// round-to-nearest-even at the right bit, subnormals included.
FASTDDP_HOST_DEVICE uint16_t fp16_bits_from_float(float f) {
#if defined(__CUDA_ARCH__)
  // The device has the instruction; the float trick below would also be at
  // the mercy of nvcc contracting its multiply and add into an FMA.
  return __half_as_ushort(__float2half_rn(f));
#else
  const float scale_to_inf = float_from_bits(0x77800000u);   // 2^112
  const float scale_to_zero = float_from_bits(0x08800000u);  // 2^-110
  const float abs_f = float_from_bits(float_bits(f) & 0x7FFFFFFFu);
  float base = (abs_f * scale_to_inf) * scale_to_zero;
  const uint32_t w = float_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = float_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

// Exact: every float16 is a float32. Subnormals are normalized with a float
// multiply (magic-number trick), again branch-free.
FASTDDP_HOST_DEVICE float float_from_fp16_bits(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = float_from_bits(0x7800000u);  // 2^-112
  const float normalized = float_from_bits((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = float_from_bits((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? float_bits(denormalized) : float_bits(normalized));
  return float_from_bits(result);
#endif
}

// Multiply and add rounded separately, as torch's separate kernels do: nvcc
// would otherwise contract g * scale + residual into one FMA (one rounding).
FASTDDP_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;  // host builds use ISO C++ (-std=c++17): no FMA contraction
#endif
}

FASTDDP_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// The two 16-bit formats by one tag, so kernels are written once.
enum class HalfKind : int { kBFloat16 = 0, kFloat16 = 1 };

template <HalfKind K>
FASTDDP_HOST_DEVICE uint16_t half_bits_from_float(float f) {
  if constexpr (K == HalfKind::kBFloat16) {
    return bf16_bits_from_float(f);
  } else {
    return fp16_bits_from_float(f);
  }
}

template <HalfKind K>
FASTDDP_HOST_DEVICE float float_from_half_bits(uint16_t h) {
  if constexpr (K == HalfKind::kBFloat16) {
    return float_from_bf16_bits(h);
  } else {
    return float_from_fp16_bits(h);
  }
}

}  // namespace fastddp
