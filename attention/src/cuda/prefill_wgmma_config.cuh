// How a launch of the wgmma prefill kernel (prefill_wgmma.cuh) is configured: its consumer
// schedules (PrefillWgmmaSchedule), the runtime values of one call (PrefillWgmmaArgs) and
// the compile-time tile shape, shared-memory layout and register split (PrefillWgmmaTraits).
// Plain C++, used by the launcher (prefill_wgmma.cu) and the kernel alike.
#ifndef KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_CONFIG_CUH_
#define KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_CONFIG_CUH_

#include <cstdint>

namespace kvstream {
namespace internal {
namespace prefill_wgmma {

// How a consumer orders its products and its softmax (PrefillWgmmaArgs::schedule).
enum PrefillWgmmaSchedule : int {
  kPrefillWgmmaSerial = 0,    // per tile: S, softmax, P V, each waited for
  kPrefillWgmmaOverlap = 1,   // S of tile n and P V of tile n - 1 in flight together
  kPrefillWgmmaPingPong = 2,  // kPrefillWgmmaOverlap, the consumers issuing in turns
};

// Runtime values the launcher computes once per call.
struct PrefillWgmmaArgs {
  int32_t schedule;     // PrefillWgmmaSchedule
  int32_t num_m_tiles;  // ceil(max_query_len * group / kBlockM)
  int32_t box_tokens;   // keys per TMA box: min(block_size, kBlockN)
  int32_t block_shift;  // log2(block_size)
  int32_t e4m3;         // fp8 caches: e4m3 (else e5m2)
  int32_t heads_outer;  // the grid's order: KV heads outer (else inner; PrefillWgmmaOrder)
  int32_t persistent;   // CTAs that take unit after unit (else one each; PrefillWgmmaGrid)
};

// kPair: the layout of a CTA of a pair (PrefillWgmmaCluster::kPair), whose ring is deeper
// where shared memory allows: a slot there is refilled only after both CTAs released it,
// one arrival crossing between SMs.
template <int D, bool kFp8 = false, bool kPair = false>
struct PrefillWgmmaTraits {
  static_assert(D == 64 || D == 128 || D == 256, "head sizes 64, 128 and 256");
  static constexpr int kBlockM = 128;  // packed rows per CTA (two consumers x 64)
  // Keys per tile: at D = 256 the output's 128 accumulators per thread leave room for
  // 64-key score tiles only.
  static constexpr int kBlockN = D == 256 ? 64 : 128;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = (kConsumers + 1) * 128;
  static constexpr int kPanels = D / 64;
  static constexpr int kPanelRows = 64;                          // q panels
  static constexpr int kQPanelBytes = kPanelRows * 128;          // 8 KiB
  static constexpr int kKvPanelBytes = kBlockN * 128;            // 16 KiB
  static constexpr int kQWarpgroupBytes = kPanels * kQPanelBytes;
  static constexpr int kTileBytes = kPanels * kKvPanelBytes;     // one K or V tile
  // Two K and V tiles in flight (three measured no faster on the H200, docs/benchmarks.md);
  // pairs of 16-bit caches at head sizes 64 and 128, three.
  static constexpr int kStages = kPair && !kFp8 && D <= 128 ? 3 : 2;
  // fp8 caches: the ring holds raw [kBlockN][D] byte tiles (what TMA copies), converted
  // into two alternating 16-bit K and V tiles (kConverted) that the products read.
  static_assert(!kFp8 || D <= 128, "fp8 caches: head sizes 64 and 128");
  static constexpr int kRawTileBytes = kBlockN * D;
  static constexpr int kRingTileBytes = kFp8 ? kRawTileBytes : kTileBytes;
  static constexpr int kConverted = kFp8 ? 2 : 0;
  static constexpr int kKOffset = kConsumers * kQWarpgroupBytes;
  static constexpr int kVOffset = kKOffset + kStages * kRingTileBytes;
  static constexpr int kConvKOffset = kVOffset + kStages * kRingTileBytes;
  static constexpr int kConvVOffset = kConvKOffset + kConverted * kTileBytes;
  static constexpr int kBarrierOffset = kConvVOffset + kConverted * kTileBytes;
  // + 1024: the dynamic shared memory base is aligned up to 1024 bytes inside the kernel.
  static constexpr int kSmemBytes = kBarrierOffset + 4 * kStages * 8 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "an H100/H200 CTA has at most 227 KiB of shared memory");
  // 128 x 40 + 256 x 232 = 64512 of the SM's 65536 registers.
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
};

}  // namespace prefill_wgmma
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_CONFIG_CUH_
