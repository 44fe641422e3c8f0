// The Python face both PowerSGD hooks share ("powersgd", "powersgd_batched"):
// options, statistics and the checkpoint as a dict. Parameters are the
// reducer's indices here; fastddp.DistributedDataParallel turns them into names.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "../hooks/powersgd/acpsgd.h"
#include "../hooks/powersgd/powersgd.h"

namespace fastddp {

namespace py = pybind11;

// iter, rng_state, statistics, errors and qs by parameter index; bucket_qs
// and bucket_error_tails (by a bucket's first parameter) when there are any;
// ps, state for ACP-SGD only (read, and ignored on load, for PowerSGD).
py::dict powersgd_checkpoint_to_dict(const PowerSGDCheckpoint& ck);
PowerSGDCheckpoint powersgd_checkpoint_from_dict(const py::dict& d);

template <typename Hook>
void def_powersgd_common(py::class_<Hook, CommHook, std::shared_ptr<Hook>>& cls) {
  cls.def_property_readonly("iter", &Hook::iter)
      .def_property_readonly("start_powerSGD_iter",
                             [](const Hook& h) { return h.options().start_powerSGD_iter; })
      .def_property_readonly("matrix_approximation_rank",
                             [](const Hook& h) { return h.options().matrix_approximation_rank; })
      .def_property_readonly("warm_start", [](const Hook& h) { return h.options().warm_start; })
      .def_property_readonly("use_error_feedback",
                             [](const Hook& h) { return h.options().use_error_feedback; })
      .def("compression_stats", &Hook::compression_stats,
           "torch's PowerSGDState.compression_stats(): [rate, numel before, numel after].")
      .def("last_step_bytes", &Hook::last_step_bytes,
           "(gradient bytes, bytes on the wire) of the last compressed step.")
      .def("take_stats_reports",
           [](Hook& h) {
             std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
             for (const auto& r : h.take_stats_reports()) {
               out.emplace_back(r.iter, r.numel_before, r.numel_after);
             }
             return out;
           })
      .def(
          "state_dict",
          [](const Hook& h) {
            PowerSGDCheckpoint ck;
            {
              py::gil_scoped_release release;
              ck = h.state_dict();
            }
            return powersgd_checkpoint_to_dict(ck);
          },
          "iter, rng_state, statistics, and errors / qs by parameter index.")
      .def(
          "load_state_dict",
          [](Hook& h, const py::dict& d) {
            PowerSGDCheckpoint ck = powersgd_checkpoint_from_dict(d);
            py::gil_scoped_release release;
            h.load_state_dict(ck);
          },
          py::arg("state"));
}

}  // namespace fastddp
