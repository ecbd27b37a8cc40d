// Layer runs and their host checksum (layer_runs.h).
#include "layer_runs.h"

#include <xxhash.h>

#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {

absl::StatusOr<LayerRuns> PlanLayerRuns(const KvCacheView& cv,
                                        absl::Span<const int32_t> src_blocks,
                                        absl::Span<const int32_t> dst_blocks, int64_t num_tokens) {
  const size_t es = DTypeSize(cv.spec.dtype);
  LayerRuns runs;
  ASSIGN_OR_RETURN(runs.k, PlanBlockCopy(cv.k_strides, cv.spec.block_size, cv.spec.num_kv_heads,
                                         cv.spec.head_size, es, src_blocks, dst_blocks,
                                         num_tokens));
  ASSIGN_OR_RETURN(runs.v, PlanBlockCopy(cv.v_strides, cv.spec.block_size, cv.spec.num_kv_heads,
                                         cv.spec.head_size_v, es, src_blocks, dst_blocks,
                                         num_tokens));
  for (const ByteRun& r : runs.k) runs.bytes += r.length;
  for (const ByteRun& r : runs.v) runs.bytes += r.length;
  return runs;
}

uint64_t HostLayerChecksum(const KvCacheView& cv, const LayerRuns& runs, bool destination) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (const ByteRun& r : runs.k) {
    XXH3_64bits_update(state,
                       static_cast<const char*>(cv.k) + (destination ? r.dst_offset : r.src_offset),
                       r.length);
  }
  for (const ByteRun& r : runs.v) {
    XXH3_64bits_update(state,
                       static_cast<const char*>(cv.v) + (destination ? r.dst_offset : r.src_offset),
                       r.length);
  }
  const uint64_t sum = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return sum;
}

std::vector<ChecksumSpan> LayerSpans(const KvCacheView& cv, const LayerRuns& runs,
                                     bool destination) {
  std::vector<ChecksumSpan> spans;
  spans.reserve(runs.k.size() + runs.v.size());
  for (const ByteRun& r : runs.k) {
    spans.push_back({static_cast<const char*>(cv.k) + (destination ? r.dst_offset : r.src_offset),
                     r.length});
  }
  for (const ByteRun& r : runs.v) {
    spans.push_back({static_cast<const char*>(cv.v) + (destination ? r.dst_offset : r.src_offset),
                     r.length});
  }
  return spans;
}

}  // namespace internal
}  // namespace kvstream
