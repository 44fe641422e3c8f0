// static_graph (Note [static graph]): the hook counts, the first iteration's
// delayed reduction of every bucket, however it is triggered (the output sink,
// the first gradient hook, or a framework calling reducer._delay_all_reduce()),
// and the switch itself.
#include "static_graph.h"

#include <torch/csrc/autograd/engine.h>

#include "../util/message.h"
#include "reducer.h"

namespace fastddp {

bool StaticGraph::last_hook(size_t index, const std::string& name, int rank) {
  FASTDDP_CHECK(left_[index] > 0,
                "Your training graph has changed in this iteration, e.g., one parameter is "
                "unused in first iteration, but then got used in the second iteration. this is "
                "not compatible with static_graph set to True. Parameter '",
                name, "' on rank ", rank, ".");
  return --left_[index] == 0;
}

std::vector<size_t> StaticGraph::unused() const {
  std::vector<size_t> unused;
  for (size_t i = 0; i < expected_.size(); ++i) {
    if (expected_[i] == 0) unused.push_back(i);
  }
  return unused;
}

void Reducer::on_output_grad() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!static_first_iteration() || phase_ != Phase::kExpecting || static_graph_.delayed_queued()) {
    return;
  }
  queue_delayed_reduce();
}

void Reducer::queue_delayed_reduce() {
  static_graph_.mark_delayed_queued();
  std::weak_ptr<Reducer> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto self = weak.lock()) self->reduce_all_delayed();
  });
}

void Reducer::delay_all_reduce() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    FASTDDP_CHECK(options_.static_graph && num_iterations_ <= 1,
                  "fastddp: reducer._delay_all_reduce() belongs to the first iteration of "
                  "static_graph=True training");
    if (static_graph_.delayed_queued() || phase_ != Phase::kExpecting) return;  // done or queued
    static_graph_.mark_delayed_queued();
  }
  reduce_all_delayed();
}

void Reducer::reduce_all_delayed() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.backward_started(num_iterations_);
  unused_.set(static_graph_.unused());
  finalize_queued_ = true;  // finalized right here, not by a second callback
  try {
    for (size_t i = 0; i < params_.size(); ++i) mark_ready(i);
  } catch (...) {
    fail_iteration(std::current_exception());
    throw;
  }
  unused_.launch_allreduce(*group_);
  finalize_backward();
}

void Reducer::set_static_graph() {
  std::lock_guard<std::mutex> lock(mutex_);
  FASTDDP_CHECK(num_iterations_ == 0,
                "set_static_graph() should be called before training loop starts and after "
                "DistributedDataParallel is constructed.");
  options_.static_graph = true;
}

}  // namespace fastddp
