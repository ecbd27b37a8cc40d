// AttentionMetadata validation and construction from per-sequence schedules.
#include "kvstream/common/int_math.h"
#include "kvstream/attention/metadata.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvstream/cache/slot_mapping.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {


}  // namespace

absl::Status AttentionMetadata::Validate(int block_size, int64_t num_blocks) const {
  if (block_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("attention metadata: block_size ", block_size,
                                                   " must be positive"));
  }
  const int32_t n = num_seqs();
  if (n <= 0) return absl::InvalidArgumentError("attention metadata: the batch has no sequences");
  if (query_start_loc.size() != static_cast<size_t>(n) + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention metadata: query_start_loc has ", query_start_loc.size(),
        " entries, expected num_seqs + 1 = ", n + 1));
  }
  if (query_start_loc[0] != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention metadata: query_start_loc[0] is ", query_start_loc[0], ", expected 0"));
  }
  if (max_blocks_per_seq <= 0 ||
      block_table.size() != static_cast<size_t>(n) * static_cast<size_t>(max_blocks_per_seq)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention metadata: block_table has ", block_table.size(), " entries, expected num_seqs (",
        n, ") x max_blocks_per_seq (", max_blocks_per_seq, ")"));
  }
  int32_t want_max_q = 0, want_max_s = 0;
  for (int32_t i = 0; i < n; ++i) {
    const int32_t q = query_start_loc[i + 1] - query_start_loc[i];
    if (q < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attention metadata: query_start_loc decreases at sequence ", i));
    }
    if (seq_lens[i] < q) {
      return absl::InvalidArgumentError(absl::StrCat("attention metadata: sequence ", i, " has ",
                                                     q, " query tokens but seq_len ", seq_lens[i]));
    }
    const int64_t blocks_needed = CeilDiv(seq_lens[i], block_size);
    if (blocks_needed > max_blocks_per_seq) {
      return absl::OutOfRangeError(absl::StrCat(
          "attention metadata: sequence ", i, " has seq_len ", seq_lens[i], " needing ",
          blocks_needed, " blocks of ", block_size, " but its block table row has ",
          max_blocks_per_seq));
    }
    for (int64_t b = 0; b < blocks_needed; ++b) {
      const int32_t id = block_table[static_cast<size_t>(i) * max_blocks_per_seq + b];
      if (id < 0 || id >= num_blocks) {
        return absl::OutOfRangeError(absl::StrCat("attention metadata: sequence ", i,
                                                  " block table entry ", b, " is block ", id,
                                                  ", outside [0, ", num_blocks, ")"));
      }
    }
    want_max_q = std::max(want_max_q, q);
    want_max_s = std::max(want_max_s, seq_lens[i]);
  }
  const int64_t rows = query_start_loc[n];
  if (num_actual_tokens != rows) {
    return absl::InvalidArgumentError(absl::StrCat("attention metadata: num_actual_tokens is ",
                                                   num_actual_tokens, " but the sequences have ",
                                                   rows, " query tokens"));
  }
  if (max_query_len != want_max_q || max_seq_len != want_max_s) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention metadata: max_query_len/max_seq_len are ", max_query_len, "/", max_seq_len,
        " but the sequences give ", want_max_q, "/", want_max_s));
  }
  return ValidateSlotMapping(slot_mapping, num_blocks, block_size);
}

absl::StatusOr<AttentionMetadata> BuildAttentionMetadata(
    absl::Span<const SequenceSchedule> sequences, int block_size, int num_padding_tokens) {
  if (sequences.empty()) {
    return absl::InvalidArgumentError("attention metadata: the batch has no sequences");
  }
  if (block_size <= 0 || num_padding_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("attention metadata: block_size ", block_size,
                                                   " and padding ", num_padding_tokens,
                                                   " must be positive / non-negative"));
  }
  AttentionMetadata md;
  size_t width = 1;
  for (const SequenceSchedule& s : sequences) width = std::max(width, s.block_ids.size());
  md.max_blocks_per_seq = static_cast<int32_t>(width);
  md.query_start_loc.push_back(0);
  md.block_table.assign(sequences.size() * width, 0);
  for (size_t i = 0; i < sequences.size(); ++i) {
    const SequenceSchedule& s = sequences[i];
    if (s.context_len < 0 || s.query_len < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attention metadata: sequence ", i, " has context_len ", s.context_len,
          " and query_len ", s.query_len, " (need context_len >= 0, query_len >= 1)"));
    }
    const int32_t seq_len = s.context_len + s.query_len;
    ASSIGN_OR_RETURN(std::vector<int64_t> slots,
                     ComputeSlotMapping(s.block_ids, block_size, s.context_len, s.query_len));
    md.slot_mapping.insert(md.slot_mapping.end(), slots.begin(), slots.end());
    std::copy(s.block_ids.begin(), s.block_ids.end(), md.block_table.begin() + i * width);
    md.query_start_loc.push_back(md.query_start_loc.back() + s.query_len);
    md.seq_lens.push_back(seq_len);
    md.max_query_len = std::max(md.max_query_len, s.query_len);
    md.max_seq_len = std::max(md.max_seq_len, seq_len);
  }
  md.num_actual_tokens = md.query_start_loc.back();
  md.slot_mapping.insert(md.slot_mapping.end(), num_padding_tokens, kPaddingSlot);
  return md;
}

}  // namespace kvstream
