// The put-back of a double-buffered hook state on a device (Note
// [double-buffered step state], hooks/common/spare_state.h): after the host
// has swapped in the step's new state, assuming it stands, this copies the
// state from before the step back over it when the device flag says the step
// was put back. On a kept step every block reads one byte and returns: the
// host never waits for the flag, and a finite step moves no state bytes.
//
// Raw pointers only. Built only with CUDA; `stream` is a cudaStream_t.
#pragma once

#include <cstdint>

namespace fastddp::kernels {

// Unless *keep (device memory): dst[0, bytes) = src[0, bytes), or zeros where
// src is nullptr.
void copy_unless_cuda(const void* src, void* dst, int64_t bytes, const bool* keep, void* stream);

}  // namespace fastddp::kernels
