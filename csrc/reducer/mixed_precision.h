// The reducer's side of DDP's mixed_precision (Note [mixed precision] in
// reducer.h): the parameters' full-precision dtypes, the parameters cast for
// the last forward with their masters, the full-precision .grad the
// write-back fills, and the masters put back at the end of backward.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <optional>
#include <vector>

namespace fastddp {

class GradSlot;

class MixedPrecision {
 public:
  MixedPrecision() = default;
  // `params` as wrapped (their dtypes are the masters'); `on`: mixed_precision,
  // which casts them to `param_dtype` for each forward.
  MixedPrecision(const std::vector<at::Tensor>& params, bool on,
                 std::optional<c10::ScalarType> param_dtype);

  bool on() const { return on_; }
  // Parameter `index`'s dtype as wrapped.
  c10::ScalarType master_dtype(size_t index) const { return master_dtypes_[index]; }
  // Whether parameter `index` may have `dtype` now: its own, or param_dtype
  // between a forward and its synchronized backward.
  bool expected_dtype(size_t index, c10::ScalarType dtype) const;
  // The forward just cast `params`; `masters` hold their full-precision data.
  void set_cast(std::vector<at::Tensor> params, std::vector<at::Tensor> masters);
  // The write-back's .grad of `param` (parameter `index`) in the master's
  // dtype, keeping its values or not.
  void full_precision_grad(const GradSlot& slot, const at::Tensor& param, size_t index,
                           bool keep_values) const;
  // The end of the synchronized backward: the masters back into the parameters.
  void restore_masters();

 private:
  bool on_ = false;
  std::optional<c10::ScalarType> param_dtype_;
  std::vector<c10::ScalarType> master_dtypes_;  // the parameters' dtypes at construction
  std::vector<at::Tensor> cast_params_;  // cast for the last forward
  std::vector<at::Tensor> masters_;      // their full-precision data
};

}  // namespace fastddp
