// The reducer's side of DDP's mixed_precision (Note [mixed precision]): a
// forward cast the parameters. The grads and masters are MixedPrecision's
// (mixed_precision.h).
#include "../util/message.h"
#include "reducer.h"

namespace fastddp {

void Reducer::after_param_cast(std::vector<at::Tensor> params, std::vector<at::Tensor> masters) {
  std::lock_guard<std::mutex> lock(mutex_);
  FASTDDP_CHECK(options_.mixed_precision,
                "fastddp: after_param_cast belongs to a reducer built for mixed_precision");
  FASTDDP_CHECK(params.size() == masters.size(), "fastddp: ", params.size(),
                " cast parameters but ", masters.size(), " masters");
  // A forward of the module while its backward is reducing (the masters of this
  // iteration would be replaced half-way).
  FASTDDP_CHECK(!reducing(),
                "fastddp: mixed_precision: the module ran a forward while DDP's backward was "
                "reducing its gradients");
  mixed_precision_.set_cast(std::move(params), std::move(masters));
  // A dtype change (set_data) drops the parameter's grad accumulator: the next
  // backward runs a new one, which must carry the hook.
  install_hooks();
}

}  // namespace fastddp
