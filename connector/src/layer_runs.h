// The bytes of one request's layer: the K runs and V runs that carry its first num_tokens
// tokens between the producer's blocks and the consumer's (block_copy_plan.h), and the
// layer's host checksum over one side of them.
#ifndef KVSTREAM_CONNECTOR_SRC_LAYER_RUNS_H_
#define KVSTREAM_CONNECTOR_SRC_LAYER_RUNS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/cache/layer_checksum.h"
#include "kvstream/connector/block_copy_plan.h"

namespace kvstream {
namespace internal {

struct LayerRuns {
  std::vector<ByteRun> k;
  std::vector<ByteRun> v;
  uint64_t bytes = 0;  // K and V together
};

// Runs from `src_blocks` to `dst_blocks` of a cache laid out as `view` (both sides share the
// layout: the compatibility hash says so). Errors as PlanBlockCopy.
absl::StatusOr<LayerRuns> PlanLayerRuns(const KvCacheView& view,
                                        absl::Span<const int32_t> src_blocks,
                                        absl::Span<const int32_t> dst_blocks, int64_t num_tokens);

// XXH3-64 of the runs' bytes, K runs then V runs, read at their source offsets
// (`destination` false) or destination offsets (true) in `view`'s host memory.
uint64_t HostLayerChecksum(const KvCacheView& view, const LayerRuns& runs, bool destination);

// The runs as kvsum64 spans (cache/layer_checksum.h) of `view`'s memory, K then V, at their
// source or destination offsets.
std::vector<ChecksumSpan> LayerSpans(const KvCacheView& view, const LayerRuns& runs,
                                     bool destination);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_SRC_LAYER_RUNS_H_
