// Python face of the native batched PowerSGD hook (Note [batched powersgd]):
// the same statistics and checkpoint as PowerSGDHook's, whose dict also has
// bucket_qs and bucket_error_tails, keyed by a bucket's first parameter index.
#include "powersgd_py_common.h"

#include "../hooks/powersgd/powersgd_batched.h"

namespace fastddp {

void bind_powersgd_batched(py::module& m) {
  py::class_<BatchedPowerSGDHook, CommHook, std::shared_ptr<BatchedPowerSGDHook>> batched(
      m, "BatchedPowerSGDHook");
  def_powersgd_common(batched);
  m.def("batched_powersgd_side", &batched_powersgd_side, py::arg("numel"),
        "ceil(sqrt(numel)): the side of the square matrix a bucket of numel elements becomes.");
}

}  // namespace fastddp
