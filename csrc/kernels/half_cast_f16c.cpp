// F16C versions of the float16 loops (see half_cast_f16c.h). Each operation
// is the scalar loop's, one instruction for eight values: a multiply, an add
// and a division rounded on their own (no FMA), then the conversion.
#include "half_cast_f16c.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define FASTDDP_HAVE_F16C_PATH 1
#include <immintrin.h>
#endif

namespace fastddp::kernels::f16c {

#if defined(FASTDDP_HAVE_F16C_PATH)

namespace {

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

#define FASTDDP_F16C __attribute__((target("avx2,f16c")))

// The tail (n % 8 values) through the same instructions, one value at a time.
FASTDDP_F16C inline uint16_t half_of(float x) {
  return static_cast<uint16_t>(_cvtss_sh(x, kRound));
}
FASTDDP_F16C inline float float_of(uint16_t h) { return _cvtsh_ss(h); }

// Lanes of x that are NaN or infinite: (x - x) != 0, unordered included.
FASTDDP_F16C inline int nonfinite_lanes(__m256 x) {
  return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_setzero_ps(), _CMP_NEQ_UQ));
}

FASTDDP_F16C inline __m256 load_halves(const uint16_t* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}

FASTDDP_F16C inline void store_halves(uint16_t* dst, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(v, kRound));
}

}  // namespace

bool available() {
  static const bool ok = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
  return ok;
}

FASTDDP_F16C bool compress(const float* src, float scale, const float* residual,
                           float* new_residual, uint16_t* dst, int64_t n, bool check) {
  const __m256 s = _mm256_set1_ps(scale);
  int bad = 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(src + i);
    if (check) bad |= nonfinite_lanes(g);
    __m256 v = _mm256_mul_ps(g, s);
    if (residual != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(residual + i));
    const __m128i h = _mm256_cvtps_ph(v, kRound);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
    if (residual != nullptr) _mm256_storeu_ps(new_residual + i, _mm256_sub_ps(v, _mm256_cvtph_ps(h)));
  }
  for (; i < n; ++i) {
    if (check) bad |= static_cast<int>((src[i] - src[i]) != 0.0f);
    float v = src[i] * scale;
    if (residual != nullptr) v = v + residual[i];
    dst[i] = half_of(v);
    if (residual != nullptr) new_residual[i] = v - float_of(dst[i]);
  }
  return bad != 0;
}

FASTDDP_F16C bool cast_divide(const float* src, float divisor, uint16_t* dst, int64_t n,
                              bool check) {
  const __m256 d = _mm256_set1_ps(divisor);
  int bad = 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(src + i);
    if (check) bad |= nonfinite_lanes(g);
    const __m256 cast = _mm256_cvtph_ps(_mm256_cvtps_ph(g, kRound));
    store_halves(dst + i, _mm256_div_ps(cast, d));
  }
  for (; i < n; ++i) {
    if (check) bad |= static_cast<int>((src[i] - src[i]) != 0.0f);
    dst[i] = half_of(float_of(half_of(src[i])) / divisor);
  }
  return bad != 0;
}

FASTDDP_F16C void from_float(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store_halves(dst + i, _mm256_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = half_of(src[i]);
}

FASTDDP_F16C void to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_halves(src + i));
  for (; i < n; ++i) dst[i] = float_of(src[i]);
}

FASTDDP_F16C void add_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), load_halves(src + i)));
  }
  for (; i < n; ++i) dst[i] = dst[i] + float_of(src[i]);
}

#else  // no F16C path in this build: available() is false and nothing else is called

bool available() { return false; }
bool compress(const float*, float, const float*, float*, uint16_t*, int64_t, bool) { return false; }
bool cast_divide(const float*, float, uint16_t*, int64_t, bool) { return false; }
void from_float(const float*, uint16_t*, int64_t) {}
void to_float(const uint16_t*, float*, int64_t) {}
void add_to_float(const uint16_t*, float*, int64_t) {}

#endif

}  // namespace fastddp::kernels::f16c
