// Slot mapping: block table row -> per-token cache slots, and the range check every cache
// update runs before it writes.
#include "kvstream/cache/slot_mapping.h"

#include "absl/strings/str_cat.h"

namespace kvstream {

absl::StatusOr<std::vector<int64_t>> ComputeSlotMapping(absl::Span<const int32_t> block_ids,
                                                        int block_size, int64_t first_position,
                                                        int64_t num_tokens) {
  if (block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("slot mapping: block_size must be positive, got ", block_size));
  }
  if (first_position < 0 || num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("slot mapping: negative first_position (", first_position,
                     ") or num_tokens (", num_tokens, ")"));
  }
  if (num_tokens == 0) return std::vector<int64_t>();
  const int64_t last_position = first_position + num_tokens - 1;
  const int64_t blocks_needed = last_position / block_size + 1;
  if (blocks_needed > static_cast<int64_t>(block_ids.size())) {
    return absl::OutOfRangeError(absl::StrCat(
        "slot mapping: position ", last_position, " needs ", blocks_needed, " blocks of ",
        block_size, " tokens but the block table row has ", block_ids.size()));
  }
  for (int64_t i = first_position / block_size; i < blocks_needed; ++i) {
    if (block_ids[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("slot mapping: block table entry ", i,
                                                     " is a negative block id ", block_ids[i]));
    }
  }
  std::vector<int64_t> slots(num_tokens);
  for (int64_t i = 0; i < num_tokens; ++i) {
    const int64_t p = first_position + i;
    slots[i] = int64_t{block_ids[p / block_size]} * block_size + p % block_size;
  }
  return slots;
}

absl::Status ValidateSlotMapping(absl::Span<const int64_t> slots, int64_t num_blocks,
                                 int block_size) {
  if (block_size <= 0 || num_blocks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("slot mapping: bad cache size (num_blocks ", num_blocks, ", block_size ",
                     block_size, ")"));
  }
  const int64_t num_slots = num_blocks * block_size;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t s = slots[i];
    if (s == kPaddingSlot || (s >= 0 && s < num_slots)) continue;
    return absl::InvalidArgumentError(
        absl::StrCat("slot mapping: token ", i, " has slot ", s, ", expected ", kPaddingSlot,
                     " (padding) or a slot in [0, ", num_slots, ")"));
  }
  return absl::OkStatus();
}

}  // namespace kvstream
