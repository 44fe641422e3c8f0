// A Python comm hook (`hook(state, bucket) -> torch.futures.Future`) behind
// the CommHook interface: the only hook that takes the GIL, and only inside
// run() and write_back(). The bucket is handed to Python as a real
// torch.distributed.GradBucket (torch's own PythonCommHook does the call and
// the parsing of the result), so torch's hook functions run unchanged on it.
#pragma once

#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <vector>

#include "../reducer/comm_hook.h"

namespace fastddp {

class PythonCommHook : public CommHook {
 public:
  // `params` are the reducer's parameters, in its order (bucket.params index
  // them): GradBucket.parameters() returns them.
  PythonCommHook(py::object state, py::object hook, std::vector<at::Tensor> params,
                 std::string name);

  std::string name() const override { return name_; }
  void on_new_buckets(const std::vector<Bucket>& buckets) override;
  c10::intrusive_ptr<c10::ivalue::Future> run(Bucket& bucket, size_t index,
                                              bool is_last) override;
  void write_back(Bucket& bucket, const c10::IValue& result,
                  std::vector<at::Tensor>& dsts) override;
  bool supports_sparse() const override { return true; }
  at::Tensor result_tensor(const c10::IValue& result) override;

 private:
  std::unique_ptr<c10d::PythonCommHook> hook_;
  std::vector<at::Tensor> params_;
  std::string name_;
  size_t bucket_count_ = 0;
};

}  // namespace fastddp
