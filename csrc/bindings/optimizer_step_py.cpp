// The overlapped optimizer's Python side (Note [overlapped optimizer]): a
// Python callable behind the OptimizerStep interface, for the torch.optim
// optimizers that have no native step (their numbers are their Python code's).
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../reducer/message.h"
#include "../reducer/optimizer_step.h"

namespace py = pybind11;

namespace fastddp {
namespace {

class PythonOptimizerStep final : public OptimizerStep {
 public:
  // fn(indices): a bucket's parameter indices (a list of int), or None at
  // the end of backward.
  explicit PythonOptimizerStep(py::object fn) : fn_(std::move(fn)) {}
  ~PythonOptimizerStep() override {
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }

  void step_bucket(const std::vector<size_t>& params) override { call(&params); }
  void end_of_backward() override { call(nullptr); }

 private:
  void call(const std::vector<size_t>* params) {
    std::string error;
    {
      py::gil_scoped_acquire gil;
      try {
        fn_(params ? py::cast(*params) : py::none());
        return;
      } catch (py::error_already_set& e) {
        error = e.what();  // dropped under the GIL; raised below as a c10::Error
      }
    }
    FASTDDP_CHECK(false, "fastddp: the overlapped optimizer's step failed: ", error);
  }

  py::object fn_;
};

}  // namespace

void bind_optimizer_step(py::module& m) {
  py::class_<OptimizerStep, std::shared_ptr<OptimizerStep>>(m, "OptimizerStep");
  m.def(
      "python_optimizer_step",
      [](py::object fn) -> std::shared_ptr<OptimizerStep> {
        return std::make_shared<PythonOptimizerStep>(std::move(fn));
      },
      py::arg("fn"));
}

}  // namespace fastddp
