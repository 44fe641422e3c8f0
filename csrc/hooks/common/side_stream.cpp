#include "side_stream.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <mutex>
#include <unordered_map>

namespace fastddp {
namespace {

// Device-generic (c10's guard interface), so the CPU build compiles the same
// code and a CUDA build needs no CUDA header here.
c10::Stream side_stream_of(const c10::Device& device) {
  static std::mutex mutex;
  static std::unordered_map<c10::Device, c10::Stream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end()) {
    const c10::impl::VirtualGuardImpl impl(device.type());
    it = streams.emplace(device, impl.getStreamFromGlobalPool(device)).first;
  }
  return it->second;
}

void record_one(const at::Tensor& tensor) {
  if (!tensor.defined() || tensor.device().is_cpu()) return;
  const c10::impl::VirtualGuardImpl impl(tensor.device().type());
  tensor.record_stream(impl.getStream(tensor.device()));
}

}  // namespace

SideStreamScope::SideStreamScope(const c10::Device& device) {
  if (device.is_cpu()) return;
  const c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream current = impl.getStream(device);
  const c10::Stream side = side_stream_of(device);
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
