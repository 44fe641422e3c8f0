// The non-finite gradient check (check_for_nan_in_grad), fused into the
// copy of a gradient into its bucket slot so that checking costs no extra
// pass over memory.
//
// Raw pointers and sizes only, like half_cast.h, so the loops are Catch2-tested
// without LibTorch. The check is branch-free, an integer OR of (x - x) != 0
// (x - x is +0 for every finite x and NaN for NaN and +-inf), so the loops
// vectorize; a float sum would not (it must not be reassociated).
#pragma once

#include <cstdint>

namespace fastddp::kernels {

// dst[i] = src[i] * scale (dst may equal src; scale 1 is a plain copy).
// Returns true when some src[i] is NaN or infinite.
bool scale_copy_check_cpu(const float* src, float* dst, float scale, int64_t n);
bool scale_copy_check_cpu(const double* src, double* dst, double scale, int64_t n);

// Whether some src[i] is NaN or infinite (no write).
bool any_nonfinite_cpu(const float* src, int64_t n);
bool any_nonfinite_cpu(const double* src, int64_t n);

// --- CUDA (built only with CUDA; `stream` is a cudaStream_t) ----------------------
// The same copy, setting *flag (device memory) to 1 when a value is not
// finite; it is never cleared here. dst may equal src. flag nullptr: no check
// (the default hook's copy-in without check_for_nan_in_grad).
void scale_copy_check_cuda(const float* src, float* dst, float scale, int64_t n, int32_t* flag,
                           void* stream);
void scale_copy_check_cuda(const double* src, double* dst, double scale, int64_t n,
                           int32_t* flag, void* stream);

}  // namespace fastddp::kernels
