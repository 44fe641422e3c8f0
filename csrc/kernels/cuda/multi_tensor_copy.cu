// Multi-tensor copy, after the pattern of apex's multi_tensor_apply: the
// pointers of up to kMaxRanges ranges travel in the kernel's arguments, and
// each block copies one chunk of one range.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "../multi_tensor_copy.h"

namespace fastddp::kernels {
namespace {

constexpr int kMaxRanges = 64;
constexpr int kMaxBlocks = 320;
constexpr int kThreads = 256;
constexpr int64_t kChunkBytes = 64 * 1024;

struct LaunchArgs {
  const char* src[kMaxRanges];
  char* dst[kMaxRanges];
  int64_t bytes[kMaxRanges];
  // Block b copies chunk block_chunk[b] of range block_range[b].
  unsigned char block_range[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};

// Word is the widest unit every range of this launch is aligned to.
template <typename Word>
__global__ void copy_chunks(LaunchArgs args) {
  const int r = args.block_range[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(args.block_chunk[blockIdx.x]) * kChunkBytes;
  const int64_t end = min(begin + kChunkBytes, args.bytes[r]);
  const Word* src = reinterpret_cast<const Word*>(args.src[r] + begin);
  Word* dst = reinterpret_cast<Word*>(args.dst[r] + begin);
  const int64_t n = (end - begin) / static_cast<int64_t>(sizeof(Word));
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

void check(cudaError_t err) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fastddp multi_tensor_copy_cuda: ") +
                             cudaGetErrorString(err));
  }
}

// The widest power-of-two unit (up to 16 bytes) dividing every address and size.
int common_alignment(const CopyRange* ranges, int64_t count) {
  uintptr_t bits = 16;
  for (int64_t i = 0; i < count; ++i) {
    bits |= reinterpret_cast<uintptr_t>(ranges[i].src) | reinterpret_cast<uintptr_t>(ranges[i].dst) |
            static_cast<uintptr_t>(ranges[i].bytes);
  }
  return static_cast<int>(bits & (~bits + 1));  // lowest set bit
}

void launch(const LaunchArgs& args, int blocks, int alignment, cudaStream_t stream) {
  switch (alignment) {
    case 16: copy_chunks<uint4><<<blocks, kThreads, 0, stream>>>(args); break;
    case 8: copy_chunks<uint2><<<blocks, kThreads, 0, stream>>>(args); break;
    case 4: copy_chunks<unsigned int><<<blocks, kThreads, 0, stream>>>(args); break;
    case 2: copy_chunks<unsigned short><<<blocks, kThreads, 0, stream>>>(args); break;
    default: copy_chunks<unsigned char><<<blocks, kThreads, 0, stream>>>(args); break;
  }
  check(cudaGetLastError());
}

}  // namespace

void multi_tensor_copy_cuda(const CopyRange* ranges, int64_t count, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int alignment = common_alignment(ranges, count);
  LaunchArgs args;
  int n_ranges = 0;
  int n_blocks = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (ranges[i].bytes == 0) continue;
    args.src[n_ranges] = static_cast<const char*>(ranges[i].src);
    args.dst[n_ranges] = static_cast<char*>(ranges[i].dst);
    args.bytes[n_ranges] = ranges[i].bytes;
    const int64_t chunks = (ranges[i].bytes + kChunkBytes - 1) / kChunkBytes;
    for (int64_t c = 0; c < chunks; ++c) {
      args.block_range[n_blocks] = static_cast<unsigned char>(n_ranges);
      args.block_chunk[n_blocks] = static_cast<int>(c);
      if (++n_blocks == kMaxBlocks) {
        launch(args, n_blocks, alignment, stream);
        n_blocks = 0;
      }
    }
    // Start a fresh argument pack when the range table is full; a range whose
    // chunks were all launched above needs no slot any more.
    ++n_ranges;
    if (n_ranges == kMaxRanges) {
      if (n_blocks > 0) launch(args, n_blocks, alignment, stream);
      n_blocks = 0;
      n_ranges = 0;
    }
  }
  if (n_blocks > 0) launch(args, n_blocks, alignment, stream);
}

}  // namespace fastddp::kernels
