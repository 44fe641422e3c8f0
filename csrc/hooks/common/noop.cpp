// The hook that communicates nothing, torch's debugging_hooks.noop_hook: each
// rank keeps its own gradients. For timing a step without DDP's averaging (the
// launcher's `--hook noop`), as torch documents its hook for, not for training.
#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "registry.h"

namespace fastddp {
namespace {

class NoopHook : public CommHook {
 public:
  std::string name() const override { return "noop"; }
  // The default copy_in: the gradients unscaled, as torch's reducer hands a hook its bucket.
  c10::intrusive_ptr<c10::ivalue::Future> run(Bucket& bucket, size_t index, bool) override {
    note_launch(index, "no collective: the bucket as it is");
    const at::Tensor& result = bucket.sparse ? bucket.sparse_grad : bucket.flat;
    // A future over the bucket's device, so that on a GPU its completion records an event
    // on the compute stream (torch's noop_hook returns a completed future likewise).
    std::vector<c10::Device> devices;
    if (!result.is_cpu()) devices.push_back(result.device());
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(), devices);
    future->markCompleted(c10::IValue(result));
    return future;
  }
  bool supports_sparse() const override { return true; }
  int64_t wire_bytes(const Bucket&) const override { return 0; }
};

}  // namespace

FASTDDP_REGISTER_COMM_HOOK("noop", [](const c10::intrusive_ptr<c10d::ProcessGroup>&,
                                      const HookOptions& options) -> std::shared_ptr<CommHook> {
  options.check_known({});
  return std::make_shared<NoopHook>();
});

}  // namespace fastddp
