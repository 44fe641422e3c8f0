// Tensor-level entry points to the half-cast kernels: checks, device guard,
// current CUDA stream, CPU threading. Shared by the compression hooks and by
// the test/benchmark bindings, so both exercise the same code.
#pragma once

#include <ATen/Tensor.h>

#include <vector>

#include "../../core/half_rounding.h"

namespace fastddp {

// bfloat16 / float16 for kBFloat16 / kFloat16, and back; other dtypes raise.
c10::ScalarType scalar_type_of(HalfKind kind);
HalfKind half_kind_of(c10::ScalarType type);

// dst = half(src * scale) with optional error feedback (residual updated in
// place); see kernels/half_cast.h. src and residual: float32, dense, same
// numel and device as dst; dst: a contiguous 16-bit tensor of `kind`. Memory
// is read in storage order (a channels_last grad stays channels_last).
// check_for_nan_in_grad, in the same pass: *host_bad (CPU) becomes whether src
// holds a NaN or an infinity; *device_flag (CUDA, device memory) is set to 1
// if it does. Either may be null.
// residual / new_residual (error feedback, both or neither): the residual read
// and where the new one goes, another float32 tensor of src's size.
void half_compress_into(HalfKind kind, const at::Tensor& src, double scale,
                        const at::Tensor* residual, const at::Tensor* new_residual,
                        const at::Tensor& dst, bool* host_bad = nullptr,
                        int32_t* device_flag = nullptr);

// dst = half(src) divided by `divisor` in 16 bits, rounded as torch's
// fp16_compress_hook / bf16_compress_hook round on src's device (Note [torch's half
// rounding] in half_compress.h); same tensors and checks as half_compress_into.
void half_cast_divide_into(HalfKind kind, const at::Tensor& src, int64_t divisor,
                           const at::Tensor& dst, bool* host_bad = nullptr,
                           int32_t* device_flag = nullptr);

// dst = float(src) element by element in storage order; pairs of (src 16-bit
// contiguous, dst float32 dense). On CUDA all pairs go in one launch.
void half_decompress_many(HalfKind kind, const std::vector<at::Tensor>& srcs,
                          const std::vector<at::Tensor>& dsts);

// out = half(sum over the `count` rows of shards, in row order, in float32):
// shards is a contiguous (count * n) buffer, out is n elements.
void half_sum_shards_into(HalfKind kind, const at::Tensor& shards, int64_t count,
                          const at::Tensor& out);

}  // namespace fastddp
