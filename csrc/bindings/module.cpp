// fastddp._C: the only file that knows about Python.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <stdexcept>

#include "../core/bucket_plan.h"
#include "../kernels/multi_tensor_copy.h"
#include "../reducer/comm_hook.h"
#include "../reducer/reducer.h"

#if defined(FASTDDP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;

namespace fastddp {
void bind_hooks(py::module& m);  // hooks_py.cpp

namespace {

// Same arguments and result as torch.distributed._compute_bucket_assignment_by_size.
py::tuple compute_bucket_assignment_by_size(const std::vector<at::Tensor>& tensors,
                                            const std::vector<size_t>& size_limits,
                                            const std::vector<bool>& expect_sparse_gradient,
                                            const std::vector<int64_t>& tensor_indices) {
  TORCH_CHECK(expect_sparse_gradient.empty() || expect_sparse_gradient.size() == tensors.size(),
              "fastddp: expect_sparse_gradient has ", expect_sparse_gradient.size(),
              " entries for ", tensors.size(), " tensors");
  std::vector<size_t> order(tensor_indices.begin(), tensor_indices.end());
  std::vector<TensorSpec> specs;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(!tensors[i].is_sparse(), "fastddp: tensor ", i, " is sparse; no support for "
                "sparse tensors");
    const size_t index = order.empty() ? i : order.at(i);
    specs.push_back(spec_of(
        tensors[i], !expect_sparse_gradient.empty() && expect_sparse_gradient.at(index)));
  }
  BucketPlan plan;
  try {
    plan = plan_buckets(specs, size_limits, order);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
  return py::make_tuple(plan.buckets, plan.size_limits);
}

// A test and benchmark entry point for the write-back kernel.
void multi_tensor_copy(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts) {
#if defined(FASTDDP_WITH_CUDA)
  TORCH_CHECK(srcs.size() == dsts.size(), "fastddp: ", srcs.size(), " sources for ", dsts.size(),
              " destinations");
  std::vector<kernels::CopyRange> ranges;
  for (size_t i = 0; i < srcs.size(); ++i) {
    const at::Tensor& s = srcs[i];
    const at::Tensor& d = dsts[i];
    TORCH_CHECK(s.is_cuda() && d.is_cuda() && s.device() == d.device() &&
                    s.device() == srcs.front().device(),
                "fastddp: multi_tensor_copy pair ", i, " is not on one CUDA device");
    TORCH_CHECK(s.is_contiguous() && d.is_contiguous() && s.scalar_type() == d.scalar_type() &&
                    s.numel() == d.numel(),
                "fastddp: multi_tensor_copy pair ", i,
                " must be contiguous tensors of one dtype and size");
    ranges.push_back({s.data_ptr(), d.data_ptr(), s.numel() * static_cast<int64_t>(s.element_size())});
  }
  if (ranges.empty()) return;
  const c10::cuda::CUDAGuard guard(srcs.front().device());
  kernels::multi_tensor_copy_cuda(ranges.data(), static_cast<int64_t>(ranges.size()),
                                  c10::cuda::getCurrentCUDAStream().stream());
#else
  (void)srcs;
  (void)dsts;
  TORCH_CHECK_NOT_IMPLEMENTED(false, "fastddp was built without CUDA: multi_tensor_copy needs it");
#endif
}

py::dict build_info() {
  py::dict info;
#if defined(FASTDDP_WITH_CUDA)
  info["cuda"] = true;
  info["cuda_version"] = FASTDDP_CUDA_VERSION;
#else
  info["cuda"] = false;
  info["cuda_version"] = py::none();
#endif
#if defined(FASTDDP_WITH_NVTX)
  info["nvtx"] = true;
#else
  info["nvtx"] = false;
#endif
  info["built_with_torch"] = FASTDDP_TORCH_VERSION;
  return info;
}

}  // namespace
}  // namespace fastddp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using fastddp::Reducer;
  using fastddp::ReducerOptions;
  m.doc() = "fastddp native core: bucket planning and the gradient reducer";
  m.def("build_info", &fastddp::build_info);
  m.def("compute_bucket_assignment_by_size", &fastddp::compute_bucket_assignment_by_size,
        py::arg("tensors"), py::arg("size_limits"),
        py::arg("expect_sparse_gradient") = std::vector<bool>{},
        py::arg("tensor_indices") = std::vector<int64_t>{});
  m.def("multi_tensor_copy", &fastddp::multi_tensor_copy, py::arg("srcs"), py::arg("dsts"));

  // TEMPORARY until the reducer's CommHook binding lands from main.
  py::class_<fastddp::CommHook, std::shared_ptr<fastddp::CommHook>>(m, "CommHook");
  fastddp::bind_hooks(m);

  py::class_<Reducer>(m, "Reducer")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       std::vector<std::vector<size_t>> plan,
                       c10::intrusive_ptr<c10d::ProcessGroup> group, bool gradient_as_bucket_view,
                       std::vector<size_t> rebuild_limits) {
             ReducerOptions options;
             options.gradient_as_bucket_view = gradient_as_bucket_view;
             options.rebuild_limits = std::move(rebuild_limits);
             return std::make_unique<Reducer>(std::move(params), std::move(names), std::move(plan),
                                              std::move(group), options);
           }),
           py::arg("params"), py::arg("names"), py::arg("plan"), py::arg("process_group"),
           py::arg("gradient_as_bucket_view"), py::arg("rebuild_limits"))
      .def("before_forward", &Reducer::before_forward, py::call_guard<py::gil_scoped_release>())
      .def("after_forward", &Reducer::after_forward, py::arg("sync"))
      .def("bucket_plan", &Reducer::bucket_plan)
      .def("bucket_bytes", &Reducer::bucket_bytes)
      .def_property_readonly("has_rebuilt_buckets", &Reducer::has_rebuilt_buckets)
      .def_property_readonly("num_backward_syncs", &Reducer::num_backward_syncs);
}
