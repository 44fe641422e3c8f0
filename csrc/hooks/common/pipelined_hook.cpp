#include "pipelined_hook.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <c10/core/StreamGuard.h>

#include <exception>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "../../util/message.h"
#include "side_stream.h"

namespace fastddp {

c10::intrusive_ptr<c10::ivalue::Future> PipelinedHook::run(Bucket& bucket, size_t index,
                                                           bool is_last) {
  if (pending_ && index == 0) {
    // Left over from a step that failed before its last bucket without the
    // reducer noticing: its second collective must not be issued now.
    abandon_step();
  }
  c10::intrusive_ptr<c10::ivalue::Future> done;
  std::shared_ptr<Stage> stage = start(bucket, index, is_last, done);
  if (stage) {
    stage->index = index;
    done = stage->result;
    note_launch(index, nullptr);  // the stage's errors name their collective
  }
  FASTDDP_INTERNAL_ASSERT(done, "comm hook '", name(), "' started bucket ", index,
                          " without a future");
  if (pending_) {
    std::shared_ptr<Stage> previous = std::move(pending_);
    finish_or_fail(*previous);
  }
  if (stage) {
    if (is_last) {
      finish_or_fail(*stage);
    } else {
      pending_ = std::move(stage);
    }
  }
  return done;
}

void PipelinedHook::drain() {
  if (!pending_) return;
  std::shared_ptr<Stage> stage = std::move(pending_);
  finish_or_fail(*stage);
}

void PipelinedHook::abandon_step() {
  if (!pending_) return;
  std::shared_ptr<Stage> stage = std::move(pending_);
  try {
    stage->wait_first();
  } catch (...) {
    // Its error is the step's, which has failed already.
  }
  stage->result->setErrorIfNeeded(std::make_exception_ptr(
      std::runtime_error("fastddp: comm hook '" + name() + "': the step was abandoned")));
}

void PipelinedHook::finish_or_fail(Stage& stage) {
  try {
    finish(stage);
  } catch (...) {
    // The reducer reports it from backward(), naming the bucket and hook.
    stage.result->setErrorIfNeeded(std::current_exception());
  }
}

std::runtime_error collective_failure(const std::string& what, const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return std::runtime_error(what + " failed: " +
                            (error ? error->what_without_backtrace() : e.what()));
}

void wait_collective(c10d::Work& work, const std::string& what) {
  try {
    work.wait();
  } catch (const std::exception& e) {
    throw collective_failure(what, e);
  }
}

c10::intrusive_ptr<c10::ivalue::Future> make_result(const at::Tensor& like) {
  std::vector<c10::Device> devices;
  if (!like.device().is_cpu()) devices.push_back(like.device());
  return c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(), std::move(devices));
}

void PipelinedHook::complete_after(const c10::intrusive_ptr<c10::ivalue::Future>& collective,
                                   const c10::intrusive_ptr<c10::ivalue::Future>& result,
                                   std::string what, std::function<c10::IValue()> local_work) {
  // torch runs the callback with a pool stream current that it made wait for
  // the collective, so `result` records its events after the collective.
  collective->addCallback([result, what = std::move(what),
                           work = std::move(local_work)](c10::ivalue::Future& fut) {
    if (fut.hasError()) {
      result->setErrorIfNeeded(collective_error(what, fut));
      return;
    }
    try {
      result->markCompleted(work());
    } catch (...) {
      result->setErrorIfNeeded(std::current_exception());
    }
  });
}

void PipelinedHook::complete_on_side_stream(
    const c10::intrusive_ptr<c10::ivalue::Future>& collective,
    const c10::intrusive_ptr<c10::ivalue::Future>& result, std::string what,
    std::function<c10::IValue()> local_work) {
  // make_result: one device for a bucket on one, none on the CPU.
  const std::vector<c10::Device> devices = result->devices();
  collective->addCallback([result, devices, what = std::move(what),
                           work = std::move(local_work)](c10::ivalue::Future& fut) {
    if (fut.hasError()) {
      result->setErrorIfNeeded(collective_error(what, fut));
      return;
    }
    try {
      std::optional<c10::StreamGuard> side;
      if (!devices.empty()) {
        // Not the pool stream torch made current (Note [hook streams]): the
        // side stream, made to wait for the collective's events (wait() on a
        // completed future is that stream wait, and records the collective's
        // outputs on the side stream with the caching allocator).
        side.emplace(side_stream(devices.front()));
        fut.wait();
      }
      // Inside the guard: markCompleted records `result`'s events on the side
      // stream, after local_work's kernels.
      result->markCompleted(work());
    } catch (...) {
      result->setErrorIfNeeded(std::current_exception());
    }
  });
}

}  // namespace fastddp
