// The float16 loops of half_cast_cpu.cpp with the x86 F16C instructions.
//
// vcvtps2ph rounds float32 to float16 to nearest even in hardware, subnormals
// and overflow included: bit for bit the portable conversion of
// core/half_rounding.h (Maratea's float trick) on every value but NaN, whose
// payload it keeps (both stay NaN; Note [half rounding]). GCC does not
// vectorize the trick: the fp16 hooks' CPU compress ran at ~4 ns a value, and
// a step with the fp16 hook took 3x the bf16 hook's (issue 43's check of the
// hooks' step ratios, benchmarks/hook_step_time.py --stateful). Every x86-64
// CPU since 2012 has F16C; the portable loops stay for the others.
// Raw pointers only, as half_cast.h; each function does all n values.
#pragma once

#include <cstdint>

namespace fastddp::kernels::f16c {

// Whether this CPU has F16C and AVX2 (checked once) and this build can use them.
bool available();

// half_cast.h's compress_cpu for float16 (residual and new_residual: both or
// neither); returns whether some src value was not finite when `check`.
bool compress(const float* src, float scale, const float* residual, float* new_residual,
              uint16_t* dst, int64_t n, bool check);
// cast_divide_cpu for float16.
bool cast_divide(const float* src, float divisor, uint16_t* dst, int64_t n, bool check);
// dst[i] = float16(src[i]).
void from_float(const float* src, uint16_t* dst, int64_t n);
// dst[i] = float(src[i]), and dst[i] += float(src[i]) (exact).
void to_float(const uint16_t* src, float* dst, int64_t n);
void add_to_float(const uint16_t* src, float* dst, int64_t n);

}  // namespace fastddp::kernels::f16c
