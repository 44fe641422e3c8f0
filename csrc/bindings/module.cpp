// fastddp._C's module: its entry point and the Reducer's Python class. Only
// csrc/bindings/ knows about Python: this file and, beside it, the bindings of
// the hooks, the optimizer step and PowerSGD, the Python comm hook and the
// hook runner; the rest of csrc/ is plain C++.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <pybind11/functional.h>
#include <torch/csrc/utils/pybind.h>

#include "../core/bucket_plan.h"
#include "../hooks/common/allreduce.h"
#include "../hooks/common/upcast_allreduce.h"
#include "../reducer/comm_hook.h"
#include "../reducer/reducer.h"
#include "../util/message.h"
#include "../optim/optimizer_step.h"

namespace py = pybind11;

namespace fastddp {
void bind_hooks(py::module& m);             // hooks_py.cpp
void bind_powersgd(py::module& m);          // powersgd_py.cpp
void bind_powersgd_batched(py::module& m);  // powersgd_batched_py.cpp
void bind_hook_runner(py::module& m);       // hook_runner.cpp
void bind_optimizer_step(py::module& m);    // optimizer_step_py.cpp

namespace {

// The planner's view of `tensors`; tensor i is parameter order[i] when an order is given.
std::vector<TensorSpec> specs_of(const std::vector<at::Tensor>& tensors,
                                 const std::vector<bool>& expect_sparse_gradient,
                                 const std::vector<size_t>& order) {
  FASTDDP_CHECK(expect_sparse_gradient.empty() || expect_sparse_gradient.size() == tensors.size(),
                "fastddp: expect_sparse_gradient has ", expect_sparse_gradient.size(),
                " entries for ", tensors.size(), " tensors");
  std::vector<TensorSpec> specs;
  for (size_t i = 0; i < tensors.size(); ++i) {
    FASTDDP_CHECK(!tensors[i].is_sparse(), "fastddp: tensor ", i, " is sparse; no support for "
                  "sparse tensors");
    const size_t index = order.empty() ? i : order.at(i);
    specs.push_back(spec_of(
        tensors[i], !expect_sparse_gradient.empty() && expect_sparse_gradient.at(index)));
  }
  return specs;
}

// Same arguments and result as torch.distributed._compute_bucket_assignment_by_size.
py::tuple compute_bucket_assignment_by_size(const std::vector<at::Tensor>& tensors,
                                            const std::vector<size_t>& size_limits,
                                            const std::vector<bool>& expect_sparse_gradient,
                                            const std::vector<int64_t>& tensor_indices) {
  const std::vector<size_t> order(tensor_indices.begin(), tensor_indices.end());
  const std::vector<TensorSpec> specs = specs_of(tensors, expect_sparse_gradient, order);
  // The planner's std::invalid_argument reaches Python as ValueError (pybind11's own
  // translation), as torch's planner raises it.
  const BucketPlan plan = plan_buckets(specs, size_limits, order);
  return py::make_tuple(plan.buckets, plan.size_limits);
}

// The buckets a Reducer starts with, in the order it reduces them (plan_initial_buckets):
// what DDP's constructor passes to _C.Reducer, with no reordering in Python.
std::vector<std::vector<size_t>> initial_bucket_plan(
    const std::vector<at::Tensor>& tensors, const std::vector<size_t>& size_limits,
    const std::vector<bool>& expect_sparse_gradient) {
  const std::vector<TensorSpec> specs = specs_of(tensors, expect_sparse_gradient, {});
  return plan_initial_buckets(specs, size_limits).buckets;
}

using nogil = py::call_guard<py::gil_scoped_release>;

py::dict comm_stats_dict(const Reducer& reducer) {
  CommStats stats;
  std::string hook_name;
  {
    py::gil_scoped_release release;  // see the Reducer bindings
    stats = reducer.comm_stats();
    hook_name = reducer.hook_name();
  }
  py::list buckets;
  int64_t reduced = 0;
  int64_t sent = 0;
  for (size_t b = 0; b < stats.bucket_bytes.size(); ++b) {
    py::dict bucket;
    bucket["index"] = b;
    bucket["bytes"] = stats.bucket_bytes[b];
    bucket["wire_bytes"] = stats.wire_bytes[b];
    const BucketTiming t = b < stats.timings.size() ? stats.timings[b] : BucketTiming{};
    bucket["ready_ms"] = t.ready_us / 1e3;
    bucket["launched_ms"] = t.launched_us / 1e3;
    bucket["done_ms"] = t.done_us / 1e3;
    bucket["skipped"] = b < stats.skipped.size() && stats.skipped[b];
    buckets.append(bucket);
    reduced += stats.bucket_bytes[b];
    sent += stats.wire_bytes[b];
  }
  py::dict out;
  out["steps"] = stats.steps;
  out["clock"] = stats.device_clock ? "device" : "host";
  out["timed_iteration"] = stats.timed_iteration;
  out["backward_start_ns"] = stats.backward_start_ns;
  out["hook"] = hook_name;
  out["bytes_reduced"] = reduced;
  out["bytes_sent"] = sent;
  out["compression_ratio"] = sent > 0 ? static_cast<double>(reduced) / static_cast<double>(sent) : 1.0;
  out["exposed_comm_ms"] = stats.exposed_us / 1e3;
  out["mean_exposed_comm_ms"] =
      stats.timed_steps > 0 ? stats.total_exposed_us / 1e3 / static_cast<double>(stats.timed_steps)
                            : 0.0;
  out["collectives"] =
      stats.collectives >= 0 ? py::object(py::int_(stats.collectives)) : py::object(py::none());
  out["buckets"] = buckets;
  py::dict cost;  // Note [counted cost]
  for (int k = 0; k < cost::kKinds; ++k) cost[cost::name(static_cast<cost::Kind>(k))] = stats.cost[k];
  out["step_cost"] = cost;
  return out;
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
  // The compiler and the libstdc++ headers _C was compiled with (`python -m fastddp
  // --check` sets them beside the libstdc++ loaded at run time).
  info["compiler"] = __VERSION__;
#if defined(_GLIBCXX_RELEASE)
  info["libstdcxx_headers"] = cat("GCC ", _GLIBCXX_RELEASE, " (", __GLIBCXX__, ")");
#else
  info["libstdcxx_headers"] = py::none();
#endif
  return info;
}

}  // namespace
}  // namespace fastddp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using fastddp::nogil;
  using fastddp::Reducer;
  using fastddp::ReducerOptions;
  m.doc() = "fastddp native core: bucket planning and the gradient reducer";
  m.def("build_info", &fastddp::build_info);
  m.def("compute_bucket_assignment_by_size", &fastddp::compute_bucket_assignment_by_size,
        py::arg("tensors"), py::arg("size_limits"),
        py::arg("expect_sparse_gradient") = std::vector<bool>{},
        py::arg("tensor_indices") = std::vector<int64_t>{});
  m.def("initial_bucket_plan", &fastddp::initial_bucket_plan, py::arg("tensors"),
        py::arg("size_limits"), py::arg("expect_sparse_gradient") = std::vector<bool>{},
        "The Reducer's first buckets (parameter indices), in the order it reduces them.");
  // DDP's default bucket sizes, defined once in core/bucket_plan.h.
  m.attr("DEFAULT_BUCKET_CAP_BYTES") = fastddp::kDefaultBucketCapBytes;
  m.attr("DEFAULT_FIRST_BUCKET_BYTES") = fastddp::kDefaultFirstBucketBytes;

  py::class_<fastddp::CommHook, std::shared_ptr<fastddp::CommHook>>(m, "CommHook")
      .def_property_readonly("name", &fastddp::CommHook::name);
  py::class_<fastddp::AllreduceHook, fastddp::CommHook, std::shared_ptr<fastddp::AllreduceHook>>(
      m, "AllreduceHook")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>>(), py::arg("process_group"));
  py::class_<fastddp::UpcastAllreduceHook, fastddp::CommHook,
             std::shared_ptr<fastddp::UpcastAllreduceHook>>(m, "UpcastAllreduceHook")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>>(), py::arg("process_group"));
  fastddp::bind_hooks(m);  // the registry, the other hooks, the half-cast kernels
  fastddp::bind_powersgd(m);
  fastddp::bind_powersgd_batched(m);
  fastddp::bind_hook_runner(m);  // hooks on given gradients, for benchmarks and tests
  fastddp::bind_optimizer_step(m);

  using Tensors = std::vector<at::Tensor>;
  py::class_<Reducer, std::shared_ptr<Reducer>>(m, "Reducer")
      .def(py::init([](Tensors params, std::vector<std::string> names,
                       std::vector<std::vector<size_t>> plan,
                       c10::intrusive_ptr<c10d::ProcessGroup> group,
                       std::shared_ptr<fastddp::CommHook> hook, bool gradient_as_bucket_view,
                       bool find_unused_parameters, bool static_graph,
                       std::vector<size_t> rebuild_limits, std::vector<bool> expect_sparse,
                       bool check_for_nan_in_grad, int64_t align_bytes, bool mixed_precision,
                       std::optional<at::ScalarType> param_dtype,
                       std::optional<at::ScalarType> reduce_dtype,
                       bool lazy_bucket_allocation, bool skip_all_reduce_unused_params) {
             ReducerOptions options;
             options.gradient_as_bucket_view = gradient_as_bucket_view;
             options.find_unused_parameters = find_unused_parameters;
             options.static_graph = static_graph;
             options.rebuild_limits = std::move(rebuild_limits);
             options.expect_sparse = std::move(expect_sparse);
             options.check_for_nan_in_grad = check_for_nan_in_grad;
             options.align_bytes = align_bytes;
             options.mixed_precision = mixed_precision;
             options.param_dtype = param_dtype;
             options.reduce_dtype = reduce_dtype;
             options.lazy_bucket_allocation = lazy_bucket_allocation;
             options.skip_all_reduce_unused_params = skip_all_reduce_unused_params;
             if (!hook) hook = std::make_shared<fastddp::AllreduceHook>(group);
             return std::make_shared<Reducer>(std::move(params), std::move(names), std::move(plan),
                                              std::move(group), std::move(hook), options);
           }),
           py::arg("params"), py::arg("names"), py::arg("plan"), py::arg("process_group"),
           py::arg("hook") = nullptr, py::arg("gradient_as_bucket_view") = false,
           py::arg("find_unused_parameters") = false, py::arg("static_graph") = false,
           py::arg("rebuild_limits") =
               std::vector<size_t>{fastddp::kDefaultFirstBucketBytes,
                                   fastddp::kDefaultBucketCapBytes},
           py::arg("expect_sparse") = std::vector<bool>{},
           py::arg("check_for_nan_in_grad") = false, py::arg("align_bytes") = 0,
           py::arg("mixed_precision") = false, py::arg("param_dtype") = py::none(),
           py::arg("reduce_dtype") = py::none(), py::arg("lazy_bucket_allocation") = false,
           py::arg("skip_all_reduce_unused_params") = false)
      // Every method that takes the reducer's lock releases the GIL first: the
      // autograd thread holds that lock while a Python comm hook wants the GIL.
      .def("before_forward", &Reducer::before_forward, py::arg("sync"), nogil())
      .def("after_forward", &Reducer::after_forward, py::arg("sync"), py::arg("outputs"),
           nogil())
      .def("prepare_for_backward", &Reducer::prepare_for_backward, py::arg("outputs"), nogil())
      .def("delay_all_reduce", &Reducer::delay_all_reduce, nogil())
      .def_property_readonly("needs_outputs",
                             [](const Reducer& r) {
                               py::gil_scoped_release release;
                               return r.needs_outputs();
                             })
      .def("set_comm_hook", &Reducer::set_comm_hook, py::arg("hook"), nogil())
      .def("set_optimizer_step", &Reducer::set_optimizer_step, py::arg("step"), nogil())
      .def("after_param_cast", &Reducer::after_param_cast, py::arg("params"),
           py::arg("masters"), nogil())
      .def("set_sink_clone", &Reducer::set_sink_clone, py::arg("clone"), nogil())
      .def("set_static_graph", &Reducer::set_static_graph, nogil())
      .def("set_divide_factor", &Reducer::set_divide_factor, py::arg("factor"), nogil())
      // Note [fault-tolerant step]: fastddp.integrations.torchft. The sink (a Python
      // callable taking the failure's text) is called, with the GIL, only on a failure.
      .def("set_fault_sink", &Reducer::set_fault_sink, py::arg("sink"))
      .def("set_participants", &Reducer::set_participants, py::arg("count"),
           py::arg("contributes"), nogil())
      .def("settle_pending", &Reducer::settle_pending, py::arg("commit"), nogil())
      .def("freeze_buckets", &Reducer::freeze_buckets, nogil())
      .def("shadow_backward", &Reducer::shadow_backward, nogil())
      .def("record_default_ready_order", &Reducer::record_default_ready_order, nogil())
      .def("shard_buckets", &Reducer::shard_buckets, py::arg("shards"),
           py::arg("release") = false, nogil())
      .def("bucket_layout", &Reducer::bucket_layout, nogil())
      .def("bucket_plan", &Reducer::bucket_plan, nogil())
      .def("bucket_bytes", &Reducer::bucket_bytes, nogil())
      .def("held_bucket_bytes", &Reducer::held_bucket_bytes, nogil())
      .def("last_ready_order", &Reducer::last_ready_order, nogil())
      .def("last_unused_parameters", &Reducer::last_unused_parameters, nogil())
      .def("comm_stats", &fastddp::comm_stats_dict)
      .def("last_error", &Reducer::last_error, nogil())
      .def("set_track_finite", &Reducer::set_track_finite, py::arg("on"), nogil())
      .def("set_timing_sample_rate", &Reducer::set_timing_sample_rate, py::arg("rate"), nogil())
      .def("set_time_every_step", &Reducer::set_time_every_step, py::arg("on"), nogil())
      .def("last_step_finite", &Reducer::last_step_finite, nogil())
      .def_property_readonly("hook_name",
                             [](const Reducer& r) {
                               py::gil_scoped_release release;
                               return r.hook_name();
                             })
      .def_property_readonly("static_graph", &Reducer::static_graph)
      .def_property_readonly("has_rebuilt_buckets", &Reducer::has_rebuilt_buckets)
      .def_property_readonly("num_iterations", &Reducer::num_iterations)
      .def_property_readonly("num_backward_syncs", &Reducer::num_backward_syncs)
      .def_property_readonly("num_buckets_reduced", [](const Reducer& r) {
        py::gil_scoped_release release;  // takes the reducer's lock
        return r.num_buckets_reduced();
      });
}
