#include "python_hook.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <algorithm>
#include "../util/message.h"

namespace fastddp {

PythonCommHook::PythonCommHook(py::object state, py::object hook, std::vector<at::Tensor> params,
                               std::string name)
    : hook_(std::make_unique<c10d::PythonCommHook>(std::move(state), std::move(hook))),
      params_(std::move(params)),
      name_(std::move(name)) {}

void PythonCommHook::on_new_buckets(const std::vector<Bucket>& buckets) {
  bucket_count_ = buckets.size();
}

c10::intrusive_ptr<c10::ivalue::Future> PythonCommHook::run(Bucket& bucket, size_t index,
                                                            bool is_last) {
  // GradBucket.is_last() is index == count - 1; keep it right even if the
  // layout was never announced.
  bucket_count_ = is_last ? index + 1 : std::max(bucket_count_, index + 2);
  std::vector<size_t> offsets, lengths;
  std::vector<c10::IntArrayRef> sizes;
  std::vector<at::Tensor> params;
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    offsets.push_back(static_cast<size_t>(bucket.offsets[k]));
    lengths.push_back(static_cast<size_t>(bucket.numels[k]));
    const at::Tensor& p = params_.at(bucket.params[k]);
    sizes.push_back(p.sizes());  // alive as long as params_
    params.push_back(p);
  }
  // A sparse bucket hands its gradient itself, as torch's GradBucket does.
  std::optional<at::Tensor> sparse_indices;
  if (bucket.sparse) sparse_indices = bucket.sparse_grad._indices();
  c10d::GradBucket grad_bucket(index, bucket_count_,
                               bucket.sparse ? bucket.sparse_grad : bucket.flat,
                               std::move(offsets), std::move(lengths), std::move(sizes),
                               std::move(params), std::move(sparse_indices));
  // Takes the GIL, calls hook(state, bucket), unwraps the torch.futures.Future
  // (the reducer names the bucket and hook if that fails).
  return hook_->runHook(grad_bucket);
}

at::Tensor PythonCommHook::result_tensor(const c10::IValue& result) {
  // A future chained in Python holds a Python object (converted under the
  // GIL by torch); a collective's own future holds tensors.
  if (!result.isPyObject()) return hook_result_tensor(result, name_);
  py::gil_scoped_acquire gil;
  PyObject* obj = result.toPyObject();
  if (THPVariable_Check(obj)) return THPVariable_Unpack(obj);
  // torch answers "Unable to cast 3.0 to Tensor" or takes None for an empty
  // tensor; name the hook and what it gave instead.
  const std::string type = obj == Py_None ? "None" : Py_TYPE(obj)->tp_name;
  FASTDDP_CHECK(false, "fastddp: comm hook '", name_, "' completed its future with ", type,
                "; it must hold the bucket's reduced tensor (a torch.Tensor of the bucket's size, "
                "as bucket.buffer())");
}

void PythonCommHook::write_back(Bucket& bucket, const c10::IValue& result,
                                std::vector<at::Tensor>& dsts) {
  at::Tensor flat = result_tensor(result);
  FASTDDP_CHECK(flat.numel() == bucket.flat.numel(), "fastddp: comm hook ", name_,
                " returned a tensor of ", flat.numel(), " elements for a bucket of ",
                bucket.flat.numel(), "; the future must hold the bucket's reduced flat buffer");
  // An integer result would be cast into the gradients, truncated.
  FASTDDP_CHECK(at::isFloatingType(flat.scalar_type()) || at::isComplexType(flat.scalar_type()),
                "fastddp: comm hook '", name_, "' returned a tensor of ", flat.scalar_type(),
                " for a bucket of ", bucket.flat.scalar_type(), "; it must be floating point");
  if (flat.dim() != 1) flat = flat.reshape({-1});  // torch takes [1, N] too
  if (flat.scalar_type() != bucket.flat.scalar_type() || flat.device() != bucket.flat.device()) {
    flat = flat.to(bucket.flat.options());  // e.g. torch's compress wrappers return 16-bit
  }
  copy_flat_to_grads(bucket, flat, dsts);
}

}  // namespace fastddp
