// The instruction-set variants of the CPU attention fast path as configs for its kernels
// (ProcessItem<Cfg>, Gemm<Cfg>): register blocking, fma or not, and the transposes.
#ifndef KVSTREAM_ATTENTION_CPU_FAST_VARIANTS_H_
#define KVSTREAM_ATTENTION_CPU_FAST_VARIANTS_H_

#include <cstdint>

#include "kvstream/attention/backend.h"
#include "cpu/fast_prefetch.h"
#include "cpu/fast_target.h"
#include "cpu/fast_transpose.h"

namespace kvstream {
namespace internal {
namespace cpu_fast {

// Register blocking per instruction set: kMR rows of broadcast operand by kNB columns of
// streamed operand stay in registers (AVX-512: 4 x 4 zmm; AVX2: 6 x 2 ymm; SSE2: 4 x 2 xmm).
// kFma: MicroKernel accumulates with fma. kRawK: TransposeRows reads float32, float16 and
// bfloat16 K rows from the cache itself (with head_size a multiple of kLanes); other tiles
// are converted into k_rows first and transposed from there as float32.
struct GenericConfig {
  static constexpr int kMR = 4;
  static constexpr int kNB = 8;
  static constexpr bool kFma = false;
  static constexpr bool kRawK = false;
  static void TransposeRows(DType /*src: always float32*/, const char* const* rows, int n,
                            int dims, float* dst, int64_t ldt, TilePrefetcher& pf, int pf_from,
                            int pf_to) {
    TransposeRowsGeneric(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
  }
};
#if KVSTREAM_X86_DISPATCH
struct Avx2Config {
  static constexpr int kMR = 6;
  static constexpr int kNB = 16;
  static constexpr bool kFma = true;
  static constexpr bool kRawK = true;
  KVSTREAM_TARGET_AVX2 static void TransposeRows(DType src, const char* const* rows, int n,
                                                 int dims, float* dst, int64_t ldt,
                                                 TilePrefetcher& pf, int pf_from, int pf_to) {
    switch (src) {
      case DType::kBFloat16:
        TransposeRowsAvx2<DType::kBFloat16>(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
        break;
      case DType::kFloat16:
        TransposeRowsAvx2<DType::kFloat16>(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
        break;
      default:
        TransposeRowsAvx2<DType::kFloat32>(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
        break;
    }
  }
};
struct Avx512Config {
  static constexpr int kMR = 4;
  static constexpr int kNB = 64;
  static constexpr bool kFma = true;
  static constexpr bool kRawK = true;
  KVSTREAM_TARGET_AVX512 static void TransposeRows(DType src, const char* const* rows, int n,
                                                   int dims, float* dst, int64_t ldt,
                                                   TilePrefetcher& pf, int pf_from, int pf_to) {
    switch (src) {
      case DType::kBFloat16:
        TransposeRowsAvx512<DType::kBFloat16>(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
        break;
      case DType::kFloat16:
        TransposeRowsAvx512<DType::kFloat16>(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
        break;
      default:
        TransposeRowsAvx512<DType::kFloat32>(rows, n, dims, dst, ldt, pf, pf_from, pf_to);
        break;
    }
  }
};
#endif

}  // namespace cpu_fast
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CPU_FAST_VARIANTS_H_
