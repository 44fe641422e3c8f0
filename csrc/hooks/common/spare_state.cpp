#include "spare_state.h"

#include <ATen/ATen.h>

#include <atomic>

#if defined(FASTDDP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../../kernels/copy_unless.h"
#endif

#include "../../util/current_stream.h"
#include "../../util/message.h"
#include "../../util/step_cost.h"
#include "../../reducer/finite_checks.h"

namespace fastddp {
namespace {
std::atomic<bool> device_path_for_tests{false};
}  // namespace

bool settle_as_on_device() { return device_path_for_tests.load(); }
void set_settle_as_on_device(bool on) { device_path_for_tests.store(on); }

at::Tensor settle_spares(const std::vector<Spare>& written, const at::Tensor& finite,
                         const StateRead& state_read) {
  const c10::Device device = written.front().spare->device();
  if (device.is_cpu() && !settle_as_on_device()) {
    bool keep = !finite.defined() || finite.item<bool>();
    if (!keep) {
      const std::vector<at::Tensor> read = state_read(/*witness=*/false);
      keep = read.empty() || !all_finite(read).item<bool>();
    }
    if (keep) {
      for (const Spare& s : written) std::swap(*s.live, *s.spare);
    }
    return at::scalar_tensor(keep, at::kBool);
  }
  at::Tensor keep = finite.defined() ? finite.to(device)
                                     : at::ones({}, at::TensorOptions(device).dtype(at::kBool));
  const std::vector<at::Tensor> witness = state_read(/*witness=*/true);
  if (!witness.empty()) keep = keep.logical_or(all_finite(witness).logical_not());
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  for (const Spare& s : written) {
    const bool made = s.made || !s.live->defined();
    std::swap(*s.live, *s.spare);
    back.emplace_back(*s.live, made ? at::Tensor() : *s.spare);
  }
  put_back_unless(back, keep);
  return keep;
}

void put_back_unless(const std::vector<std::pair<at::Tensor, at::Tensor>>& pairs,
                     const at::Tensor& keep) {
  if (pairs.empty()) return;
  if (keep.is_cpu()) {
    if (keep.item<bool>()) return;
    for (const auto& [dst, src] : pairs) {
      cost::add(cost::kStateCopy, (src.defined() ? 2 : 1) * static_cast<int64_t>(dst.nbytes()));
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
  void* stream = current_cuda_stream(keep);
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
