// CPU versions of PowerSGD's skinny products (see lowrank.h).
#include "lowrank.h"
#include "vector_clones.h"

namespace fastddp::kernels {
namespace {

constexpr int kLanes = 16;

FASTDDP_VECTOR_CLONES float dot(const float* __restrict a, const float* __restrict b,
                                int64_t n) {
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[j + l] * b[j + l];
  }
  float tail = 0.0f;
  for (; j < n; ++j) tail += a[j] * b[j];
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  return sum + tail;
}

// y += a * x
FASTDDP_VECTOR_CLONES void axpy(float a, const float* __restrict x, float* __restrict y,
                                int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

// y = a * x
FASTDDP_VECTOR_CLONES void scale_into(float a, const float* __restrict x, float* __restrict y,
                                      int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] = a * x[j];
}

// c = a - b
FASTDDP_VECTOR_CLONES void subtract(const float* __restrict a, const float* __restrict b,
                                    float* __restrict c, int64_t n) {
  for (int64_t j = 0; j < n; ++j) c[j] = a[j] - b[j];
}

}  // namespace

void lowrank_project_cpu(const float* mat, int64_t m, const float* q_t, int64_t r, float* p,
                         int64_t row_begin, int64_t row_end) {
  // The row is read from memory once; the other r - 1 dots find it in L1.
  for (int64_t i = row_begin; i < row_end; ++i) {
    for (int64_t k = 0; k < r; ++k) p[i * r + k] = dot(mat + i * m, q_t + k * m, m);
  }
}

void lowrank_back_project_cpu(const float* mat, int64_t n, int64_t m, const float* p, int64_t r,
                              float* q_t_out) {
  if (n == 0) {
    for (int64_t j = 0; j < r * m; ++j) q_t_out[j] = 0.0f;
    return;
  }
  for (int64_t k = 0; k < r; ++k) scale_into(p[k], mat, q_t_out + k * m, m);
  for (int64_t i = 1; i < n; ++i) {
    for (int64_t k = 0; k < r; ++k) axpy(p[i * r + k], mat + i * m, q_t_out + k * m, m);
  }
}

void lowrank_expand_cpu(const float* p, const float* q_t, int64_t m, int64_t r, float* out,
                        const float* src, float* err, int64_t row_begin, int64_t row_end) {
  for (int64_t i = row_begin; i < row_end; ++i) {
    float* row = out + i * m;
    scale_into(p[i * r], q_t, row, m);
    for (int64_t k = 1; k < r; ++k) axpy(p[i * r + k], q_t + k * m, row, m);
    if (src != nullptr) subtract(src + i * m, row, err + i * m, m);
  }
}

void transpose_cpu(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) dst[j * rows + i] = src[i * cols + j];
  }
}

}  // namespace fastddp::kernels
