// Hopper warpgroup matrix products (wgmma, sm_90a) for the attention kernels: shared-memory
// matrix descriptors for the 128-byte swizzled layouts, the fence / commit / wait steps, and
// m64nNk16 products with 16-bit inputs and f32 accumulators, A from shared memory or from
// registers. Every function is executed by all 128 threads of a warpgroup (4 consecutive
// warps, the first a multiple of 4), converged.
//
// Layouts (16-bit elements; "row" = 128 bytes = 64 elements; an atom = 8 rows = 1024 bytes,
// 1024-byte aligned; the 128-byte swizzle stores 16-byte chunk c of row r at chunk
// c ^ (r % 8) of that row, SwizzledOffset128):
//   K-major (A always; B of S = Q K^T, whose rows are keys): a [rows][64] panel per 64
//     columns of K; rows 8 apart are 1024 bytes apart (the stride byte offset). A product's
//     k16 step is 32 bytes into the row: the descriptor's start address moves by 32 bytes
//     per step, and to the next panel after 4 steps.
//   MN-major (B of O = P V: rows are keys, N = the head dimension contiguous): a [keys][64]
//     panel per 64 columns of N, 8 keys 1024 bytes apart (stride byte offset), the next 64
//     columns of N at the panel stride (leading byte offset); a k16 step is 16 rows: 2048
//     bytes further.
// The accumulators of m64nNk16 (N / 2 floats per thread): for thread t of the warpgroup,
// warp w = t / 32, lane l, element j: row 16 w + l / 4 + 8 ((j / 2) % 2), column
// 8 (j / 4) + 2 (l % 4) + j % 2 (the m16n8 C layout of mma.sync, N / 8 times), and the A
// fragment of m64k16 (4 registers of two 16-bit values) is the same for 16 columns, so
// that a P tile computed in accumulators feeds the next product without shared memory.
//
// Only on sm_90a (the "a" features); elsewhere the products trap, and kernels using them
// must not be launched.
#ifndef KVSTREAM_ATTENTION_CUDA_WGMMA_PTX_CUH_
#define KVSTREAM_ATTENTION_CUDA_WGMMA_PTX_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace kvstream {
namespace internal {
namespace wgmma {

// The byte offset of element (row, col) of a [rows][64] 16-bit panel in the 128-byte
// swizzled layout (the panel 1024-byte aligned).
__host__ __device__ constexpr uint32_t SwizzledOffset128(uint32_t row, uint32_t col) {
  return row * 128 + ((((col >> 3) ^ (row & 7)) << 4) | ((col & 7) << 1));
}

// A shared-memory matrix descriptor for the 128-byte swizzle: start address (a shared
// address), leading and stride byte offsets (multiples of 16 below 2^18).
__device__ __forceinline__ uint64_t Descriptor128(uint32_t start, uint32_t leading_bytes,
                                                  uint32_t stride_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((start & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16;
  desc |= static_cast<uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32;
  desc |= static_cast<uint64_t>(1) << 62;  // 128-byte swizzle
  return desc;
}

// The descriptor of k16 step `k` of a K-major operand whose 64-column panels start at
// `base` (shared address, 1024-byte aligned) and lie `panel_bytes` apart.
__device__ __forceinline__ uint64_t KMajorStep(uint32_t base, uint32_t panel_bytes, int k) {
  return Descriptor128(base + static_cast<uint32_t>(k >> 2) * panel_bytes +
                           static_cast<uint32_t>(k & 3) * 32,
                       16, 1024);
}

// The descriptor of k16 step `k` (rows 16 k .. 16 k + 15) of an MN-major operand whose
// 64-column panels start at `base` and lie `panel_bytes` apart.
__device__ __forceinline__ uint64_t MnMajorStep(uint32_t base, uint32_t panel_bytes, int k) {
  return Descriptor128(base + static_cast<uint32_t>(k) * 2048, panel_bytes, 1024);
}

// Orders the warpgroup's earlier register writes (accumulators, A fragments) before the
// products that follow.
__device__ __forceinline__ void Fence() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
// Makes this thread's generic-proxy shared-memory writes visible to the products' reads
// (then a barrier among the writers).
__device__ __forceinline__ void FenceSharedForAsyncProxy() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Closes the group of products issued since the last commit.
__device__ __forceinline__ void Commit() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most kPending committed groups are still running.
template <int kPending>
__device__ __forceinline__ void Wait() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// Keeps the compiler from moving accesses of the accumulators across a Wait.
template <int N>
__device__ __forceinline__ void FenceOperands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Row and column of accumulator element j of warpgroup thread t.
__host__ __device__ constexpr int AccumulatorRow(int t, int j) {
  return 16 * (t / 32) + (t % 32) / 4 + 8 * ((j / 2) % 2);
}
__host__ __device__ constexpr int AccumulatorCol(int t, int j) {
  return 8 * (j / 4) + 2 * (t % 4) + j % 2;
}

// The A fragment of k16 step `k` from accumulators laid out as above (columns 16 k ..
// 16 k + 15), rounded to T.
template <typename T, int N>
__device__ __forceinline__ void PackA(const float (&d)[N], int k, uint32_t (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = d[8 * k + 2 * i], hi = d[8 * k + 2 * i + 1];
    uint32_t packed;
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      packed = *reinterpret_cast<const uint32_t*>(&v);
    } else {
      const __half2 v = __floats2half2_rn(lo, hi);
      packed = *reinterpret_cast<const uint32_t*>(&v);
    }
    a[i] = packed;
  }
}

// D (+)= A B, m64n64k16, A and B from shared memory (descriptors), f32 accumulators:
// 32 per thread in the layout of WgmmaAccumulatorRow / WgmmaAccumulatorCol.
// accumulate false: D = A B.
template <typename T>
__device__ __forceinline__ void WgmmaSS_m64n64k16(float (&d)[32], uint64_t desc_a,
                                                   uint64_t desc_b, bool accumulate) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                "16-bit inputs");
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
  }
#else
  (void)d; (void)desc_a; (void)desc_b; (void)accumulate;
  __trap();
#endif
}

// D (+)= A B, m64n128k16, A from registers (a: the m64k16 fragment, WgmmaPackA), B from
// shared memory; kTransB: B's descriptor is MN-major (its N index contiguous, as V rows).
template <typename T, bool kTransB>
__device__ __forceinline__ void WgmmaRS_m64n128k16(float (&d)[64], const uint32_t (&a)[4],
                                                   uint64_t desc_b, bool accumulate) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                "16-bit inputs");
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)),
          "n"(kTransB ? 1 : 0));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)),
          "n"(kTransB ? 1 : 0));
  }
#else
  (void)d; (void)a; (void)desc_b; (void)accumulate;
  __trap();
#endif
}

}  // namespace wgmma
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_WGMMA_PTX_CUH_
