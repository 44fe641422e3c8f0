#include "quant8_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "../../kernels/block_absmax.h"
#include "../../kernels/quant8.h"
#include "../../util/current_stream.h"
#include "../../util/message.h"
#include "../../util/profile_range.h"

#if defined(FASTDDP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fastddp {
namespace {

void check_quant8_block(int64_t block) {
  FASTDDP_CHECK(block > 0 && block <= kernels::kQuant8MaxBlock,
                "fastddp quant8: block must be in [1, ", kernels::kQuant8MaxBlock, "], got ",
                block);
}

void check_tensor(const at::Tensor& t, at::ScalarType type, const char* what) {
  FASTDDP_CHECK(t.defined() && t.is_contiguous(), "fastddp quant8: ", what, " must be contiguous");
  FASTDDP_CHECK(t.scalar_type() == type, "fastddp quant8: ", what, " must be ", type, ", got ",
                t.scalar_type());
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* what) {
  FASTDDP_CHECK(a.device() == b.device(), "fastddp quant8: ", what, " is on ", b.device(),
                ", expected ", a.device());
}

}  // namespace

Quant8Format quant8_format_from_name(const std::string& name, const std::string& what) {
  if (name == "int8") return Quant8Format::kInt8;
  if (name == "e4m3") return Quant8Format::kFp8E4M3;
  if (name == "e5m2") return Quant8Format::kFp8E5M2;
  FASTDDP_CHECK_VALUE(false, what, " must be 'int8', 'e4m3' or 'e5m2', got '", name, "'");
}

std::string quant8_format_name(Quant8Format format) {
  switch (format) {
    case Quant8Format::kInt8:
      return "int8";
    case Quant8Format::kFp8E4M3:
      return "e4m3";
    case Quant8Format::kFp8E5M2:
      return "e5m2";
  }
  return "?";
}

void quantize8_into(Quant8Format format, const at::Tensor& src, int64_t block,
                    const at::Tensor& codes, const at::Tensor& scales, const at::Tensor* err) {
  FASTDDP_PROFILE_RANGE("fastddp quantize8");
  check_quant8_block(block);
  check_tensor(src, at::kFloat, "src");
  check_tensor(codes, at::kByte, "codes");
  check_tensor(scales, at::kFloat, "scales");
  const int64_t n = src.numel();
  const int64_t blocks = quant8_num_blocks(n, block);
  FASTDDP_CHECK(codes.numel() == n && scales.numel() == blocks, "fastddp quantize8: ", n,
                " values need ", n, " codes and ", blocks, " scales, got ", codes.numel(), " and ",
                scales.numel());
  check_same_device(src, codes, "codes");
  check_same_device(src, scales, "scales");
  float* e = nullptr;
  if (err != nullptr) {
    check_tensor(*err, at::kFloat, "err");
    check_same_device(src, *err, "err");
    FASTDDP_CHECK(err->numel() == n, "fastddp quantize8: err must have ", n, " elements");
    e = err->data_ptr<float>();
  }
  const float* s = src.const_data_ptr<float>();
  uint8_t* c = codes.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  if (src.is_cuda()) {
#if defined(FASTDDP_WITH_CUDA)
    const c10::cuda::CUDAGuard guard(src.device());
    kernels::quantize8_cuda(format, s, n, block, c, sc, e, current_cuda_stream(src));
    return;
#else
    FASTDDP_FAIL_WITHOUT_CUDA("8-bit quantization");
#endif
  }
  FASTDDP_CHECK(src.is_cpu(), "fastddp quantize8: unsupported device ", src.device());
  at::parallel_for(0, blocks, kernels::cpu_task_blocks(block), [&](int64_t b0, int64_t b1) {
    kernels::quantize8_cpu(format, s, n, block, c, sc, e, b0, b1);
  });
}

void dequantize8_into(Quant8Format format, const at::Tensor& codes, const at::Tensor& scales,
                      int64_t block, const at::Tensor& dst) {
  FASTDDP_PROFILE_RANGE("fastddp dequantize8");
  check_quant8_block(block);
  check_tensor(codes, at::kByte, "codes");
  check_tensor(scales, at::kFloat, "scales");
  check_tensor(dst, at::kFloat, "dst");
  const int64_t n = dst.numel();
  FASTDDP_CHECK(n <= codes.numel() && scales.numel() == quant8_num_blocks(codes.numel(), block),
                "fastddp dequantize8: ", codes.numel(), " codes need ",
                quant8_num_blocks(codes.numel(), block), " scales (got ", scales.numel(),
                ") and at most as many outputs (got ", n, ")");
  check_same_device(codes, scales, "scales");
  check_same_device(codes, dst, "dst");
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  const float* sc = scales.const_data_ptr<float>();
  float* d = dst.data_ptr<float>();
  if (codes.is_cuda()) {
#if defined(FASTDDP_WITH_CUDA)
    const c10::cuda::CUDAGuard guard(codes.device());
    kernels::dequantize8_cuda(format, c, sc, n, block, d, current_cuda_stream(codes));
    return;
#else
    FASTDDP_FAIL_WITHOUT_CUDA("8-bit quantization");
#endif
  }
  FASTDDP_CHECK(codes.is_cpu(), "fastddp dequantize8: unsupported device ", codes.device());
  at::parallel_for(0, quant8_num_blocks(n, block), kernels::cpu_task_blocks(block),
                   [&](int64_t b0, int64_t b1) {
                     kernels::dequantize8_cpu(format, c, sc, n, block, d, b0, b1);
                   });
}

void sum_shards8_into(Quant8Format format, const at::Tensor& shards, int64_t count, int64_t n,
                      int64_t block, const at::Tensor& out_codes, const at::Tensor& out_scales) {
  FASTDDP_PROFILE_RANGE("fastddp sum shards8");
  check_quant8_block(block);
  check_tensor(shards, at::kByte, "shards");
  check_tensor(out_codes, at::kByte, "out_codes");
  check_tensor(out_scales, at::kFloat, "out_scales");
  const int64_t blocks = quant8_num_blocks(n, block);
  const int64_t shard_bytes = n + 4 * blocks;
  FASTDDP_CHECK(count > 0 && n % 4 == 0 && shards.numel() == count * shard_bytes &&
                  out_codes.numel() == n && out_scales.numel() == blocks,
                "fastddp sum_shards8: ", count, " shards of ", n, " values (a multiple of 4) "
                "need ", count * shard_bytes, " bytes, ", n, " codes and ", blocks,
                " scales out; got ", shards.numel(), ", ", out_codes.numel(), " and ",
                out_scales.numel());
  FASTDDP_CHECK(reinterpret_cast<uintptr_t>(shards.const_data_ptr()) % 4 == 0,
                "fastddp sum_shards8: shards must be 4-byte aligned");
  check_same_device(shards, out_codes, "out_codes");
  check_same_device(shards, out_scales, "out_scales");
  const uint8_t* s = shards.const_data_ptr<uint8_t>();
  uint8_t* c = out_codes.data_ptr<uint8_t>();
  float* sc = out_scales.data_ptr<float>();
  if (shards.is_cuda()) {
#if defined(FASTDDP_WITH_CUDA)
    const c10::cuda::CUDAGuard guard(shards.device());
    kernels::sum_shards8_cuda(format, s, shard_bytes, count, n, block, c, sc,
                              current_cuda_stream(shards));
    return;
#else
    FASTDDP_FAIL_WITHOUT_CUDA("8-bit quantization");
#endif
  }
  FASTDDP_CHECK(shards.is_cpu(), "fastddp sum_shards8: unsupported device ", shards.device());
  at::parallel_for(0, blocks, kernels::cpu_task_blocks(block), [&](int64_t b0, int64_t b1) {
    kernels::sum_shards8_cpu(format, s, shard_bytes, count, n, block, c, sc, b0, b1);
  });
}

}  // namespace fastddp
