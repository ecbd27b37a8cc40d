// Which bytes carry a request's first `num_tokens` tokens of one layer, as runs of
// (source offset, destination offset, length) between two caches of the same layout:
// tokens of block i go from src_blocks[i] to dst_blocks[i]. Rows of one head are emitted in
// address order and merged while both sides stay contiguous, so a dense layout yields one
// run per full block and one per run of consecutive block ids on both sides.
#ifndef KVSTREAM_CONNECTOR_BLOCK_COPY_PLAN_H_
#define KVSTREAM_CONNECTOR_BLOCK_COPY_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvstream/cache/kv_cache_spec.h"

namespace kvstream {

struct ByteRun {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
};

// Runs for one tensor (K or V: `strides` and `head_size` of that tensor; `element_bytes`
// its element size). OutOfRange when num_tokens needs more blocks than either list has;
// InvalidArgument for negative ids or sizes.
absl::StatusOr<std::vector<ByteRun>> PlanBlockCopy(const CacheStrides& strides, int block_size,
                                                   int num_kv_heads, int head_size,
                                                   size_t element_bytes,
                                                   absl::Span<const int32_t> src_blocks,
                                                   absl::Span<const int32_t> dst_blocks,
                                                   int64_t num_tokens);

// Bytes spanned by a tensor of `num_blocks` blocks with these strides (its extent).
uint64_t TensorExtentBytes(const CacheStrides& strides, int64_t num_blocks, int block_size,
                           int num_kv_heads, int head_size, size_t element_bytes);

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_BLOCK_COPY_PLAN_H_
