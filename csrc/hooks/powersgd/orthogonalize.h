// Tensor-level entry point to the fused orthogonalization kernels
// (kernels/orthogonalize.h): checks what the kernels take, threads the CPU
// version over the batch and launches the CUDA one on the current stream.
#pragma once

#include <ATen/Tensor.h>

namespace fastddp {

// Orthogonalizes the columns of a (batch, n, r) tensor in place with the fused
// kernels (see Note [fused orthogonalization]: torch's Gram-Schmidt for
// r <= 2, QR-equivalent up to column signs for r > 2; on CUDA by CholeskyQR2
// from 8192 rows: Note [tall orthogonalization]) and returns true, when
// the tensor is contiguous, float32 or float64, with 1 <= r <= n, and r <= 64
// on CPU or r <= 32 on CUDA (in a CUDA build). Otherwise returns false without
// touching the tensor: the caller falls back to torch's op-by-op path.
// Never synchronizes with the GPU.
// With `src` (the same shape, dtype and device, contiguous): out of place,
// `src` read and `matrices` written (kernels/orthogonalize.h), else false with
// neither touched. The CUDA tall path has no out-of-place form: it copies src
// in first, a copy counted as the state's (util/step_cost.h).
bool fused_orthogonalize(at::Tensor& matrices, double epsilon, const at::Tensor& src = {});

// The CUDA tall path's arithmetic on a CPU (batch, n, r) tensor, threaded over
// row chunks, so that tests hold it against torch's QR: true when the shape
// takes the tall path (kernels::orthogonalize_tall) and the tensor is
// contiguous float32 or float64; otherwise false, the tensor untouched. On CPU
// fused_orthogonalize keeps Gram-Schmidt, which is faster there.
bool tall_orthogonalize_cpu(at::Tensor& matrices);

}  // namespace fastddp
