#include "powersgd_options.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <variant>

#include "powersgd_base.h"
#include "../../util/message.h"

namespace fastddp {

PowerSGDConfig parse_powersgd_options(const HookOptions& o, const std::string& hook) {
  o.check_known({"matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
                 "use_error_feedback", "warm_start", "orthogonalization_epsilon", "random_seed",
                 "batch_tensors_with_same_shape", "compression_stats_logging_frequency", "iter",
                 "numpy_rng_state"});
  PowerSGDOptions p;
  p.matrix_approximation_rank = o.get_int("matrix_approximation_rank", 1);
  p.start_powerSGD_iter = o.get_int("start_powerSGD_iter", 1000);
  p.min_compression_rate = o.get_double("min_compression_rate", 2.0);
  p.use_error_feedback = o.get_bool("use_error_feedback", true);
  p.warm_start = o.get_bool("warm_start", true);
  p.orthogonalization_epsilon = o.get_double("orthogonalization_epsilon", 0.0);
  p.batch_tensors_with_same_shape = o.get_bool("batch_tensors_with_same_shape", false);
  // torch: max(1, frequency).
  p.compression_stats_logging_frequency =
      std::max<int64_t>(1, o.get_int("compression_stats_logging_frequency", 10000));
  p.iter = o.get_int("iter", 0);
  FASTDDP_CHECK_VALUE(p.matrix_approximation_rank >= 1, "comm hook '", hook,
                      "': matrix_approximation_rank must be >= 1, got ",
                      p.matrix_approximation_rank);
  FASTDDP_CHECK_VALUE(!((p.use_error_feedback || p.warm_start) && p.start_powerSGD_iter <= 1),
                      "comm hook '", hook, "': start_powerSGD_iter must be > 1 when "
                      "use_error_feedback or warm_start is enabled (torch's rule: buckets are "
                      "rebuilt after the first iteration), got ", p.start_powerSGD_iter);
  const int64_t seed = o.get_int("random_seed", 0);
  FASTDDP_CHECK_VALUE(seed >= 0 && seed <= 0xffffffffLL, "comm hook '", hook,
                      "': random_seed must be between 0 and 2**32 - 1 "
                      "(numpy's RandomState seeds), got ", seed);
  PowerSGDConfig config{p, NumpyRandomState(static_cast<uint32_t>(seed))};
  auto it = o.values().find("numpy_rng_state");
  if (it != o.values().end()) {
    FASTDDP_CHECK_VALUE(std::holds_alternative<std::string>(it->second), "comm hook '", hook,
                        "': numpy_rng_state must be a str");
    set_numpy_rng_state(config.rng, std::get<std::string>(it->second));
  }
  return config;
}

}  // namespace fastddp
