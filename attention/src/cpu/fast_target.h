// How the CPU attention fast path's kernels are compiled: vectorisation pragmas, forced
// inlining, and the target attributes of the AVX2 and AVX-512 variants (fast.cc says why
// the same C++ is compiled three times). Private to attention/src/cpu/; the kernel headers
// beside it (fast_*.h) are written with these macros and only the fast path includes them.
#ifndef KVSTREAM_ATTENTION_CPU_FAST_TARGET_H_
#define KVSTREAM_ATTENTION_CPU_FAST_TARGET_H_

#define KVSTREAM_PRAGMA(x) _Pragma(#x)
#if defined(_OPENMP)
#define KVSTREAM_SIMD _Pragma("omp simd")
// A maximum the compiler may compute in any order (a maximum has one answer in any order).
#define KVSTREAM_SIMD_MAX(var) KVSTREAM_PRAGMA(omp simd reduction(max : var))
#elif defined(__clang__)
// clang defines __GNUC__ but knows no `GCC ivdep`; it vectorizes these loops by itself.
#define KVSTREAM_SIMD
#define KVSTREAM_SIMD_MAX(var)
#elif defined(__GNUC__)
#define KVSTREAM_SIMD _Pragma("GCC ivdep")
#define KVSTREAM_SIMD_MAX(var)
#else
#define KVSTREAM_SIMD
#define KVSTREAM_SIMD_MAX(var)
#endif

#if defined(__GNUC__)
#define KVSTREAM_INLINE inline __attribute__((always_inline))
#else
#define KVSTREAM_INLINE inline
#endif

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 intrinsics pass an "undefined" vector that -Wuninitialized flags
// wherever they are inlined; the warning is about the header, not about this code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#pragma GCC diagnostic pop
#define KVSTREAM_X86_DISPATCH 1
#define KVSTREAM_ISA_AVX2 "avx2,fma,f16c,bmi,bmi2"
#define KVSTREAM_ISA_AVX512 "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi,bmi2"
#define KVSTREAM_TARGET_AVX2 __attribute__((target(KVSTREAM_ISA_AVX2), flatten))
#define KVSTREAM_TARGET_AVX512 __attribute__((target(KVSTREAM_ISA_AVX512), flatten))
#define KVSTREAM_TARGET_AVX2_INLINE inline __attribute__((target(KVSTREAM_ISA_AVX2), always_inline))
#define KVSTREAM_TARGET_AVX512_INLINE \
  inline __attribute__((target(KVSTREAM_ISA_AVX512), always_inline))
#else
#define KVSTREAM_X86_DISPATCH 0
#endif

#endif  // KVSTREAM_ATTENTION_CPU_FAST_TARGET_H_
