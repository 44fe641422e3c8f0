// FASTDDP_VECTOR_CLONES: on x86-64 GCC builds, a function is compiled for
// AVX-512, AVX2 and baseline SSE2 and the loader picks one for the running
// CPU, so the one portable binary still gets wide vectors in plain loops.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define FASTDDP_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FASTDDP_VECTOR_CLONES
#endif
