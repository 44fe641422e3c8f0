// Base of comm hooks that need two dependent collectives per bucket
// (PowerSGD: allreduce P, then Q computed from the reduced P).
//
// Note [pipelined hooks]
// Every collective must be issued in the same order on every rank (gloo
// pairs collectives by issue order; NCCL by stream order), so none is issued
// from a completion callback, which would race the next bucket's run() (the
// failure of torch's powerSGD_hook with several buckets on gloo). run() is
// called in bucket order on every rank, and issues, in this order:
//   start(bucket i)     the bucket's first collective;
//   finish(bucket i-1)  waits for i-1's first collective (issued one bucket
//                       of backward earlier: usually done), does the local
//                       work and issues i-1's second collective;
//   finish(bucket i)    only for the last bucket.
// So per step: A0, A1, B0, A2, B1, ..., A(last), B(last-1), B(last): the
// first collective of a bucket overlaps the backward of the next one, the
// second overlaps the next bucket's first. Each bucket's future completes
// when its second collective and the local work after it (a callback on the
// second collective's future: local work only) are done.
// On CUDA, waiting for a c10d future makes the current stream wait on the
// collective's; the host does not block. torch runs a future's callbacks with
// a stream of c10's global pool current (one that any code in the process may
// also be handed), so a callback that launches device work switches to
// fastddp's side stream first (complete_on_side_stream, Note [hook streams]).
#pragma once

#include <ATen/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>

#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "../../reducer/comm_hook.h"

namespace c10d {
class Work;
}  // namespace c10d

namespace fastddp {

// A future for a hook's run() to return, on the bucket's device.
c10::intrusive_ptr<c10::ivalue::Future> make_result(const at::Tensor& like);
// "<what> failed: <e's message, without C++ backtrace>", for an error of a
// collective or phase that the backend's own text would not name.
std::runtime_error collective_failure(const std::string& what, const std::exception& e);
// Waits for `work` (a stream wait on CUDA) and rethrows as collective_failure.
void wait_collective(c10d::Work& work, const std::string& what);

class PipelinedHook : public CommHook {
 public:
  c10::intrusive_ptr<c10::ivalue::Future> run(Bucket& bucket, size_t index,
                                              bool is_last) final;

 protected:
  // One bucket between its two collectives.
  struct Stage {
    virtual ~Stage() = default;
    // What run() returned for the bucket; completed by finish()'s chain.
    c10::intrusive_ptr<c10::ivalue::Future> result;
    size_t index = 0;
    // Waits (a stream wait on CUDA) for the first collective: its buffers are
    // free again afterwards.
    virtual void wait_first() = 0;
  };

  // The last bucket was skipped: finishes the pending stage, as run() does
  // for an is_last bucket.
  void drain() final;

  // The reducer gave the step up: waits for the pending stage's first
  // collective and fails the stage's future (its second is never issued).
  void abandon_step() final;

  // Issues the bucket's first collective. Returns the stage that finish()
  // will take, or nullptr when one collective was enough (`done` is then the
  // bucket's future).
  virtual std::shared_ptr<Stage> start(Bucket& bucket, size_t index, bool is_last,
                                       c10::intrusive_ptr<c10::ivalue::Future>& done) = 0;
  // Waits for the stage's first collective, does the local work, issues the
  // second collective and completes stage.result through complete_after().
  virtual void finish(Stage& stage) = 0;

  // Completes `result` with local_work()'s value once `collective` is done
  // (with its error as collective_error(what, ...), or local_work's
  // exception, if any). local_work runs in the completion callback: it must
  // not issue collectives, and here must launch no device work either (it
  // would run on the pool stream torch made current): a value to hand on.
  static void complete_after(const c10::intrusive_ptr<c10::ivalue::Future>& collective,
                             const c10::intrusive_ptr<c10::ivalue::Future>& result,
                             std::string what, std::function<c10::IValue()> local_work);
  // The same for local work that launches device work (PowerSGD's
  // decompression): on a device it runs on fastddp's side stream, after a
  // stream wait on the collective (no host block), and `result` is completed
  // there, so whoever waits on it waits for that work too.
  static void complete_on_side_stream(const c10::intrusive_ptr<c10::ivalue::Future>& collective,
                                      const c10::intrusive_ptr<c10::ivalue::Future>& result,
                                      std::string what,
                                      std::function<c10::IValue()> local_work);

 private:
  void finish_or_fail(Stage& stage);

  // The bucket whose second collective is not issued yet. Touched by run()
  // only (the autograd thread), so it needs no lock.
  std::shared_ptr<Stage> pending_;
};

}  // namespace fastddp
