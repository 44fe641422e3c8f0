// CPU versions of the half casts (see half_cast.h).
//
// The loops are branch-free (the rounding helpers use selects, not ifs) so the
// compiler vectorizes them; on x86-64 GCC builds each loop is cloned for
// AVX-512, AVX2 and baseline SSE2 and the loader picks one for the running CPU,
// so the one portable binary still gets wide vectors. float16 takes the F16C
// instructions where the CPU has them (half_cast_f16c.h): GCC does not
// vectorize the portable float16 rounding. Threading is the caller's business
// (the hooks split large buffers with at::parallel_for).
#include "half_cast.h"
#include "half_cast_f16c.h"
#include "vector_clones.h"

namespace fastddp::kernels {


namespace {

// The three to-half loops below differ only in their element operation, and stay
// three functions: each keeps its own __restrict pointers (the residual's included),
// so GCC vectorizes it without runtime alias checks. The CUDA kernels share one loop
// through an element functor instead (cuda/half_cast.cu), where aliasing costs nothing.

// kCheck: also an integer OR of (x - x) != 0 (see kernels/nonfinite.h); a
// separate instantiation so that the unchecked loops stay as they were.
template <HalfKind K, bool kCheck>
FASTDDP_VECTOR_CLONES int compress_plain(const float* __restrict src, float scale,
                                         uint16_t* __restrict dst, int64_t n) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (kCheck) bad |= static_cast<int>((src[i] - src[i]) != 0.0f);
    dst[i] = half_bits_from_float<K>(mul_rn(src[i], scale));
  }
  return bad;
}

template <HalfKind K, bool kCheck>
FASTDDP_VECTOR_CLONES int compress_feedback(const float* __restrict src, float scale,
                                            const float* __restrict residual,
                                            float* __restrict new_residual,
                                            uint16_t* __restrict dst, int64_t n) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (kCheck) bad |= static_cast<int>((src[i] - src[i]) != 0.0f);
    const float v = add_rn(mul_rn(src[i], scale), residual[i]);
    const uint16_t h = half_bits_from_float<K>(v);
    dst[i] = h;
    new_residual[i] = v - float_from_half_bits<K>(h);
  }
  return bad;
}

template <HalfKind K, bool kCheck>
int compress_one_kind(const float* src, float scale, const float* residual, float* new_residual,
                      uint16_t* dst, int64_t n) {
  return residual ? compress_feedback<K, kCheck>(src, scale, residual, new_residual, dst, n)
                  : compress_plain<K, kCheck>(src, scale, dst, n);
}

// Division, not a multiply by the reciprocal: ATen's CPU kernel for a 16-bit tensor
// divided by a scalar computes float(a) / b (div_true_kernel, BinaryOpsKernel.cpp).
template <HalfKind K, bool kCheck>
FASTDDP_VECTOR_CLONES int cast_divide(const float* __restrict src, float divisor,
                                      uint16_t* __restrict dst, int64_t n) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (kCheck) bad |= static_cast<int>((src[i] - src[i]) != 0.0f);
    const float cast = float_from_half_bits<K>(half_bits_from_float<K>(src[i]));
    dst[i] = half_bits_from_float<K>(cast / divisor);
  }
  return bad;
}

template <HalfKind K>
FASTDDP_VECTOR_CLONES void decompress(const uint16_t* __restrict src, float* __restrict dst,
                                      int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_from_half_bits<K>(src[i]);
}

// Blocked so the float accumulators stay in L1 while the shards stream by.
template <HalfKind K>
FASTDDP_VECTOR_CLONES void sum_shards(const uint16_t* __restrict shards, int64_t stride,
                                      int64_t count, uint16_t* __restrict out, int64_t n) {
  constexpr int64_t kBlock = 1024;
  float acc[kBlock];
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t len = n - begin < kBlock ? n - begin : kBlock;
    const uint16_t* first = shards + begin;
    for (int64_t i = 0; i < len; ++i) acc[i] = float_from_half_bits<K>(first[i]);
    for (int64_t r = 1; r < count; ++r) {
      const uint16_t* s = shards + r * stride + begin;
      for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] + float_from_half_bits<K>(s[i]);
    }
    for (int64_t i = 0; i < len; ++i) out[begin + i] = half_bits_from_float<K>(acc[i]);
  }
}

// sum_shards<kFloat16> with the F16C conversions, blocked the same way.
void sum_shards_f16c(const uint16_t* shards, int64_t stride, int64_t count, uint16_t* out,
                     int64_t n) {
  constexpr int64_t kBlock = 1024;
  float acc[kBlock];
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t len = n - begin < kBlock ? n - begin : kBlock;
    f16c::to_float(shards + begin, acc, len);
    for (int64_t r = 1; r < count; ++r) f16c::add_to_float(shards + r * stride + begin, acc, len);
    f16c::from_float(acc, out + begin, len);
  }
}

}  // namespace

void compress_cpu(HalfKind kind, const float* src, float scale, const float* residual,
                  float* new_residual, uint16_t* dst, int64_t n, int32_t* nonfinite) {
  const bool bf16 = kind == HalfKind::kBFloat16;
  if (!bf16 && f16c::available()) {
    if (f16c::compress(src, scale, residual, new_residual, dst, n, nonfinite != nullptr)) {
      *nonfinite = 1;
    }
    return;
  }
  const float* r = residual;
  float* nr = new_residual;
  if (nonfinite == nullptr) {
    bf16 ? compress_one_kind<HalfKind::kBFloat16, false>(src, scale, r, nr, dst, n)
         : compress_one_kind<HalfKind::kFloat16, false>(src, scale, r, nr, dst, n);
    return;
  }
  const int bad = bf16 ? compress_one_kind<HalfKind::kBFloat16, true>(src, scale, r, nr, dst, n)
                       : compress_one_kind<HalfKind::kFloat16, true>(src, scale, r, nr, dst, n);
  if (bad) *nonfinite = 1;
}

void cast_divide_cpu(HalfKind kind, const float* src, float divisor, uint16_t* dst, int64_t n,
                     int32_t* nonfinite) {
  const bool bf16 = kind == HalfKind::kBFloat16;
  if (!bf16 && f16c::available()) {
    if (f16c::cast_divide(src, divisor, dst, n, nonfinite != nullptr)) *nonfinite = 1;
    return;
  }
  if (nonfinite == nullptr) {
    bf16 ? cast_divide<HalfKind::kBFloat16, false>(src, divisor, dst, n)
         : cast_divide<HalfKind::kFloat16, false>(src, divisor, dst, n);
    return;
  }
  const int bad = bf16 ? cast_divide<HalfKind::kBFloat16, true>(src, divisor, dst, n)
                       : cast_divide<HalfKind::kFloat16, true>(src, divisor, dst, n);
  if (bad) *nonfinite = 1;
}

void decompress_cpu(HalfKind kind, const uint16_t* src, float* dst, int64_t n) {
  if (kind == HalfKind::kFloat16 && f16c::available()) {
    return f16c::to_float(src, dst, n);
  }
  kind == HalfKind::kBFloat16 ? decompress<HalfKind::kBFloat16>(src, dst, n)
                              : decompress<HalfKind::kFloat16>(src, dst, n);
}

void sum_shards_cpu(HalfKind kind, const uint16_t* shards, int64_t stride, int64_t count,
                    uint16_t* out, int64_t n) {
  if (count <= 0) return;
  if (kind == HalfKind::kFloat16 && f16c::available()) {
    return sum_shards_f16c(shards, stride, count, out, n);
  }
  kind == HalfKind::kBFloat16 ? sum_shards<HalfKind::kBFloat16>(shards, stride, count, out, n)
                              : sum_shards<HalfKind::kFloat16>(shards, stride, count, out, n);
}

}  // namespace fastddp::kernels
