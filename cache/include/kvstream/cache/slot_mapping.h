// Slot mapping: where each new token's K and V go in the paged cache.
//
//   slot = block_id * block_size + offset_in_block;  slot == -1 marks a padding token
//
// A sequence's block table row lists its block ids in token order; the token at position p
// lives in block row[p / block_size] at offset p % block_size.
#ifndef KVSTREAM_CACHE_SLOT_MAPPING_H_
#define KVSTREAM_CACHE_SLOT_MAPPING_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvstream {

inline constexpr int64_t kPaddingSlot = -1;

// Slots of positions [first_position, first_position + num_tokens) of a sequence whose
// block table row is `block_ids`. OutOfRange when a position falls past the row's blocks;
// InvalidArgument for a negative position/count, block_size <= 0 or a negative block id.
absl::StatusOr<std::vector<int64_t>> ComputeSlotMapping(absl::Span<const int32_t> block_ids,
                                                        int block_size, int64_t first_position,
                                                        int64_t num_tokens);

// OK when every slot is -1 or in [0, num_blocks * block_size). The error names the first bad
// token index and its slot.
absl::Status ValidateSlotMapping(absl::Span<const int64_t> slots, int64_t num_blocks,
                                 int block_size);

}  // namespace kvstream

#endif  // KVSTREAM_CACHE_SLOT_MAPPING_H_
