// Byte runs of a block copy between caches of one layout (block_copy_plan.h).
#include "kvstream/connector/block_copy_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvstream/common/int_math.h"

namespace kvstream {

uint64_t TensorExtentBytes(const CacheStrides& s, int64_t num_blocks, int block_size,
                           int num_kv_heads, int head_size, size_t element_bytes) {
  if (num_blocks <= 0) return 0;
  const int64_t last = (num_blocks - 1) * s.block + (block_size - 1) * s.token +
                       (num_kv_heads - 1) * s.head + (head_size - 1) * s.dim;
  return static_cast<uint64_t>(last + 1) * element_bytes;
}

absl::StatusOr<std::vector<ByteRun>> PlanBlockCopy(const CacheStrides& s, int block_size,
                                                   int num_kv_heads, int head_size,
                                                   size_t element_bytes,
                                                   absl::Span<const int32_t> src_blocks,
                                                   absl::Span<const int32_t> dst_blocks,
                                                   int64_t num_tokens) {
  if (block_size <= 0 || num_kv_heads <= 0 || head_size <= 0 || num_tokens < 0 ||
      s.dim != 1) {
    return absl::InvalidArgumentError("block copy plan: bad sizes or a non-unit dim stride");
  }
  const int64_t blocks = CeilDiv(num_tokens, block_size);
  if (blocks > static_cast<int64_t>(src_blocks.size()) ||
      blocks > static_cast<int64_t>(dst_blocks.size())) {
    return absl::OutOfRangeError(absl::StrCat("block copy plan: ", num_tokens, " tokens need ",
                                              blocks, " blocks; source has ", src_blocks.size(),
                                              ", destination ", dst_blocks.size()));
  }
  const uint64_t row = static_cast<uint64_t>(head_size) * element_bytes;
  // Visit rows in address order within a block: the order of the two inner strides.
  const bool token_major = s.token >= s.head;
  std::vector<ByteRun> runs;
  auto emit = [&](uint64_t src, uint64_t dst, uint64_t length) {
    if (!runs.empty()) {
      ByteRun& last = runs.back();
      if (last.src_offset + last.length == src && last.dst_offset + last.length == dst) {
        last.length += length;
        return;
      }
    }
    runs.push_back({src, dst, length});
  };
  // Dense blocks (the rows of a block tile it in address order without gaps, as in every
  // cache kvstream allocates): a block's rows in visiting order form runs of many rows at
  // once, so the plan costs a few steps per block rather than one per token and head (a
  // layer of 8k tokens has 65536 rows).
  const bool dense =
      token_major ? (s.head == head_size && s.token == static_cast<int64_t>(num_kv_heads) * head_size)
                  : (s.token == head_size && s.head == static_cast<int64_t>(block_size) * head_size);
  for (int64_t i = 0; i < blocks; ++i) {
    if (src_blocks[i] < 0 || dst_blocks[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("block copy plan: negative block id at ", i));
    }
    const int64_t n = std::min<int64_t>(block_size, num_tokens - i * block_size);
    const int64_t sb = src_blocks[i], db = dst_blocks[i];
    if (dense && token_major) {
      // Tokens [0, n) of the block: n * num_kv_heads rows from its start.
      emit(static_cast<uint64_t>(s.Offset(sb, 0, 0, 0)) * element_bytes,
           static_cast<uint64_t>(s.Offset(db, 0, 0, 0)) * element_bytes,
           static_cast<uint64_t>(n) * num_kv_heads * row);
    } else if (dense) {
      // Per head, tokens [0, n): n rows from the head's start in the block.
      for (int h = 0; h < num_kv_heads; ++h) {
        emit(static_cast<uint64_t>(s.Offset(sb, 0, h, 0)) * element_bytes,
             static_cast<uint64_t>(s.Offset(db, 0, h, 0)) * element_bytes,
             static_cast<uint64_t>(n) * row);
      }
    } else if (token_major) {
      for (int64_t t = 0; t < n; ++t) {
        for (int h = 0; h < num_kv_heads; ++h) {
          emit(static_cast<uint64_t>(s.Offset(sb, t, h, 0)) * element_bytes,
               static_cast<uint64_t>(s.Offset(db, t, h, 0)) * element_bytes, row);
        }
      }
    } else {
      for (int h = 0; h < num_kv_heads; ++h) {
        for (int64_t t = 0; t < n; ++t) {
          emit(static_cast<uint64_t>(s.Offset(sb, t, h, 0)) * element_bytes,
               static_cast<uint64_t>(s.Offset(db, t, h, 0)) * element_bytes, row);
        }
      }
    }
  }
  return runs;
}

}  // namespace kvstream
