// A bucket: one flat gradient buffer shared by several parameters, reduced by
// a single collective.
#pragma once

#include <ATen/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <vector>

#include "../core/bucket_plan.h"

namespace fastddp {

struct Bucket {
  // Contiguous buffer of the parameters' dtype, on their device.
  at::Tensor flat;
  // Parameter indices (into the reducer's parameter list), in buffer order.
  std::vector<size_t> params;
  // views[k] aliases `flat` for params[k], with that parameter's shape and,
  // for dense parameters, its strides (so channels_last grads stay
  // channels_last, as torch's grad layout contract asks).
  std::vector<at::Tensor> views;
  std::vector<int64_t> offsets;  // in elements
  std::vector<int64_t> numels;

  // A bucket of one parameter whose gradient is sparse (nn.Embedding(sparse=True)),
  // as torch's reducer: `flat` is empty, views[0] only carries the parameter's
  // shape and options (a zero-stride expand), and the gradient itself travels
  // in `sparse_grad`. Only hooks whose supports_sparse() is true run on it.
  bool sparse = false;
  at::Tensor sparse_grad;

  // Per backward: gradients still missing, and the comm hook's reduction.
  size_t pending = 0;
  c10::intrusive_ptr<c10::ivalue::Future> future;

  int64_t bytes() const;
  // The same layout over a fresh zero-filled buffer (join() shadows the
  // collectives with it, leaving this bucket's gradients alone).
  Bucket zeros_like() const;
};

// What the planner needs to know of a tensor: its size, dtype and device.
TensorSpec spec_of(const at::Tensor& tensor, bool expect_sparse);

// Allocates the buckets of a plan over `params`. Every bucket must hold
// parameters of a single dtype and device.
// `sparse[i]`: parameter i gets sparse gradients (empty: none does).
std::vector<Bucket> make_buckets(const std::vector<at::Tensor>& params,
                                 const std::vector<std::vector<size_t>>& plan,
                                 const std::vector<bool>& sparse);

}  // namespace fastddp
