// The options of the PowerSGD hooks ("powersgd", "powersgd_batched"): one
// parser, so that both hooks take torch's PowerSGDState arguments with the
// same defaults, checks and messages.
#pragma once

#include <string>

#include "../../core/numpy_random.h"
#include "powersgd_plan.h"
#include "../common/registry.h"

namespace fastddp {

struct PowerSGDConfig {
  PowerSGDOptions options;
  NumpyRandomState rng;  // RandomState(random_seed), or resumed from numpy_rng_state
};

// Reads matrix_approximation_rank, start_powerSGD_iter, min_compression_rate,
// use_error_feedback, warm_start, orthogonalization_epsilon, random_seed,
// batch_tensors_with_same_shape, compression_stats_logging_frequency, iter
// and numpy_rng_state, with torch's defaults; raises ValueError, naming
// `hook`, for an unknown option or a value torch's PowerSGDState rejects.
PowerSGDConfig parse_powersgd_options(const HookOptions& o, const std::string& hook);

}  // namespace fastddp
