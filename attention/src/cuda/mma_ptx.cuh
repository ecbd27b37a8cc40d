// The PTX pieces the tensor-core attention kernels share (prefill_attention.cuh,
// decode_tc_attention.cuh): shared-memory addresses, cp.async, ldmatrix, m16n8k16 mma.sync,
// ex2, packing of 16-bit pairs and fp8 pairs, the swizzled tile layout, page-table row
// offsets.
//
// A host build that defines KVSTREAM_CUDA_EMULATION provides the PTX wrappers (and the
// KVSTREAM_CUDA_UNROLL / KVSTREAM_CUDA_SHARED_MEMORY macros) itself, in this namespace,
// so that the kernels run unchanged under the warp emulator on a CPU
// (tests/gpu/warp_emulator.h); the rest of this file is plain enough for a host compiler.
#ifndef KVSTREAM_ATTENTION_CUDA_MMA_PTX_CUH_
#define KVSTREAM_ATTENTION_CUDA_MMA_PTX_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvstream {
namespace internal {
namespace ptx {

#if !defined(KVSTREAM_CUDA_EMULATION)
#define KVSTREAM_CUDA_UNROLL _Pragma("unroll")
#define KVSTREAM_CUDA_SHARED_MEMORY(name) extern __shared__ __align__(128) uint8_t name[]

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16-byte global -> shared copy; `valid` false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
// CpAsync16 with an L2 evict-first policy (as ld.global.cs), for rows read once: the
// decode kernel's K and V, so that they do not push out of L2 what is read again (H200,
// two A/B passes: 64 x 4096 0.970-0.974 -> 0.976 of the streaming read, 16 x 32768
// unchanged). Not for prefill, whose CTAs read the same K and V tiles in turn.
__device__ __forceinline__ void CpAsync16EvictFirst(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  uint64_t policy;  // one instruction, the same value for every call: hoisted
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst),
               "l"(src), "r"(src_bytes), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CpAsyncWaitGroup() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
// c += a * b for one m16n8k16 tile.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
// The transpose of an 8x8 matrix of 16-bit values held as an mma fragment: lane l holds
// row l / 4, columns 2 (l % 4) and +1 of x, and receives the same places of x^T.
__device__ __forceinline__ uint32_t MovMatrixTrans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
#endif  // !defined(KVSTREAM_CUDA_EMULATION)

template <typename Pair>
__device__ __forceinline__ uint32_t PairBits(const Pair& v) {
  static_assert(sizeof(Pair) == 4, "a pair of 16-bit values");
  uint32_t bits;
  memcpy(&bits, &v, 4);
  return bits;
}

// Two floats as a packed pair of T (the first in the low half, as mma fragments expect).
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return PairBits(__floats2bfloat162_rn(lo, hi));
  } else {
    return PairBits(__floats2half2_rn(lo, hi));
  }
}

// Two fp8 codes (the first in the low byte) as a packed pair of T; exact.
template <typename T, __nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint32_t Fp8PairTo(uint32_t two_codes) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_codes), kFormat);
  if constexpr (std::is_same_v<T, __half>) {
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
  } else {
    return PairBits(__float22bfloat162_rn(__half22float2(__half2(h))));
  }
}

// One 16-byte chunk of 16 fp8 codes (e4m3 when `e4m3`, else e5m2) as 16 values of T:
// out[0..3] and out[4..7] are the two 16-byte chunks they fill; exact.
template <typename T>
__device__ __forceinline__ void Fp8ChunkTo(uint4 codes, bool e4m3, uint32_t (&out)[8]) {
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
  if (e4m3) {
KVSTREAM_CUDA_UNROLL
    for (int w = 0; w < 4; ++w) {
      out[2 * w] = Fp8PairTo<T, __NV_E4M3>(words[w] & 0xffffu);
      out[2 * w + 1] = Fp8PairTo<T, __NV_E4M3>(words[w] >> 16);
    }
  } else {
KVSTREAM_CUDA_UNROLL
    for (int w = 0; w < 4; ++w) {
      out[2 * w] = Fp8PairTo<T, __NV_E5M2>(words[w] & 0xffffu);
      out[2 * w + 1] = Fp8PairTo<T, __NV_E5M2>(words[w] >> 16);
    }
  }
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][D] 16-bit tile.
template <int D>
__device__ __forceinline__ uint32_t SwizzledChunk(int row, int chunk) {
  return static_cast<uint32_t>(row * (D * 2) + ((chunk ^ (row & 7)) << 4));
}

// log2(x) when x is a power of two, else -1: the page-table lookups shift instead of
// dividing by block sizes that are powers of two (all common ones). Once per thread (or
// once per launch on the host).
__host__ __device__ __forceinline__ int Log2IfPowerOfTwo(int x) {
  int shift = -1;
  for (int s = 0; s < 31; ++s) {
    if ((1 << s) == x) shift = s;
  }
  return shift;
}

// Where one key row of a paged tile lives: the element offsets of its K and V data from
// k_cache / v_cache (block, offset in block and KV head folded in), looked up from the page
// table once per row so that the copies of its chunks need no index arithmetic. k < 0: a
// row with nothing to load (past the keys, or a block id outside the cache), whose copies
// write zeros.
struct alignas(16) RowOffsets {
  int64_t k;
  int64_t v;
};

}  // namespace ptx
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_MMA_PTX_CUH_
