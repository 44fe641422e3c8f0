#include "comm_hook.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <stdexcept>

#include "../kernels/nonfinite.h"
#include "../util/current_stream.h"
#include "../util/message.h"
#include "../util/step_cost.h"
#include "finite_checks.h"

#if defined(FASTDDP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fastddp {

at::Tensor sparse_grad_or_zeros(const Bucket& bucket, const at::Tensor& grad) {
  if (grad.defined()) return grad;
  const at::Tensor& like = bucket.views[0];
  return at::zeros(like.sizes(), like.options().layout(at::kSparse));
}

void CommHook::copy_in(Bucket& bucket, size_t slot, const at::Tensor& grad) {
  if (bucket.sparse) {
    bucket.sparse_grad = sparse_grad_or_zeros(bucket, grad);
    return;
  }
  if (!grad.defined()) {
    bucket.views[slot].zero_();
    cost::add(cost::kCopyIn, static_cast<int64_t>(bucket.views[slot].nbytes()));
    return;
  }
  scale_into_view(bucket, slot, grad, 1.0);
}

namespace {

// Whether grad and view walk the same elements in storage order, so that one
// flat loop over their data is the elementwise copy.
bool same_dense_layout(const at::Tensor& grad, const at::Tensor& view) {
  return grad.scalar_type() == view.scalar_type() && grad.device() == view.device() &&
         grad.is_non_overlapping_and_dense() && view.is_non_overlapping_and_dense() &&
         grad.strides() == view.strides();
}

template <typename T>
bool fused_scale_check(const at::Tensor& grad, at::Tensor& view, double scale) {
  const T* src = grad.const_data_ptr<T>();
  T* dst = view.data_ptr<T>();
  const auto s = static_cast<T>(scale);
  std::atomic<bool> bad{false};
  at::parallel_for(0, grad.numel(), 32768, [&](int64_t begin, int64_t end) {
    if (kernels::scale_copy_check_cpu(src + begin, dst + begin, s, end - begin)) bad = true;
  });
  return bad.load();
}

#if defined(FASTDDP_WITH_CUDA)
template <typename T>
void fused_scale_check_cuda(const at::Tensor& grad, at::Tensor& view, double scale,
                            int32_t* flag) {
  const c10::cuda::CUDAGuard device(grad.device());
  kernels::scale_copy_check_cuda(grad.const_data_ptr<T>(), view.data_ptr<T>(),
                                 static_cast<T>(scale), grad.numel(), flag,
                                 current_cuda_stream(grad));
}
#endif

}  // namespace

bool CommHook::fused_scale_into_view(Bucket& bucket, size_t slot, const at::Tensor& grad,
                                     double scale) {
  at::Tensor& view = bucket.views[slot];
  // The fused loops: a dense float32/float64 gradient laid out as its slot,
  // that must be written (in place with scale 1 there is nothing to copy).
  // Ours rather than ATen's mul_out because they also check for non-finite
  // values in the same pass, and because a direct launch skips the dispatcher
  // and TensorIterator, host time paid once per gradient (the GPU profile in
  // benchmarks/results/gpu.md: 13.5 us per copy-in). Same arithmetic as
  // mul_out: x * scale in the tensor's type.
  const bool fused = same_dense_layout(grad, view) && !(scale == 1.0 && same_elements(grad, view)) &&
                     (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kDouble);
  if (!fused) return false;
  // Read the gradient, write the slot; the check rides along.
  cost::add(cost::kCopyIn, 2 * static_cast<int64_t>(view.nbytes()));
  const bool is_float = grad.scalar_type() == at::kFloat;
  if (grad.is_cpu()) {
    const bool bad = is_float ? fused_scale_check<float>(grad, view, scale)
                              : fused_scale_check<double>(grad, view, scale);
    if (guard_ != nullptr) guard_->note(bucket.params[slot], bad);
    return true;
  }
#if defined(FASTDDP_WITH_CUDA)
  if (grad.is_cuda()) {
    int32_t* flag = guard_ != nullptr ? guard_->device_flag(bucket.params[slot], grad) : nullptr;
    is_float ? fused_scale_check_cuda<float>(grad, view, scale, flag)
             : fused_scale_check_cuda<double>(grad, view, scale, flag);
    return true;
  }
#endif
  return false;
}

void CommHook::scale_into_view(Bucket& bucket, size_t slot, const at::Tensor& grad,
                               double scale) {
  if (fused_scale_into_view(bucket, slot, grad, scale)) return;
  at::Tensor& view = bucket.views[slot];
  // In place with scale 1 (gradient_as_bucket_view): nothing moves.
  const bool moves = !same_elements(grad, view) || scale != 1.0;
  cost::add(cost::kCopyIn, moves ? 2 * static_cast<int64_t>(view.nbytes()) : 0);
  if (same_elements(grad, view)) {
    if (scale != 1.0) view.mul_(scale);
  } else if (scale == 1.0) {
    view.copy_(grad);
  } else {
    at::mul_out(view, grad, at::scalar_tensor(scale, at::kDouble));
  }
  check_grad(bucket, slot, view);
}

void CommHook::check_grad(const Bucket& bucket, size_t slot, const at::Tensor& grad) {
  if (guard_ == nullptr) return;
  cost::add(cost::kCheck, static_cast<int64_t>(grad.nbytes()));  // a pass of its own
  const size_t param = bucket.params[slot];
  if (grad.is_cpu()) {
    guard_->note(param, !cpu_all_finite(grad));
    return;
  }
  guard_->note_tensor(param, grad);
}

void CommHook::write_back(Bucket& bucket, const c10::IValue& result,
                          std::vector<at::Tensor>& dsts) {
  copy_flat_to_grads(bucket, hook_result_tensor(result, name()), dsts);
}

std::exception_ptr collective_error(const std::string& what, c10::ivalue::Future& failed) {
  return std::make_exception_ptr(
      std::runtime_error(what + " failed: " + failed.tryRetrieveErrorMessage()));
}

at::Tensor CommHook::result_tensor(const c10::IValue& result) {
  return hook_result_tensor(result, name());
}

// Ours rather than c10d::detail::parseCppCommHookResult: torch's answers an empty
// list or a wrong type with an internal assert; this names the hook and what it got.
at::Tensor hook_result_tensor(const c10::IValue& result, const std::string& hook_name) {
  if (result.isTensor()) return result.toTensor();
  // A process group written in Python completes its Work's future from Python
  // (torch.futures.Future.set_result), which holds a Python object: its tensors, as
  // torch's reducer reads them (c10d::detail::parseCppCommHookResult).
  if (result.isPyObject()) {
    std::vector<at::Tensor> tensors = result.toPyObjectHolder()->extractTensors();
    FASTDDP_CHECK(!tensors.empty(), "fastddp: comm hook '", hook_name,
                  "' completed its future with a Python object that holds no tensor");
    return tensors[0];
  }
  if (result.isTensorList()) {
    auto list = result.toTensorList();
    FASTDDP_CHECK(list.size() >= 1, "fastddp: comm hook '", hook_name,
                  "' completed with an empty list of tensors");
    return list.get(0);
  }
  if (result.isList()) {
    auto list = result.toListRef();
    FASTDDP_CHECK(!list.empty() && list[0].isTensor(), "fastddp: comm hook '", hook_name,
                  "' must complete its future with a tensor or a list of tensors");
    return list[0].toTensor();
  }
  FASTDDP_CHECK(false, "fastddp: comm hook '", hook_name,
                "' must complete its future with a tensor (the reduced bucket), got ",
                result.tagKind());
}

void copy_flat_to_grads(Bucket& bucket, const at::Tensor& flat, std::vector<at::Tensor>& dsts) {
  FASTDDP_CHECK(flat.dim() == 1 && flat.numel() == bucket.flat.numel(),
                "fastddp: a comm hook returned a tensor of shape ", flat.sizes(),
                " for a bucket of ", bucket.flat.numel(), " elements");
  const bool in_place = flat.data_ptr() == bucket.flat.data_ptr() &&
                        flat.scalar_type() == bucket.flat.scalar_type();
  // A hook's own result (not the bucket) is read through each slot's strides,
  // as the bucket was filled (torch's bucket_views_out): a channels_last
  // parameter's slice is laid out channels_last in any flat result.
  const at::Tensor result = in_place ? flat : flat.contiguous();
  // One multi-tensor copy for the slots whose layouts match: a single launch
  // on CUDA (ATen's _foreach_copy_, which replaced a copy kernel of ours that
  // fused nothing), with 16-byte accesses when the buffer is aligned (Note
  // [aligned flat buffer]). Mixed dtypes or layouts go through copy_.
  std::vector<at::Tensor> srcs, grads;
  for (size_t k = 0; k < dsts.size(); ++k) {
    at::Tensor& dst = dsts[k];
    const at::Tensor& view = bucket.views[k];
    if (!dst.defined() || (in_place && same_elements(dst, view))) continue;
    const at::Tensor src =
        in_place ? view
                 : result.as_strided(view.sizes(), view.strides(),
                                     result.storage_offset() + bucket.offsets[k]);
    cost::add(cost::kWriteBack, static_cast<int64_t>(src.nbytes() + dst.nbytes()));
    if (src.scalar_type() == dst.scalar_type() && src.strides() == dst.strides() &&
        dst.is_non_overlapping_and_dense()) {
      srcs.push_back(src);
      grads.push_back(dst);
    } else {
      dst.copy_(src);
    }
  }
  if (!grads.empty()) at::_foreach_copy_(grads, srcs);
}

}  // namespace fastddp
