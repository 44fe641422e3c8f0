// Tensor-level entry points to the 8-bit block quantization kernels
// (kernels/quant8.h): checks, device guard, current CUDA stream, CPU
// threading. Shared by the "int8" / "fp8" hooks and the test bindings
// (`_C._quantize8`, `_C._dequantize8`), so both run the same code.
#pragma once

#include <ATen/Tensor.h>

#include <string>

#include "../../core/quant8_codes.h"

namespace fastddp {

// "int8", "e4m3" (fp8 e4m3fn) or "e5m2"; anything else raises, naming `what`.
Quant8Format quant8_format_from_name(const std::string& name, const std::string& what);
std::string quant8_format_name(Quant8Format format);

inline int64_t quant8_num_blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

// codes (uint8, n) and scales (float32, num_blocks) of src (float32,
// contiguous, n). With err (float32, n; may be src itself): the quantization
// error src - dequantize(codes, scales). All contiguous on one device.
void quantize8_into(Quant8Format format, const at::Tensor& src, int64_t block,
                    const at::Tensor& codes, const at::Tensor& scales, const at::Tensor* err);

// dst (float32, contiguous, at most codes' numel) = the first dst.numel()
// dequantized values.
void dequantize8_into(Quant8Format format, const at::Tensor& codes, const at::Tensor& scales,
                      int64_t block, const at::Tensor& dst);

// The float32 sum, in shard order, of `count` packed shards of n values
// (shards: uint8, count * shard_bytes; shard r = n codes then num_blocks
// float32 scales at byte n, n a multiple of 4), re-quantized into out_codes /
// out_scales.
void sum_shards8_into(Quant8Format format, const at::Tensor& shards, int64_t count, int64_t n,
                      int64_t block, const at::Tensor& out_codes, const at::Tensor& out_scales);

}  // namespace fastddp
