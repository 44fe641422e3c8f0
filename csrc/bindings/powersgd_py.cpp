// Python face of the native PowerSGD hook: its checkpoint and statistics.
// Parameters are the reducer's indices here; fastddp.DistributedDataParallel
// turns them into names.
#include <torch/csrc/utils/pybind.h>

#include "../hooks/powersgd.h"

namespace py = pybind11;

namespace fastddp {

void bind_powersgd(py::module& m) {
  py::class_<PowerSGDHook, CommHook, std::shared_ptr<PowerSGDHook>>(m, "PowerSGDHook")
      .def_property_readonly("iter", &PowerSGDHook::iter)
      .def_property_readonly("start_powerSGD_iter",
                             [](const PowerSGDHook& h) { return h.options().start_powerSGD_iter; })
      .def_property_readonly("matrix_approximation_rank", [](const PowerSGDHook& h) {
        return h.options().matrix_approximation_rank;
      })
      .def_property_readonly("warm_start",
                             [](const PowerSGDHook& h) { return h.options().warm_start; })
      .def_property_readonly("use_error_feedback",
                             [](const PowerSGDHook& h) { return h.options().use_error_feedback; })
      .def("compression_stats", &PowerSGDHook::compression_stats,
           "torch's PowerSGDState.compression_stats(): [rate, numel before, numel after].")
      .def("last_step_bytes", &PowerSGDHook::last_step_bytes,
           "(gradient bytes, bytes on the wire) of the last compressed step.")
      .def("take_stats_reports",
           [](PowerSGDHook& h) {
             std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
             for (const auto& r : h.take_stats_reports()) {
               out.emplace_back(r.iter, r.numel_before, r.numel_after);
             }
             return out;
           })
      .def(
          "state_dict",
          [](const PowerSGDHook& h) {
            PowerSGDCheckpoint ck;
            {
              py::gil_scoped_release release;
              ck = h.state_dict();
            }
            py::dict d;
            d["iter"] = ck.iter;
            d["rng_state"] = ck.rng_state;
            d["numel_before"] = ck.numel_before;
            d["numel_after"] = ck.numel_after;
            d["next_stats_report"] = ck.next_stats_report;
            d["errors"] = ck.errors;
            d["qs"] = ck.qs;
            return d;
          },
          "iter, rng_state, statistics, and errors / qs by parameter index.")
      .def(
          "load_state_dict",
          [](PowerSGDHook& h, const py::dict& d) {
            PowerSGDCheckpoint ck;
            ck.iter = d["iter"].cast<int64_t>();
            ck.rng_state = d["rng_state"].cast<std::string>();
            ck.numel_before = d["numel_before"].cast<int64_t>();
            ck.numel_after = d["numel_after"].cast<int64_t>();
            ck.next_stats_report = d["next_stats_report"].cast<int64_t>();
            ck.errors = d["errors"].cast<std::map<int64_t, at::Tensor>>();
            ck.qs = d["qs"].cast<std::map<int64_t, at::Tensor>>();
            py::gil_scoped_release release;
            h.load_state_dict(ck);
          },
          py::arg("state"));
}

}  // namespace fastddp
