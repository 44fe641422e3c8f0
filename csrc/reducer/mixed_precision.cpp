// DDP's mixed_precision (Note [mixed precision]): the full-precision grads and
// masters, and the reducer's side of a forward that cast the parameters.
#include "mixed_precision.h"

#include <ATen/ATen.h>

#include "../util/message.h"
#include "grad_hooks.h"
#include "reducer.h"

namespace fastddp {

MixedPrecision::MixedPrecision(const std::vector<at::Tensor>& params, bool on,
                               std::optional<c10::ScalarType> param_dtype)
    : on_(on), param_dtype_(param_dtype) {
  for (const at::Tensor& p : params) master_dtypes_.push_back(p.scalar_type());
}

bool MixedPrecision::expected_dtype(size_t index, c10::ScalarType dtype) const {
  // Between a forward and its synchronized backward (or after a forward without
  // one, as in torch) a parameter is of param_dtype.
  return dtype == master_dtypes_[index] || (on_ && param_dtype_ == dtype);
}

void MixedPrecision::set_cast(std::vector<at::Tensor> params, std::vector<at::Tensor> masters) {
  cast_params_ = std::move(params);
  masters_ = std::move(masters);
}

void MixedPrecision::full_precision_grad(const GradSlot& slot, const at::Tensor& param,
                                         size_t index, bool keep_values) const {
  const c10::ScalarType dtype = master_dtypes_[index];
  slot.with_grad(param, [&](at::Tensor& grad) {
    if (!grad.defined() || grad.scalar_type() == dtype) return false;
    // set_data, as torch's `p.grad.data = p.grad.to(...)`: the same .grad object.
    grad.set_data(keep_values ? grad.to(dtype)
                              : at::empty_like(grad, grad.options().dtype(dtype),
                                               at::MemoryFormat::Preserve));
    return true;
  });
}

void MixedPrecision::restore_masters() {
  for (size_t k = 0; k < cast_params_.size(); ++k) {
    const c10::Storage low = cast_params_[k].storage();
    cast_params_[k].set_data(masters_[k]);
    // The param_dtype copy's memory is freed until the next forward allocates it
    // again (its tensor, param._mp_param, keeps its shape), as torch's hook frees it
    // (_free_storage).
    if (!low.is_alias_of(masters_[k].storage())) low.unsafeGetStorageImpl()->reset();
  }
  cast_params_.clear();
  masters_.clear();
}

void Reducer::after_param_cast(std::vector<at::Tensor> params, std::vector<at::Tensor> masters) {
  std::lock_guard<std::mutex> lock(mutex_);
  FASTDDP_CHECK(options_.mixed_precision,
                "fastddp: after_param_cast belongs to a reducer built for mixed_precision");
  FASTDDP_CHECK(params.size() == masters.size(), "fastddp: ", params.size(),
                " cast parameters but ", masters.size(), " masters");
  // A forward of the module while its backward is reducing (the masters of this
  // iteration would be replaced half-way).
  FASTDDP_CHECK(!reducing(),
                "fastddp: mixed_precision: the module ran a forward while DDP's backward was "
                "reducing its gradients");
  mixed_precision_.set_cast(std::move(params), std::move(masters));
  // A dtype change (set_data) drops the parameter's grad accumulator: the next
  // backward runs a new one, which must carry the hook.
  install_hooks();
}

}  // namespace fastddp
