#include "spare_state.h"

#include <ATen/ATen.h>

#include <atomic>

#if defined(FASTDDP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../../kernels/copy_unless.h"
#endif

#include "../../reducer/message.h"

namespace fastddp {
namespace {
std::atomic<bool> device_path_for_tests{false};
}  // namespace

bool settle_as_on_device() { return device_path_for_tests.load(); }
void set_settle_as_on_device(bool on) { device_path_for_tests.store(on); }

void put_back_unless(const std::vector<std::pair<at::Tensor, at::Tensor>>& pairs,
                     const at::Tensor& keep) {
  if (pairs.empty()) return;
  if (keep.is_cpu()) {
    if (keep.item<bool>()) return;
    for (const auto& [dst, src] : pairs) {
      at::Tensor out = dst;
      if (src.defined()) {
        out.copy_(src);
      } else {
        out.zero_();
      }
    }
    return;
  }
#if defined(FASTDDP_WITH_CUDA)
  FASTDDP_CHECK(keep.is_cuda() && keep.scalar_type() == at::kBool && keep.numel() == 1,
                "fastddp put_back_unless: keep must be one CUDA bool, got ", keep.sizes(), " ",
                keep.scalar_type(), " on ", keep.device());
  const c10::cuda::CUDAGuard guard(keep.device());
  void* stream = c10::cuda::getCurrentCUDAStream(keep.device().index()).stream();
  for (const auto& [dst, src] : pairs) {
    FASTDDP_CHECK(dst.device() == keep.device() && dst.is_contiguous() &&
                      (!src.defined() || (src.device() == dst.device() && src.is_contiguous() &&
                                          src.nbytes() == dst.nbytes())),
                  "fastddp put_back_unless: the tensors must be contiguous, of one size, on ",
                  keep.device());
    kernels::copy_unless_cuda(src.defined() ? src.const_data_ptr() : nullptr, dst.data_ptr(),
                              static_cast<int64_t>(dst.nbytes()), keep.const_data_ptr<bool>(),
                              stream);
  }
#else
  FASTDDP_CHECK(false, "fastddp put_back_unless: ", keep.device(), " in a build without CUDA");
#endif
}

}  // namespace fastddp
