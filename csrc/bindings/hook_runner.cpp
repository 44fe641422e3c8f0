// A comm hook run on given gradients, without a model or a reducer: for
// benchmarks and tests that time or compare hooks (fastddp's native ones and
// torch's Python ones behind PythonCommHook) on the very same buckets.
//
// It plays the reducer's part of Note [comm hook contract]: the buckets the
// reducer rebuilds to when gradients become ready in reverse order (as backward
// makes them), planned by the reducer's own planner, copy_in per slot,
// run() per bucket in order, then wait and write_back. The layout is fixed
// for the runner's life, so hooks keep their per-bucket state (PowerSGD's
// error feedback and warm start) from one run() to the next.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <vector>

#include "../core/bucket_plan.h"
#include "../reducer/bucket.h"
#include "../reducer/comm_hook.h"
#include "../util/message.h"

namespace py = pybind11;

namespace fastddp {
namespace {

class HookRunner {
 public:
  HookRunner(std::shared_ptr<CommHook> hook, const std::vector<at::Tensor>& grads,
             int64_t bucket_cap_bytes, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
             int64_t align_bytes = 0)
      : hook_(std::move(hook)), world_size_(group->getSize()) {
    FASTDDP_CHECK(hook_, "fastddp HookRunner: hook is None");
    FASTDDP_CHECK(!grads.empty(), "fastddp HookRunner: no gradients");
    FASTDDP_CHECK(bucket_cap_bytes > 0, "fastddp HookRunner: bucket_cap_bytes must be > 0, got ",
                  bucket_cap_bytes);
    // The reducer's rebuilt buckets, by the reducer's own planner, for gradients that
    // become ready last first.
    std::vector<TensorSpec> specs;
    std::vector<size_t> ready_order;
    for (size_t i = 0; i < grads.size(); ++i) {
      specs.push_back(spec_of(grads[i], false));
      ready_order.push_back(grads.size() - 1 - i);
    }
    plan_ = plan_buckets_from_ready_order(specs, ready_order,
                                          {static_cast<size_t>(bucket_cap_bytes)}).buckets;
    for (const at::Tensor& g : grads) shapes_.push_back(g.sizes().vec());
    buckets_ = make_buckets(grads, plan_, {}, align_bytes);
    hook_->on_new_buckets(buckets_);
  }

  // One step: the averaged gradients, in fresh tensors shaped as `grads`.
  // serialize: wait for each bucket's future before running the next
  // bucket's hook (torch's powerSGD_hook issues collectives from completion
  // callbacks, which gloo pairs up wrongly across ranks otherwise).
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& grads, bool serialize) {
    FASTDDP_CHECK(grads.size() == shapes_.size(), "fastddp HookRunner: ", grads.size(),
                  " gradients for a runner built over ", shapes_.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      FASTDDP_CHECK(grads[i].sizes().vec() == shapes_[i], "fastddp HookRunner: gradient ", i,
                    " has shape ", grads[i].sizes(), ", the runner was built for ",
                    c10::IntArrayRef(shapes_[i]));
    }
    hook_->set_divisors({world_size_, world_size_});
    for (size_t b = 0; b < buckets_.size(); ++b) {
      Bucket& bucket = buckets_[b];
      for (size_t k = 0; k < bucket.params.size(); ++k) {
        hook_->copy_in(bucket, k, grads[bucket.params[k]]);
      }
      bucket.future = hook_->run(bucket, b, b + 1 == buckets_.size());
      if (serialize) wait(b);
    }
    std::vector<at::Tensor> out(grads.size());
    for (size_t b = 0; b < buckets_.size(); ++b) {
      Bucket& bucket = buckets_[b];
      wait(b);
      std::vector<at::Tensor> dsts;
      for (size_t index : bucket.params) {
        out[index] = at::empty_like(grads[index]);
        dsts.push_back(out[index]);
      }
      hook_->write_back(bucket, bucket.future->value(), dsts);
      bucket.future.reset();
    }
    // The step stands (nothing is checked here): a double-buffered hook takes
    // its new state, as the reducer's end of backward has it do (Note
    // [double-buffered step state]).
    if (hook_->settles_own_state()) hook_->settle_step(at::Tensor());
    return out;
  }

  const std::vector<std::vector<size_t>>& bucket_plan() const { return plan_; }

 private:
  void wait(size_t b) {
    const auto& future = buckets_[b].future;
    FASTDDP_CHECK(future, "fastddp HookRunner: hook '", hook_->name(), "' returned no future");
    future->wait();
    FASTDDP_CHECK(!future->hasError(), "fastddp HookRunner: bucket ", b, " (hook '", hook_->name(),
                  "') failed: ", future->tryRetrieveErrorMessage());
  }

  std::shared_ptr<CommHook> hook_;
  int64_t world_size_;
  std::vector<std::vector<size_t>> plan_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<Bucket> buckets_;
};

}  // namespace

void bind_hook_runner(py::module& m) {
  using Tensors = std::vector<at::Tensor>;
  py::class_<HookRunner, std::shared_ptr<HookRunner>>(m, "HookRunner",
                                                      "A comm hook run on given gradients: "
                                                      "buckets as the reducer's, no model.")
      .def(py::init<std::shared_ptr<CommHook>, Tensors, int64_t,
                    c10::intrusive_ptr<c10d::ProcessGroup>, int64_t>(),
           py::arg("hook"), py::arg("grads"), py::arg("bucket_cap_bytes"),
           py::arg("process_group"), py::arg("align_bytes") = 0)
      // Released: the hook's futures complete on the process group's threads,
      // and Python callbacks (torch's hooks) need the GIL there.
      .def("run", &HookRunner::run, py::arg("grads"), py::arg("serialize") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("bucket_plan", &HookRunner::bucket_plan);
  m.def(
      "run_comm_hook",
      [](std::shared_ptr<CommHook> hook, const Tensors& grads, int64_t bucket_cap_bytes,
         const c10::intrusive_ptr<c10d::ProcessGroup>& group, bool serialize) {
        HookRunner runner(std::move(hook), grads, bucket_cap_bytes, group);
        py::gil_scoped_release release;
        return runner.run(grads, serialize);
      },
      py::arg("hook"), py::arg("grads"), py::arg("bucket_cap_bytes"), py::arg("process_group"),
      py::arg("serialize") = false,
      "One step of `hook` on `grads` (averaged grads back). Announces a new bucket layout, so "
      "stateful hooks (PowerSGD) start afresh: use HookRunner for several steps.");
}

}  // namespace fastddp
