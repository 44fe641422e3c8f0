// Python face of the native PowerSGD hooks: their checkpoint and statistics
// (powersgd_py_common.h).
#include "powersgd_py_common.h"

namespace fastddp {

py::dict powersgd_checkpoint_to_dict(const PowerSGDCheckpoint& ck) {
  py::dict d;
  d["iter"] = ck.iter;
  d["rng_state"] = ck.rng_state;
  d["numel_before"] = ck.numel_before;
  d["numel_after"] = ck.numel_after;
  d["next_stats_report"] = ck.next_stats_report;
  d["errors"] = ck.errors;
  d["qs"] = ck.qs;
  // Only the batched hook has per-bucket state: the per-layer hook's dict stays as it was.
  if (!ck.bucket_qs.empty()) d["bucket_qs"] = ck.bucket_qs;
  if (!ck.bucket_error_tails.empty()) d["bucket_error_tails"] = ck.bucket_error_tails;
  // Read only (P is not state): PowerSGDState's p_memory_dict. from_dict ignores them.
  if (!ck.ps.empty()) d["ps"] = ck.ps;
  if (!ck.bucket_ps.empty()) d["bucket_ps"] = ck.bucket_ps;
  return d;
}

PowerSGDCheckpoint powersgd_checkpoint_from_dict(const py::dict& d) {
  using TensorMap = std::map<int64_t, at::Tensor>;
  PowerSGDCheckpoint ck;
  ck.iter = d["iter"].cast<int64_t>();
  ck.rng_state = d["rng_state"].cast<std::string>();
  ck.numel_before = d["numel_before"].cast<int64_t>();
  ck.numel_after = d["numel_after"].cast<int64_t>();
  ck.next_stats_report = d["next_stats_report"].cast<int64_t>();
  ck.errors = d["errors"].cast<TensorMap>();
  ck.qs = d["qs"].cast<TensorMap>();
  if (d.contains("bucket_qs")) ck.bucket_qs = d["bucket_qs"].cast<TensorMap>();
  if (d.contains("bucket_error_tails")) {
    ck.bucket_error_tails = d["bucket_error_tails"].cast<TensorMap>();
  }
  if (d.contains("ps")) ck.ps = d["ps"].cast<TensorMap>();  // state for ACP-SGD only
  return ck;
}

void bind_powersgd(py::module& m) {
  py::class_<PowerSGDHook, CommHook, std::shared_ptr<PowerSGDHook>> powersgd(m, "PowerSGDHook");
  def_powersgd_common(powersgd);
  py::class_<AcpSgdHook, CommHook, std::shared_ptr<AcpSgdHook>> acpsgd(m, "AcpSgdHook");
  def_powersgd_common(acpsgd);
}

}  // namespace fastddp
