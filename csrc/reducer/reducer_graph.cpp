// The reducer's view of the autograd graph: the output sink, the search for
// unused parameters, and the errors torch DDP raises when the graph and the
// reducer disagree (same wording, with parameter names).
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>

#include <unordered_set>

#include "reducer.h"
#include "../util/message.h"

namespace fastddp {
namespace {

struct ReducerHandle : torch::CustomClassHolder {
  explicit ReducerHandle(std::weak_ptr<Reducer> r) : reducer(std::move(r)) {}
  std::weak_ptr<Reducer> reducer;
};

// Identity on the forward outputs. Its backward runs in the outer backward
// call (not in a reentrant one started by checkpointing), so the callback it
// queues runs when the whole backward is done; and outputs that do not reach
// the loss still send (undefined) gradients through their part of the graph,
// so their parameters' hooks fire instead of leaving the reducer waiting.
struct OutputSink : public torch::autograd::Function<OutputSink> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList outputs,
                                                c10::intrusive_ptr<ReducerHandle> handle,
                                                bool clone) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["reducer"] = c10::IValue::make_capsule(std::move(handle));
    if (!clone) return outputs.vec();
    // As torch's _DDPSink: an output returned as is would be a view of the
    // sink's input, and the user's in-place ops on it (loss *= scale) would fail.
    std::vector<at::Tensor> copies;
    copies.reserve(outputs.size());
    for (const at::Tensor& output : outputs) copies.push_back(output.clone());
    return copies;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto handle = c10::static_intrusive_pointer_cast<ReducerHandle>(
        ctx->saved_data["reducer"].toCapsule());
    if (auto reducer = handle->reducer.lock()) reducer->on_output_grad();
    grads.emplace_back();  // for the handle argument
    grads.emplace_back();  // and the clone flag
    return grads;
  }
};

}  // namespace

std::vector<at::Tensor> Reducer::after_forward(bool sync, std::vector<at::Tensor> outputs) {
  bool sink = false;
  bool sink_clone = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!sync) {
      phase_ = Phase::kIdle;
      return outputs;
    }
    phase_ = Phase::kExpecting;
    reset_iteration();
    if (dynamic_find_unused()) unused_.set(search_unused_parameters(outputs));
    vote_on_skips();  // Note [skipping unused buckets]
    sink = dynamic_find_unused() || (static_first_iteration() && !static_graph_.delayed_queued());
    sink_clone = options_.sink_clone;
    // No output to hang the sink on: as prepare_for_backward, queue the first
    // static-graph iteration's reduction from the first gradient hook.
    static_graph_.set_delay_from_first_hook(static_first_iteration() && outputs.empty());
  }
  if (!sink || outputs.empty()) return outputs;
  // A TensorList, not the vector: apply() tracks only tensor arguments it
  // recognizes as such.
  return OutputSink::apply(at::TensorList(outputs),
                           c10::make_intrusive<ReducerHandle>(weak_from_this()), sink_clone);
}

void Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  phase_ = Phase::kExpecting;
  reset_iteration();
  if (dynamic_find_unused()) unused_.set(search_unused_parameters(outputs));
  vote_on_skips();
  static_graph_.set_delay_from_first_hook(static_first_iteration());
}

std::vector<size_t> Reducer::search_unused_parameters(
    const std::vector<at::Tensor>& outputs) const {
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> queue;
  for (const at::Tensor& output : outputs) {
    if (auto fn = output.grad_fn()) {
      if (seen.insert(fn.get()).second) queue.push_back(fn.get());
    }
  }
  while (!queue.empty()) {
    torch::autograd::Node* fn = queue.back();
    queue.pop_back();
    for (const auto& edge : fn->next_edges()) {
      torch::autograd::Node* next = edge.function.get();
      if (next && seen.insert(next).second) queue.push_back(next);
    }
  }
  std::vector<size_t> unused;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (seen.count(const_cast<torch::autograd::Node*>(grad_hooks_.accumulator(i))) == 0) {
      unused.push_back(i);
    }
  }
  if (unused.empty()) {
    FASTDDP_WARN_ONCE(
        "find_unused_parameters=True was specified in DDP constructor, but did not find any "
        "unused parameters in the forward pass. This flag results in an extra traversal of the "
        "autograd graph every iteration,  which can adversely affect performance. If your model "
        "indeed never has any unused parameters in the forward pass, consider turning this flag "
        "off. Note that this warning may be a false positive if your model has flow control "
        "causing later iterations to have unused parameters.");
  }
  return unused;
}

void Reducer::ensure_prior_reduction_finished() const {
  if (!reducing()) return;
  std::string message =
      "Expected to have finished reduction in the prior iteration before starting a new one. ";
  const std::string outputs_in_loss =
      "making sure all `forward` function outputs participate in calculating loss. ";
  if (options_.static_graph) {
    message +=
        "This error indicates that your training graph has changed in this iteration, e.g., one "
        "parameter is used in first iteration, but then got unused in the second iteration. "
        "this is not compatible with static_graph set to True.";
  } else if (!options_.find_unused_parameters) {
    message +=
        "This error indicates that your module has parameters that were not used in producing "
        "loss. You can enable unused parameter detection by passing the keyword argument "
        "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, and by \n" +
        outputs_in_loss;
  } else {
    message +=
        "This error indicates that your module has parameters that were not used in producing "
        "loss. Since `find_unused_parameters=True` is enabled, this likely  means that not all "
        "`forward` outputs participate in computing loss. You can fix this by " +
        outputs_in_loss;
  }
  std::vector<std::string> indices;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) indices.push_back(cat(i));
  }
  FASTDDP_CHECK(false, message, "\nParameters which did not receive grad for rank ", rank(), ": ",
                unready_params(), "\nParameter indices which did not receive grad for rank ",
                rank(), ": ", join(indices, ", "));
}

void Reducer::check_not_ready(size_t index) const {
  if (!ready_[index]) return;
  std::string message =
      "Expected to mark a variable ready only once. This error is caused by one of the "
      "following reasons: 1) Use of a module parameter outside the `forward` function. Please "
      "make sure model parameters are not shared across multiple concurrent forward-backward "
      "passes. or try to use _set_static_graph() as a workaround if this module graph does not "
      "change during training loop.2) Reused parameters in multiple reentrant backward passes. "
      "For example, if you use multiple `checkpoint` functions to wrap the same part of your "
      "model, it would result in the same set of parameters been used by different reentrant "
      "backward passes multiple times, and hence marking a variable ready multiple times. DDP "
      "does not support such use cases in default. You can try to use _set_static_graph() as a "
      "workaround if your module graph does not change over iterations.";
  if (options_.find_unused_parameters) {
    message +=
        "3) Incorrect unused parameter detection. The return value of the `forward` function is "
        "inspected by the distributed data parallel wrapper to figure out if any of the "
        "module's parameters went unused. For unused parameters, DDP would not expect gradients "
        "from then. However, if an unused parameter becomes part of the autograd graph at a "
        "later point in time (e.g., in a reentrant backward when using `checkpoint`), the "
        "gradient will show up unexpectedly. If all parameters in the model participate in the "
        "backward pass, you can disable unused parameter detection by passing the keyword "
        "argument `find_unused_parameters=False` to `torch.nn.parallel.DistributedDataParallel`. "
        "If unused parameters in the model do not change over iterations, You can try to use "
        "_set_static_graph() as a workaround if this module graph does not change during "
        "training loop.";
  }
  FASTDDP_CHECK(false, message, "\nParameter at index ", index, " with name ", names_[index],
                " has been marked as ready twice. This means that multiple autograd engine  hooks "
                "have fired for this particular parameter during this iteration (rank ",
                rank(), ").");
}

std::string Reducer::unready_params() const {
  std::vector<std::string> names;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) names.push_back(names_[i]);
  }
  return join(names, ", ");
}

}  // namespace fastddp
