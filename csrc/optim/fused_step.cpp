#include "fused_step.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "../util/message.h"

namespace fastddp {

FusedStep::FusedStep(Kind kind, std::vector<at::Tensor> params, std::vector<int64_t> group_of,
                     InitState init_state)
    : kind_(kind),
      params_(std::move(params)),
      group_of_(std::move(group_of)),
      init_state_(std::move(init_state)),
      state_(params_.size()),
      known_(params_.size(), false),
      fresh_(params_.size(), false) {
  FASTDDP_CHECK(group_of_.size() == params_.size(), "fastddp: FusedStep got ", group_of_.size(),
                " group indices for ", params_.size(), " parameters");
}

void FusedStep::step_bucket(const std::vector<size_t>& params) {
  // Per param group, in the bucket's order: the parameters with a gradient,
  // as torch's step skips those whose .grad is None.
  std::vector<std::vector<size_t>> by_group(groups_.size());
  std::vector<size_t> missing;
  for (size_t index : params) {
    const int64_t group = group_of_.at(index);
    if (group < 0 || !params_[index].grad().defined()) continue;
    FASTDDP_CHECK(static_cast<size_t>(group) < groups_.size(), "fastddp: the overlapped "
                  "optimizer has no hyperparameters for param group ", group);
    by_group[group].push_back(index);
    if (!known_[index]) missing.push_back(index);
  }
  if (!missing.empty()) {
    auto [states, fresh] = init_state_(missing);  // takes the GIL: a first step only
    FASTDDP_CHECK(states.size() == missing.size() && fresh.size() == missing.size(),
                  "fastddp: the overlapped optimizer's state callback answered ", states.size(),
                  " states for ", missing.size(), " parameters");
    for (size_t k = 0; k < missing.size(); ++k) {
      state_[missing[k]] = std::move(states[k]);
      known_[missing[k]] = true;
      fresh_[missing[k]] = fresh[k];
    }
  }
  const at::NoGradGuard no_grad;
  for (size_t g = 0; g < by_group.size(); ++g) {
    if (!by_group[g].empty()) step_group(groups_[g], by_group[g]);
  }
}

void FusedStep::step_group(const FusedGroup& group, const std::vector<size_t>& params) {
  std::vector<at::Tensor> weights, grads;
  for (size_t index : params) {
    weights.push_back(params_[index]);
    grads.push_back(params_[index].grad());
  }
  if (kind_ == Kind::kSgd) {
    if (group.momentum == 0) {
      at::_fused_sgd_(weights, grads, {}, group.weight_decay, group.momentum, group.lr,
                      group.dampening, group.nesterov, group.maximize, /*is_first_step=*/false);
      return;
    }
    // torch passes is_first_step for a whole call; new and old buffers step apart here.
    for (const bool first : {true, false}) {
      std::vector<at::Tensor> w, g, buffers;
      for (size_t k = 0; k < params.size(); ++k) {
        if (fresh_[params[k]] != first) continue;
        w.push_back(weights[k]);
        g.push_back(grads[k]);
        buffers.push_back(state_[params[k]].at(0));
      }
      if (w.empty()) continue;
      at::_fused_sgd_(w, g, buffers, group.weight_decay, group.momentum, group.lr,
                      group.dampening, group.nesterov, group.maximize, first);
    }
    for (size_t index : params) fresh_[index] = false;
    return;
  }
  std::vector<at::Tensor> steps, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  for (size_t index : params) {
    const auto& state = state_[index];
    FASTDDP_CHECK(state.size() == (group.amsgrad ? 4u : 3u), "fastddp: Adam state of ",
                  state.size(), " tensors for a parameter (amsgrad=", group.amsgrad, ")");
    steps.push_back(state[0]);
    exp_avgs.push_back(state[1]);
    exp_avg_sqs.push_back(state[2]);
    if (group.amsgrad) max_exp_avg_sqs.push_back(state[3]);
  }
  at::_foreach_add_(steps, 1);
  if (group.decoupled_weight_decay) {
    at::_fused_adamw_(weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, group.lr,
                      group.beta1, group.beta2, group.weight_decay, group.eps, group.amsgrad,
                      group.maximize);
  } else {
    at::_fused_adam_(weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, group.lr,
                     group.beta1, group.beta2, group.weight_decay, group.eps, group.amsgrad,
                     group.maximize);
  }
}

}  // namespace fastddp
