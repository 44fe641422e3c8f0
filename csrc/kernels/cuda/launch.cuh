// Launch helpers shared by fastddp's CUDA kernels: errors as exceptions, alignment
// tests for the vector paths, and a grid sized to fill the current device once.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace fastddp::kernels::cuda_launch {

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fastddp ") + what + ": " + cudaGetErrorString(err));
  }
}

inline bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// The blocks of `threads` threads that the current device runs at once for `Kernel`:
// its SMs times the blocks per SM its occupancy allows. A grid-stride kernel launched
// with this many keeps every SM full with no second wave of blocks; a fixed count (the
// old 320-block packs) left an H100's 132 SMs two-thirds idle (issue 32). Cached per
// device: the queries cost microseconds, a launch must not.
template <auto Kernel>
int full_grid(int threads) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];  // static: zero until first asked
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  if (device < kMaxDevices) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int sms = 0;
  int per_sm = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, 0),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  const int blocks = std::max(1, sms) * std::max(1, per_sm);
  if (device < kMaxDevices) cached[device].store(blocks, std::memory_order_relaxed);
  return blocks;
}

// At most `blocks` blocks, and no more than the work needs.
inline int capped(int64_t work_blocks, int blocks) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(work_blocks, blocks)));
}

}  // namespace fastddp::kernels::cuda_launch
