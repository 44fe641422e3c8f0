#include "half_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>

#include "../../kernels/half_cast.h"
#include "../../util/current_stream.h"
#include "../../util/message.h"
#include "../../util/profile_range.h"

#if defined(FASTDDP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fastddp {
namespace {

// Below this many elements a CPU pass is not worth waking more threads for.
constexpr int64_t kHalfGrain = 1 << 16;

const char* kind_name(HalfKind kind) {
  return kind == HalfKind::kBFloat16 ? "bfloat16" : "float16";
}

void check_dense(const at::Tensor& t, const char* what) {
  FASTDDP_CHECK(t.defined(), "fastddp half ops: ", what, " is undefined");
  FASTDDP_CHECK(t.is_non_overlapping_and_dense(), "fastddp half ops: ", what,
                " must be dense and non-overlapping, got strides ", t.strides());
}

void check_float(const at::Tensor& t, const char* what) {
  check_dense(t, what);
  FASTDDP_CHECK(t.scalar_type() == at::kFloat, "fastddp half ops: ", what,
                " must be float32, got ", t.scalar_type());
}

void check_half(const at::Tensor& t, HalfKind kind, const char* what) {
  FASTDDP_CHECK(t.defined() && t.is_contiguous(), "fastddp half ops: ", what,
                " must be contiguous");
  FASTDDP_CHECK(t.scalar_type() == scalar_type_of(kind), "fastddp half ops: ", what, " must be ",
                kind_name(kind), ", got ", t.scalar_type());
}

uint16_t* half_ptr(const at::Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); }

}  // namespace

c10::ScalarType scalar_type_of(HalfKind kind) {
  return kind == HalfKind::kBFloat16 ? at::kBFloat16 : at::kHalf;
}

HalfKind half_kind_of(c10::ScalarType type) {
  if (type == at::kBFloat16) return HalfKind::kBFloat16;
  if (type == at::kHalf) return HalfKind::kFloat16;
  FASTDDP_CHECK(false, "fastddp: expected bfloat16 or float16, got ", type);
}

namespace {

void check_compress(HalfKind kind, const at::Tensor& src, const at::Tensor& dst) {
  check_float(src, "src");
  check_half(dst, kind, "dst");
  FASTDDP_CHECK(src.numel() == dst.numel() && src.device() == dst.device(),
                "fastddp half_compress: src has ", src.numel(), " elements on ", src.device(),
                ", dst ", dst.numel(), " on ", dst.device());
}

// On CUDA, `on_cuda(stream)` under src's device guard; on the CPU, `chunk(begin, end,
// flag)` over src's elements on the CPU threads, and *host_bad (when given) becomes
// whether any chunk set its flag.
template <typename OnCuda, typename Chunk>
void run_to_half(const at::Tensor& src, bool* host_bad, const OnCuda& on_cuda,
                 const Chunk& chunk) {
  if (src.is_cuda()) {
#if defined(FASTDDP_WITH_CUDA)
    const c10::cuda::CUDAGuard guard(src.device());
    on_cuda(current_cuda_stream(src));
    return;
#else
    FASTDDP_FAIL_WITHOUT_CUDA("a half op");
#endif
  }
  FASTDDP_CHECK(src.is_cpu(), "fastddp half_compress: unsupported device ", src.device());
  std::atomic<int32_t> bad{0};
  at::parallel_for(0, src.numel(), kHalfGrain, [&](int64_t begin, int64_t end) {
    int32_t chunk_bad = 0;
    chunk(begin, end, host_bad != nullptr ? &chunk_bad : nullptr);
    if (chunk_bad) bad = 1;
  });
  if (host_bad != nullptr) *host_bad = bad.load() != 0;
}

}  // namespace

void half_compress_into(HalfKind kind, const at::Tensor& src, double scale,
                        const at::Tensor* residual, const at::Tensor* new_residual,
                        const at::Tensor& dst, bool* host_bad, int32_t* device_flag) {
  FASTDDP_PROFILE_RANGE("fastddp compress");
  check_compress(kind, src, dst);
  const float* r = nullptr;
  float* nr = nullptr;
  FASTDDP_CHECK((residual == nullptr) == (new_residual == nullptr),
                "fastddp half_compress: residual and new_residual go together");
  if (residual != nullptr) {
    for (const at::Tensor* t : {residual, new_residual}) {
      check_float(*t, "residual");
      FASTDDP_CHECK(t->numel() == src.numel() && t->device() == src.device(),
                    "fastddp half_compress: residual must match src in size and device");
    }
    FASTDDP_CHECK(!residual->is_alias_of(*new_residual),
                  "fastddp half_compress: the new residual must not overlap the one read");
    r = residual->const_data_ptr<float>();
    nr = new_residual->data_ptr<float>();
  }
  const float* s = src.data_ptr<float>();
  uint16_t* d = half_ptr(dst);
  const auto f_scale = static_cast<float>(scale);
  run_to_half(
      src, host_bad,
      [&](void* stream) {
        kernels::compress_cuda(kind, s, f_scale, r, nr, d, src.numel(), stream, device_flag);
      },
      [&](int64_t begin, int64_t end, int32_t* flag) {
        kernels::compress_cpu(kind, s + begin, f_scale, r ? r + begin : nullptr,
                              nr ? nr + begin : nullptr, d + begin,
                              end - begin, flag);
      });
}

void half_cast_divide_into(HalfKind kind, const at::Tensor& src, int64_t divisor,
                           const at::Tensor& dst, bool* host_bad, int32_t* device_flag) {
  FASTDDP_PROFILE_RANGE("fastddp compress");
  check_compress(kind, src, dst);
  FASTDDP_CHECK(divisor > 0, "fastddp half_cast_divide: the divisor must be positive, got ",
                divisor);
  const float* s = src.data_ptr<float>();
  uint16_t* d = half_ptr(dst);
  // The scalar as ATen's opmath (float) sees it.
  const auto f_divisor = static_cast<float>(divisor);
  run_to_half(
      src, host_bad,
      [&](void* stream) {
        kernels::cast_divide_cuda(kind, s, f_divisor, d, src.numel(), stream, device_flag);
      },
      [&](int64_t begin, int64_t end, int32_t* flag) {
        kernels::cast_divide_cpu(kind, s + begin, f_divisor, d + begin, end - begin, flag);
      });
}

void half_decompress_many(HalfKind kind, const std::vector<at::Tensor>& srcs,
                          const std::vector<at::Tensor>& dsts) {
  FASTDDP_PROFILE_RANGE("fastddp decompress");
  FASTDDP_CHECK(srcs.size() == dsts.size(), "fastddp half_decompress: ", srcs.size(),
                " sources for ", dsts.size(), " destinations");
  if (srcs.empty()) return;
  for (size_t i = 0; i < srcs.size(); ++i) {
    check_half(srcs[i], kind, "src");
    check_float(dsts[i], "dst");
    FASTDDP_CHECK(srcs[i].numel() == dsts[i].numel() && srcs[i].device() == dsts[i].device() &&
                    srcs[i].device() == srcs.front().device(),
                  "fastddp half_decompress: pair ", i, " differs in size or device");
  }
  if (srcs.front().is_cuda()) {
#if defined(FASTDDP_WITH_CUDA)
    std::vector<kernels::DecompressRange> ranges;
    ranges.reserve(srcs.size());
    for (size_t i = 0; i < srcs.size(); ++i) {
      ranges.push_back({half_ptr(srcs[i]), dsts[i].data_ptr<float>(), srcs[i].numel()});
    }
    const c10::cuda::CUDAGuard guard(srcs.front().device());
    kernels::decompress_multi_cuda(kind, ranges.data(), static_cast<int64_t>(ranges.size()),
                                   current_cuda_stream(srcs.front()));
    return;
#else
    FASTDDP_FAIL_WITHOUT_CUDA("a half op");
#endif
  }
  for (size_t i = 0; i < srcs.size(); ++i) {
    const uint16_t* s = half_ptr(srcs[i]);
    float* d = dsts[i].data_ptr<float>();
    at::parallel_for(0, srcs[i].numel(), kHalfGrain, [&](int64_t begin, int64_t end) {
      kernels::decompress_cpu(kind, s + begin, d + begin, end - begin);
    });
  }
}

void half_sum_shards_into(HalfKind kind, const at::Tensor& shards, int64_t count,
                          const at::Tensor& out) {
  FASTDDP_PROFILE_RANGE("fastddp sum shards");
  check_half(shards, kind, "shards");
  check_half(out, kind, "out");
  FASTDDP_CHECK(count > 0 && shards.numel() == count * out.numel() &&
                  shards.device() == out.device(),
                "fastddp half_sum_shards: ", shards.numel(), " shard elements for ", count,
                " rows of ", out.numel());
  const int64_t n = out.numel();
  const uint16_t* s = half_ptr(shards);
  uint16_t* o = half_ptr(out);
  if (out.is_cuda()) {
#if defined(FASTDDP_WITH_CUDA)
    const c10::cuda::CUDAGuard guard(out.device());
    kernels::sum_shards_cuda(kind, s, n, count, o, n, current_cuda_stream(out));
    return;
#else
    FASTDDP_FAIL_WITHOUT_CUDA("a half op");
#endif
  }
  at::parallel_for(0, n, kHalfGrain, [&](int64_t begin, int64_t end) {
    kernels::sum_shards_cpu(kind, s + begin, n, count, o + begin, end - begin);
  });
}

}  // namespace fastddp
