// Streams of a hook's work between its two collectives.
//
// Note [hook streams]
// On a device with streams (CUDA), one step of a two-collective hook runs as:
//   compute stream  backward, copy_in (compress), the first collective's input;
//                   an event after them
//   side stream     waits for that event; waits for the first collective
//                   (a stream wait, no host block); local work (PowerSGD's
//                   orthogonalization and Q product, the fp32 shard sum);
//                   issues the second collective, which ProcessGroupNCCL
//                   orders after the side stream
//   NCCL streams    both collectives
//   side stream     the completion callback's local work (PowerSGD's
//                   decompression): torch runs a future's callbacks with a
//                   stream of c10's global pool current, which any code in
//                   the process may be handed too, so the callback makes the
//                   side stream current, waits there for the collective's
//                   events (a stream wait), runs, and completes the bucket's
//                   future on the side stream (complete_on_side_stream in
//                   pipelined_hook.h)
//   compute stream  waits only in the reducer's finalize, at the end of
//                   backward, on the bucket's future.
// So backward never queues behind communication, and no hook kernel runs on
// a pool stream. The side stream is one per device, created by fastddp (not
// one of c10's pool, which other code draws from too) and shared by all
// hooks of the process; being one in-order stream, bucket i's local work
// queues behind bucket i-1's decompression, which waits for i-1's second
// collective, while the NCCL stream goes on with the next first collective.
// Every tensor used
// on a stream other than the one it was allocated on is recorded there with
// the caching allocator (recordStream), so its memory is not reused before
// that stream's work ran; no tensor is kept alive by hand for that.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/StreamGuard.h>

#include <initializer_list>
#include <optional>
#include <vector>

namespace fastddp {

// Makes `device`'s side stream current for the scope, after making it wait for
// the work queued so far on the current stream. Does nothing on the CPU.
class SideStreamScope {
 public:
  explicit SideStreamScope(const c10::Device& device);
  SideStreamScope(const SideStreamScope&) = delete;
  SideStreamScope& operator=(const SideStreamScope&) = delete;

 private:
  std::optional<c10::StreamGuard> guard_;
};

// `device`'s side stream (the same one for the life of the process).
c10::Stream side_stream(const c10::Device& device);

// recordStream on the current stream for each defined non-CPU tensor: they are
// used by work queued there (Note [hook streams]).
void record_current_stream(std::initializer_list<at::Tensor> tensors);
void record_current_stream(const std::vector<at::Tensor>& tensors);

}  // namespace fastddp
