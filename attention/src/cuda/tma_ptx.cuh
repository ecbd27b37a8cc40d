// The shared-memory barriers (mbarrier) and Tensor Memory Accelerator copies (sm_90) of the
// TMA-fed attention kernels: a barrier counts arrivals and, with expect_tx, the bytes of the
// asynchronous copies that complete on it; a phase completes when both reach zero, and
// waits name the phase by its parity. Addresses are shared-memory addresses (SmemAddress).
#ifndef KVSTREAM_ATTENTION_CUDA_TMA_PTX_CUH_
#define KVSTREAM_ATTENTION_CUDA_TMA_PTX_CUH_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kvstream {
namespace internal {
namespace tma_ptx {

__device__ __forceinline__ void BarrierInit(uint32_t bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// One arrival that also tells the barrier to expect `bytes` from asynchronous copies.
__device__ __forceinline__ void BarrierArriveExpect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void BarrierArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void BarrierWait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
}
// A 5-D tensor-map box into shared memory, completing on `bar`, with an L2 cache policy
// (createpolicy), e.g. evict-first for rows read once.
__device__ __forceinline__ void TmaLoad5(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                         int c0, int c1, int c2, int c3, int c4,
                                         uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%3, %4, %5, %6, %7}], [%2], %8;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(c4), "l"(policy)
      : "memory");
}
// The same with the default L2 policy (rows that other CTAs read again).
__device__ __forceinline__ void TmaLoad5(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                         int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(c4)
      : "memory");
}
// The same box into shared memory at `dst` of every CTA of the cluster whose bit is set in
// `cta_mask`, completing on the barrier at `bar` of each of them (the same offsets in each).
__device__ __forceinline__ void TmaLoad5Multicast(uint32_t dst, const CUtensorMap* map,
                                                  uint32_t bar, uint16_t cta_mask, int c0,
                                                  int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%4, %5, %6, %7, %8}], [%2], %3;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "h"(cta_mask), "r"(c0), "r"(c1), "r"(c2),
      "r"(c3), "r"(c4)
      : "memory");
}
// One arrival on the barrier at `bar` of the cluster's CTA `cta` (this CTA's offset of it).
__device__ __forceinline__ void BarrierArriveCluster(uint32_t bar, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t ClusterCtaRank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}
// Every thread of every CTA of the cluster: returns once all have arrived (their earlier
// memory operations visible cluster-wide).
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
}
// Makes barrier initialisations visible to the asynchronous proxy (TMA completions) before
// the barrier that follows them.
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

}  // namespace tma_ptx
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_TMA_PTX_CUH_
