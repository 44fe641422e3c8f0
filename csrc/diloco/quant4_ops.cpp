#include "quant4_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "../kernels/block_absmax.h"
#include "../kernels/quant4.h"
#include "../util/current_stream.h"
#include "../util/message.h"
#include "../util/profile_range.h"

#if defined(FASTDDP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fastddp {
namespace {

int64_t num_blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

// An even block keeps each byte inside one block, so CPU tasks (whole blocks) never
// write the same byte.
void check_quant4_block(int64_t block) {
  FASTDDP_CHECK(block > 0 && block % 2 == 0, "fastddp quant4: block must be even and positive, "
                "got ", block);
}

// t is contiguous, of `type`, `numel` elements (-1: any), on `device`.
void check_quant4_tensor(const at::Tensor& t, at::ScalarType type, int64_t numel,
                         const at::Device& device, const char* what) {
  FASTDDP_CHECK(t.defined() && t.is_contiguous(), "fastddp quant4: ", what, " must be contiguous");
  FASTDDP_CHECK(t.scalar_type() == type, "fastddp quant4: ", what, " must be ", type, ", got ",
                t.scalar_type());
  FASTDDP_CHECK(numel < 0 || t.numel() == numel, "fastddp quant4: ", what, " must have ", numel,
                " elements, got ", t.numel());
  FASTDDP_CHECK(t.device() == device, "fastddp quant4: ", what, " is on ", t.device(),
                ", expected ", device);
}

// Runs `cpu` over the blocks in parallel tasks, or `cuda` on the current stream of t's device.
template <typename Cpu, typename Cuda>
void dispatch(const at::Tensor& t, int64_t blocks, int64_t block, const char* what, Cpu cpu,
              Cuda cuda) {
  if (t.is_cuda()) {
#if defined(FASTDDP_WITH_CUDA)
    const c10::cuda::CUDAGuard guard(t.device());
    cuda(current_cuda_stream(t));
    return;
#else
    (void)cuda;
    FASTDDP_FAIL_WITHOUT_CUDA("4-bit quantization");
#endif
  }
  FASTDDP_CHECK(t.is_cpu(), "fastddp ", what, ": unsupported device ", t.device());
  at::parallel_for(0, blocks, kernels::cpu_task_blocks(block), cpu);
}

}  // namespace

void quantize4_into(const at::Tensor& src, int64_t block, const at::Tensor& codes,
                    const at::Tensor& scales, const at::Tensor* err) {
  FASTDDP_PROFILE_RANGE("fastddp quantize4");
  check_quant4_block(block);
  const at::Device device = src.device();
  check_quant4_tensor(src, at::kFloat, -1, device, "src");
  const int64_t n = src.numel();
  const int64_t blocks = num_blocks(n, block);
  check_quant4_tensor(codes, at::kByte, kernels::quant4_code_bytes(n), device, "codes");
  check_quant4_tensor(scales, at::kFloat, blocks, device, "scales");
  float* e = nullptr;
  if (err != nullptr) {
    check_quant4_tensor(*err, at::kFloat, n, device, "err");
    e = err->data_ptr<float>();
  }
  const float* s = src.const_data_ptr<float>();
  uint8_t* c = codes.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  dispatch(
      src, blocks, block, "quantize4",
      [&](int64_t b0, int64_t b1) { kernels::quantize4_cpu(s, n, block, c, sc, e, b0, b1); },
      [&](void* stream) { kernels::quantize4_cuda(s, n, block, c, sc, e, stream); });
}

void dequantize4_into(const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                      int64_t block, const at::Tensor& dst) {
  FASTDDP_PROFILE_RANGE("fastddp dequantize4");
  check_quant4_block(block);
  FASTDDP_CHECK(n >= 0, "fastddp dequantize4: n must be non-negative, got ", n);
  const at::Device device = codes.device();
  check_quant4_tensor(codes, at::kByte, -1, device, "codes");
  FASTDDP_CHECK(codes.numel() >= kernels::quant4_code_bytes(n), "fastddp dequantize4: ", n,
                " values need ", kernels::quant4_code_bytes(n), " code bytes, got ",
                codes.numel());
  const int64_t blocks = num_blocks(n, block);
  check_quant4_tensor(scales, at::kFloat, blocks, device, "scales");
  check_quant4_tensor(dst, at::kFloat, n, device, "dst");
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  const float* sc = scales.const_data_ptr<float>();
  float* d = dst.data_ptr<float>();
  dispatch(
      codes, blocks, block, "dequantize4",
      [&](int64_t b0, int64_t b1) { kernels::dequantize4_cpu(c, sc, n, block, d, b0, b1); },
      [&](void* stream) { kernels::dequantize4_cuda(c, sc, n, block, d, stream); });
}

void sum_shards4_into(const at::Tensor& shards, int64_t count, int64_t n, int64_t block,
                      const at::Tensor& dst) {
  FASTDDP_PROFILE_RANGE("fastddp sum shards4");
  check_quant4_block(block);
  FASTDDP_CHECK(count > 0 && n >= 0, "fastddp sum_shards4: count must be positive and n "
                "non-negative, got ", count, " and ", n);
  const at::Device device = shards.device();
  const int64_t shard_bytes = kernels::quant4_shard_bytes(n, block);
  check_quant4_tensor(shards, at::kByte, count * shard_bytes, device, "shards");
  FASTDDP_CHECK(reinterpret_cast<uintptr_t>(shards.const_data_ptr()) % 4 == 0,
                "fastddp sum_shards4: shards must be 4-byte aligned (their scales are float32)");
  check_quant4_tensor(dst, at::kFloat, n, device, "dst");
  const uint8_t* s = shards.const_data_ptr<uint8_t>();
  float* d = dst.data_ptr<float>();
  dispatch(
      shards, num_blocks(n, block), block, "sum_shards4",
      [&](int64_t b0, int64_t b1) {
        kernels::sum_shards4_cpu(s, shard_bytes, count, n, block, d, b0, b1);
      },
      [&](void* stream) { kernels::sum_shards4_cuda(s, shard_bytes, count, n, block, d, stream); });
}

}  // namespace fastddp
