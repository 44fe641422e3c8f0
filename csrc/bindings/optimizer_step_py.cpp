// The overlapped optimizer's bindings (Note [overlapped optimizer]): a Python
// callable behind the OptimizerStep interface, for the torch.optim optimizers
// that have no native step (their numbers are their Python code's), and the
// native fused step (optim/fused_step.h).
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../optim/fused_step.h"
#include "../util/message.h"
#include "../optim/optimizer_step.h"

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

// A Python object that takes the GIL to drop its reference: the reducer may
// release a FusedStep (and the callback in it) on a thread without the GIL.
std::shared_ptr<py::object> held(py::object obj) {
  return std::shared_ptr<py::object>(new py::object(std::move(obj)), [](py::object* o) {
    py::gil_scoped_acquire gil;
    delete o;
  });
}

FusedStep::InitState init_state_from(py::object fn) {
  return [fn = held(std::move(fn))](std::vector<size_t> indices) {
    std::string error;
    {
      py::gil_scoped_acquire gil;
      try {
        return (*fn)(indices)
            .cast<std::pair<std::vector<std::vector<at::Tensor>>, std::vector<bool>>>();
      } catch (py::error_already_set& e) {
        error = e.what();
      } catch (const py::cast_error& e) {
        error = e.what();
      }
    }
    FASTDDP_CHECK(false, "fastddp: the overlapped optimizer's state callback failed: ", error);
  };
}

FusedGroup fused_group(const py::dict& d) {
  FusedGroup g;
  g.lr = d["lr"].cast<double>();
  g.weight_decay = d["weight_decay"].cast<double>();
  g.maximize = d["maximize"].cast<bool>();
  g.momentum = d["momentum"].cast<double>();
  g.dampening = d["dampening"].cast<double>();
  g.nesterov = d["nesterov"].cast<bool>();
  g.beta1 = d["beta1"].cast<double>();
  g.beta2 = d["beta2"].cast<double>();
  g.eps = d["eps"].cast<double>();
  g.amsgrad = d["amsgrad"].cast<bool>();
  g.decoupled_weight_decay = d["decoupled_weight_decay"].cast<bool>();
  return g;
}

}  // namespace

void bind_optimizer_step(py::module& m) {
  py::class_<OptimizerStep, std::shared_ptr<OptimizerStep>>(m, "OptimizerStep");
  m.def(
      "python_optimizer_step",
      [](py::object fn) -> std::shared_ptr<OptimizerStep> {
        return std::make_shared<PythonOptimizerStep>(std::move(fn));
      },
      py::arg("fn"));
  py::class_<FusedStep, OptimizerStep, std::shared_ptr<FusedStep>>(m, "FusedStep")
      .def(py::init([](const std::string& kind, std::vector<at::Tensor> params,
                       std::vector<int64_t> group_of, py::object init_state) {
             FASTDDP_CHECK(kind == "sgd" || kind == "adam", "fastddp: FusedStep kind '", kind,
                           "' is neither 'sgd' nor 'adam'");
             return std::make_shared<FusedStep>(
                 kind == "sgd" ? FusedStep::Kind::kSgd : FusedStep::Kind::kAdam,
                 std::move(params), std::move(group_of), init_state_from(std::move(init_state)));
           }),
           py::arg("kind"), py::arg("params"), py::arg("group_of"), py::arg("init_state"))
      // Each group a dict with every FusedGroup field (fastddp/ddp/_overlap_optimizer.py).
      .def("set_groups",
           [](FusedStep& step, const std::vector<py::dict>& groups) {
             std::vector<FusedGroup> native;
             for (const py::dict& g : groups) native.push_back(fused_group(g));
             step.set_groups(std::move(native));
           });
}

}  // namespace fastddp
