#include "side_stream.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <mutex>
#include <unordered_map>

#if defined(FASTDDP_WITH_CUDA)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace fastddp {
namespace {

// A stream of fastddp's own, not one of c10's pool: the pool hands its 32
// streams per device round-robin to every caller in the process
// (torch.cuda.Stream() included), so a pool stream could be a user's stream
// too and queue our work behind theirs. Created once per device and never
// destroyed (as the pool's are not), non-blocking with respect to the legacy
// default stream. One stream also bounds cuBLAS's memory: torch keeps one
// workspace per (cuBLAS handle, stream) pair for good (CUBLAS_WORKSPACE_CONFIG
// sets its size), so PowerSGD's products on this stream hold exactly one per
// device and thread that runs them, where drawing pool streams would add one
// per stream drawn.
c10::Stream new_side_stream(const c10::Device& device) {
#if defined(FASTDDP_WITH_CUDA)
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    cudaStream_t stream = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return c10::cuda::getStreamFromExternal(stream, device.index()).unwrap();
  }
#endif
  // Another device type with streams: its pool's (device-generic guard interface).
  const c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStreamFromGlobalPool(device);
}

void record_one(const at::Tensor& tensor) {
  if (!tensor.defined() || tensor.device().is_cpu()) return;
  const c10::impl::VirtualGuardImpl impl(tensor.device().type());
  tensor.record_stream(impl.getStream(tensor.device()));
}

}  // namespace

c10::Stream side_stream(const c10::Device& device) {
  static std::mutex mutex;
  static std::unordered_map<c10::Device, c10::Stream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end()) it = streams.emplace(device, new_side_stream(device)).first;
  return it->second;
}

SideStreamScope::SideStreamScope(const c10::Device& device) {
  if (device.is_cpu()) return;
  const c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream current = impl.getStream(device);
  const c10::Stream side = side_stream(device);
  c10::Event ready(device.type());
  ready.record(current);
  ready.block(side);  // a stream wait on the device: the host goes on
  guard_.emplace(side);
}

void record_current_stream(std::initializer_list<at::Tensor> tensors) {
  for (const at::Tensor& tensor : tensors) record_one(tensor);
}

void record_current_stream(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& tensor : tensors) record_one(tensor);
}

}  // namespace fastddp
