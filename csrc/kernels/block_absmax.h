// The largest |x| of a block as a float32 bit pattern, for the block-scaled
// quantizers' CPU loops (quant8_cpu.cpp, quant4_cpu.cpp): an unsigned max over
// the bit patterns (the bits of a non-negative float order as the float does)
// vectorizes where a float max would not without giving up NaN rules, and it
// finds a NaN or an infinity (>= 0x7F800000) in the same pass. Always inlined,
// so that it is vectorized inside each FASTDDP_VECTOR_CLONES clone.
#pragma once

#include <cstdint>

#include "../core/half_rounding.h"

namespace fastddp::kernels {

inline __attribute__((always_inline)) uint32_t block_absmax_bits(const float* __restrict x,
                                                                 int64_t len) {
  uint32_t m = 0;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t b = float_bits(x[i]) & 0x7FFFFFFFu;
    m = b > m ? b : m;
  }
  return m;
}

// Whole blocks per CPU task for the block-scaled quantizers' tensor ops (quant8_ops.cpp,
// quant4_ops.cpp): about 64K elements a task, as the half casts.
inline int64_t cpu_task_blocks(int64_t block) {
  const int64_t blocks = (int64_t{1} << 16) / block;
  return blocks > 1 ? blocks : 1;
}

}  // namespace fastddp::kernels
