// CPU versions of the non-finite checks (see nonfinite.h).
#include "nonfinite.h"

#include "vector_clones.h"

namespace fastddp::kernels {

namespace {

// Scaling is a separate multiply, not folded into the check: a grad of 1e38
// times 1/world_size is finite, and so must be judged on its own value.
template <typename T>
FASTDDP_VECTOR_CLONES bool scale_copy_check(const T* src, T* dst, T scale, int64_t n) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T x = src[i];
    bad |= static_cast<int>((x - x) != T(0));
    dst[i] = x * scale;
  }
  return bad != 0;
}

template <typename T>
FASTDDP_VECTOR_CLONES bool any_nonfinite(const T* src, int64_t n) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<int>((src[i] - src[i]) != T(0));
  return bad != 0;
}

}  // namespace

bool scale_copy_check_cpu(const float* src, float* dst, float scale, int64_t n) {
  return scale_copy_check(src, dst, scale, n);
}
bool scale_copy_check_cpu(const double* src, double* dst, double scale, int64_t n) {
  return scale_copy_check(src, dst, scale, n);
}
bool any_nonfinite_cpu(const float* src, int64_t n) { return any_nonfinite(src, n); }
bool any_nonfinite_cpu(const double* src, int64_t n) { return any_nonfinite(src, n); }

}  // namespace fastddp::kernels
