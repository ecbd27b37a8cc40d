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
__host__ __device__ __forceinline__ uint64_t Descriptor128(uint32_t start, uint32_t leading_bytes,
                                                           uint32_t stride_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((start & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16;
  desc |= static_cast<uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32;
  desc |= static_cast<uint64_t>(1) << 62;  // 128-byte swizzle
  return desc;
}

// The byte offset of k16 step `k` of a K-major operand whose 64-column panels lie
// `panel_bytes` apart: 32 bytes a step within a panel, the next panel after 4 steps.
__host__ __device__ constexpr uint32_t KMajorStepBytes(uint32_t panel_bytes, int k) {
  return static_cast<uint32_t>(k >> 2) * panel_bytes + static_cast<uint32_t>(k & 3) * 32;
}
// The byte offset of k16 step `k` (rows 16 k .. 16 k + 15) of an MN-major operand.
__host__ __device__ constexpr uint32_t MnMajorStepBytes(int k) {
  return static_cast<uint32_t>(k) * 2048;
}

// The descriptor of k16 step 0 of a K-major operand whose 64-column panels start at `base`
// (shared address, 1024-byte aligned); DescriptorPlus(it, KMajorStepBytes(...)) is step k.
__host__ __device__ __forceinline__ uint64_t KMajorDescriptor(uint32_t base) {
  return Descriptor128(base, 16, 1024);
}
// The descriptor of k16 step 0 of an MN-major operand whose 64-column panels start at
// `base` and lie `panel_bytes` apart; DescriptorPlus(it, MnMajorStepBytes(k)) is step k.
__host__ __device__ __forceinline__ uint64_t MnMajorDescriptor(uint32_t base,
                                                               uint32_t panel_bytes) {
  return Descriptor128(base, panel_bytes, 1024);
}

// `desc` with its start address `bytes` further (a multiple of 16, the result still a
// shared address below 256 KiB, as every shared address of a CTA is): the start-address
// field (bits 0-13) holds the address / 16, so the sum stays inside it and only the low word
// changes; one integer add where the step is a constant, instead of rebuilding every field.
__host__ __device__ __forceinline__ uint64_t DescriptorPlus(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// The descriptor of k16 step `k` of a K-major operand whose 64-column panels start at
// `base` (shared address, 1024-byte aligned) and lie `panel_bytes` apart.
__host__ __device__ __forceinline__ uint64_t KMajorStep(uint32_t base, uint32_t panel_bytes,
                                                        int k) {
  return Descriptor128(base + KMajorStepBytes(panel_bytes, k), 16, 1024);
}

// The descriptor of k16 step `k` (rows 16 k .. 16 k + 15) of an MN-major operand whose
// 64-column panels start at `base` and lie `panel_bytes` apart.
__host__ __device__ __forceinline__ uint64_t MnMajorStep(uint32_t base, uint32_t panel_bytes,
                                                         int k) {
  return Descriptor128(base + MnMajorStepBytes(k), panel_bytes, 1024);
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
// The same for A fragments in registers: keeps them (and their registers) alive until the
// products reading them are waited for.
template <int N>
__device__ __forceinline__ void FenceOperands(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
  }
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

// Register and operand lists of the products below (N / 2 accumulators per thread).
#define KVSTREAM_WGMMA_F8(d, i)                                                         \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),           \
      "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define KVSTREAM_WGMMA_D32(d) \
  KVSTREAM_WGMMA_F8(d, 0), KVSTREAM_WGMMA_F8(d, 8), KVSTREAM_WGMMA_F8(d, 16), KVSTREAM_WGMMA_F8(d, 24)
#define KVSTREAM_WGMMA_D64(d)                                                              \
  KVSTREAM_WGMMA_D32(d), KVSTREAM_WGMMA_F8(d, 32), KVSTREAM_WGMMA_F8(d, 40),               \
      KVSTREAM_WGMMA_F8(d, 48), KVSTREAM_WGMMA_F8(d, 56)
#define KVSTREAM_WGMMA_D128(d)                                                             \
  KVSTREAM_WGMMA_D64(d), KVSTREAM_WGMMA_F8(d, 64), KVSTREAM_WGMMA_F8(d, 72),               \
      KVSTREAM_WGMMA_F8(d, 80), KVSTREAM_WGMMA_F8(d, 88), KVSTREAM_WGMMA_F8(d, 96),        \
      KVSTREAM_WGMMA_F8(d, 104), KVSTREAM_WGMMA_F8(d, 112), KVSTREAM_WGMMA_F8(d, 120)
// One product: SHAPE "m64nNk16", TYPES ".bf16.bf16" or ".f16.f16", REGS the accumulator
// list, A "%i" (a descriptor) or "{%i, ...}" (registers), the rest of the operand numbers.
#define KVSTREAM_WGMMA_ASM(SHAPE, TYPES, REGS, A, B, P, TAIL, DOPS, ...)                      \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, " P ", 0;\n"                              \
               " wgmma.mma_async.sync.aligned." SHAPE ".f32" TYPES " " REGS ", " A ", " B     \
               ", p, 1, 1" TAIL ";\n}\n"                                                     \
               : DOPS                                                                       \
               : __VA_ARGS__)

template <typename T>
constexpr bool kIsBf16 = std::is_same<T, __nv_bfloat16>::value;

// D (+)= A B, m64nNk16 (N 64 or 128), A and B from shared memory (descriptors), f32
// accumulators: N / 2 per thread in the layout of AccumulatorRow / AccumulatorCol.
// accumulate false: D = A B.
template <int N, typename T>
__device__ __forceinline__ void WgmmaSS(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                        bool accumulate) {
  static_assert(N == 64 || N == 128, "N 64 or 128");
  static_assert(kIsBf16<T> || std::is_same<T, __half>::value, "16-bit inputs");
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int acc = static_cast<int>(accumulate);
  if constexpr (N == 64 && kIsBf16<T>) {
    KVSTREAM_WGMMA_ASM("m64n64k16", ".bf16.bf16", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}", "%32", "%33", "%34", ", 0, 0",
                       KVSTREAM_WGMMA_D32(d), "l"(desc_a), "l"(desc_b), "r"(acc));
  } else if constexpr (N == 64) {
    KVSTREAM_WGMMA_ASM("m64n64k16", ".f16.f16", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}", "%32", "%33", "%34", ", 0, 0",
                       KVSTREAM_WGMMA_D32(d), "l"(desc_a), "l"(desc_b), "r"(acc));
  } else if constexpr (kIsBf16<T>) {
    KVSTREAM_WGMMA_ASM("m64n128k16", ".bf16.bf16", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}", "%64", "%65", "%66", ", 0, 0",
                       KVSTREAM_WGMMA_D64(d), "l"(desc_a), "l"(desc_b), "r"(acc));
  } else {
    KVSTREAM_WGMMA_ASM("m64n128k16", ".f16.f16", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}", "%64", "%65", "%66", ", 0, 0",
                       KVSTREAM_WGMMA_D64(d), "l"(desc_a), "l"(desc_b), "r"(acc));
  }
#else
  (void)d; (void)desc_a; (void)desc_b; (void)accumulate;
  __trap();
#endif
}

// D (+)= A B, m64nNk16 (N 64, 128 or 256), A from registers (a: the m64k16 fragment,
// PackA), B from shared memory; kTransB: B's descriptor is MN-major (its N index
// contiguous, as V rows).
template <int N, typename T, bool kTransB>
__device__ __forceinline__ void WgmmaRS(float (&d)[N / 2], const uint32_t (&a)[4],
                                        uint64_t desc_b, bool accumulate) {
  static_assert(N == 64 || N == 128 || N == 256, "N 64, 128 or 256");
  static_assert(kIsBf16<T> || std::is_same<T, __half>::value, "16-bit inputs");
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int acc = static_cast<int>(accumulate);
  constexpr int kTrans = kTransB ? 1 : 0;
  if constexpr (N == 64 && kIsBf16<T>) {
    KVSTREAM_WGMMA_ASM("m64n64k16", ".bf16.bf16", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}", "{%32, %33, %34, %35}", "%36", "%37",
                       ", %38", KVSTREAM_WGMMA_D32(d), "r"(a[0]), "r"(a[1]), "r"(a[2]),
                       "r"(a[3]), "l"(desc_b), "r"(acc), "n"(kTrans));
  } else if constexpr (N == 64) {
    KVSTREAM_WGMMA_ASM("m64n64k16", ".f16.f16", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}", "{%32, %33, %34, %35}", "%36", "%37",
                       ", %38", KVSTREAM_WGMMA_D32(d), "r"(a[0]), "r"(a[1]), "r"(a[2]),
                       "r"(a[3]), "l"(desc_b), "r"(acc), "n"(kTrans));
  } else if constexpr (N == 256 && kIsBf16<T>) {
    KVSTREAM_WGMMA_ASM("m64n256k16", ".bf16.bf16", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}", "{%128, %129, %130, %131}", "%132",
                       "%133", ", %134", KVSTREAM_WGMMA_D128(d), "r"(a[0]), "r"(a[1]), "r"(a[2]),
                       "r"(a[3]), "l"(desc_b), "r"(acc), "n"(kTrans));
  } else if constexpr (N == 256) {
    KVSTREAM_WGMMA_ASM("m64n256k16", ".f16.f16", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}", "{%128, %129, %130, %131}", "%132",
                       "%133", ", %134", KVSTREAM_WGMMA_D128(d), "r"(a[0]), "r"(a[1]), "r"(a[2]),
                       "r"(a[3]), "l"(desc_b), "r"(acc), "n"(kTrans));
  } else if constexpr (kIsBf16<T>) {
    KVSTREAM_WGMMA_ASM("m64n128k16", ".bf16.bf16", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}", "{%64, %65, %66, %67}", "%68", "%69",
                       ", %70", KVSTREAM_WGMMA_D64(d), "r"(a[0]), "r"(a[1]), "r"(a[2]),
                       "r"(a[3]), "l"(desc_b), "r"(acc), "n"(kTrans));
  } else {
    KVSTREAM_WGMMA_ASM("m64n128k16", ".f16.f16", "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}", "{%64, %65, %66, %67}", "%68", "%69",
                       ", %70", KVSTREAM_WGMMA_D64(d), "r"(a[0]), "r"(a[1]), "r"(a[2]),
                       "r"(a[3]), "l"(desc_b), "r"(acc), "n"(kTrans));
  }
#else
  (void)d; (void)a; (void)desc_b; (void)accumulate;
  __trap();
#endif
}

#undef KVSTREAM_WGMMA_ASM
#undef KVSTREAM_WGMMA_D128
#undef KVSTREAM_WGMMA_D64
#undef KVSTREAM_WGMMA_D32
#undef KVSTREAM_WGMMA_F8

// Raises (kInc) or lowers the registers each thread of the calling warpgroup may use to
// `kRegs` (a multiple of 8 in [24, 256]); every warp of the warpgroup executes it.
template <int kRegs, bool kInc>
__device__ __forceinline__ void SetMaxRegisters() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kInc) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
  }
#endif
}

// A barrier of `threads` threads (a multiple of 32) on hardware barrier `id` (1..15; 0 is
// __syncthreads').
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives at barrier `id` of `threads` threads without waiting (the others NamedBarrierSync).
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace wgmma
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_WGMMA_PTX_CUH_
