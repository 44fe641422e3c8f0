// DiLoCo's int4 wire: tensor-level entry points to the 4-bit block quantization kernels
// (kernels/quant4.h, Note [int4 wire format]): checks, device guard, current
// CUDA stream, CPU threading. Bound as `_C.quantize4`, `_C.dequantize4` and
// `_C.sum_shards4` for DiLoCo's wire="int4" (python/fastddp/diloco/) and the
// tests, so both run the same code.
#pragma once

#include <ATen/Tensor.h>

namespace fastddp {

// codes (uint8, (n + 1) / 2) and scales (float32, ceil(n / block)) of src
// (float32, n). With err (float32, n; may be src itself): the quantization
// error src - dequantize(codes, scales). block is even. All contiguous on one
// device.
void quantize4_into(const at::Tensor& src, int64_t block, const at::Tensor& codes,
                    const at::Tensor& scales, const at::Tensor* err);

// dst (float32, n) = the n values of codes and scales (at least (n + 1) / 2
// codes and exactly ceil(n / block) scales).
void dequantize4_into(const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                      int64_t block, const at::Tensor& dst);

// dst (float32, n) = the float32 sum, in shard order, of `count` packed shards
// of n values (shards: uint8, count * quant4_shard_bytes(n, block), 4-byte
// aligned; shard r = its codes, zero padding to 4 bytes, its float32 scales).
void sum_shards4_into(const at::Tensor& shards, int64_t count, int64_t n, int64_t block,
                      const at::Tensor& dst);

}  // namespace fastddp
