// The reducer's side of check_for_nan_in_grad (Note [non-finite guard]).
#include <c10/util/Exception.h>

#include "nonfinite_guard.h"
#include "reducer.h"
#include "../util/message.h"

namespace fastddp {

void Reducer::check_finite_gradients() {
  const at::Device device = params_[0].device();
  NonFiniteGuard& guard = *finite_.guard();
  guard.launch(*group_, device, num_iterations_);
  const std::vector<NonFiniteGuard::Finding> found = guard.wait();
  if (found.empty()) return;
  finite_.note_guard_failed();  // fail_iteration tells the hook, once the step's futures are done
  std::vector<std::string> where;
  for (const auto& f : found) {
    const std::string name = f.param < names_.size() ? names_[f.param] : "?";
    where.push_back(cat("in parameter '", name, "' on rank ", f.rank, " at step ", f.step));
  }
  FASTDDP_CHECK(false, "fastddp: non-finite gradient (NaN or Inf) ", join(where, "; "),
                " (check_for_nan_in_grad=True). No averaged gradient was written to param.grad "
                "this step, so the non-finite values did not reach other ranks' .grad",
                options_.gradient_as_bucket_view
                    ? " (but with gradient_as_bucket_view=True .grad is the bucket itself and "
                      "holds the reduced values)"
                    : "",
                "; zero the gradients before the next backward.");
}

}  // namespace fastddp
