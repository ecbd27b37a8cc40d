// AttentionMetadata: one forward step's batch, as the attention backends and the transfer
// hook see it. A batch mixes sequences in three states, each described the same way:
//
//   prefill          context_len == 0,  query_len == prompt length
//   chunked prefill  context_len  > 0,  query_len  > 1   (new tokens after a cached prefix)
//   decode           context_len  > 0,  query_len == 1
//
// where seq_len = context_len + query_len. Query token j of sequence i sits at position
// context_len + j; causal masking is bottom-right aligned (a query sees keys at positions
// <= its own).
//
//   ASSIGN_OR_RETURN(AttentionMetadata md, BuildAttentionMetadata(
//       {{/*context_len=*/0, /*query_len=*/7, /*block_ids=*/{3}},
//        {/*context_len=*/40, /*query_len=*/1, /*block_ids=*/{0, 5, 9}}}, /*block_size=*/16));
#ifndef KVSTREAM_ATTENTION_METADATA_H_
#define KVSTREAM_ATTENTION_METADATA_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvstream {

struct AttentionMetadata {
  // [num_seqs + 1]: sequence i's query tokens are rows [query_start_loc[i], query_start_loc[i+1]).
  std::vector<int32_t> query_start_loc;
  // [num_seqs]: keys each sequence attends to (cached context plus this step's tokens).
  std::vector<int32_t> seq_lens;
  // [num_seqs, max_blocks_per_seq], row-major: block ids in token order; unused entries 0.
  std::vector<int32_t> block_table;
  int32_t max_blocks_per_seq = 0;
  // [num key tokens of this step]: the slot of each new key/value token, -1 for padding.
  std::vector<int64_t> slot_mapping;
  // Query rows that belong to sequences; rows past this (padding) are not attended.
  int64_t num_actual_tokens = 0;
  int32_t max_query_len = 0;
  int32_t max_seq_len = 0;

  int32_t num_seqs() const { return static_cast<int32_t>(seq_lens.size()); }
  int32_t query_len(int32_t seq) const {
    return query_start_loc[seq + 1] - query_start_loc[seq];
  }
  absl::Span<const int32_t> block_row(int32_t seq) const {
    return absl::MakeConstSpan(block_table).subspan(
        static_cast<size_t>(seq) * static_cast<size_t>(max_blocks_per_seq),
        static_cast<size_t>(max_blocks_per_seq));
  }

  // Checks internal consistency (sizes, monotone query_start_loc, query_len <= seq_len,
  // enough blocks per row for seq_len, the max fields) and that every block id that a
  // sequence uses is in [0, num_blocks) and every slot is -1 or inside the cache. The error
  // names the sequence, token or block at fault.
  absl::Status Validate(int block_size, int64_t num_blocks) const;
};

// Device copies of a step's metadata arrays, for layers whose cache is in device memory
// (the "cuda" backend). The engine uploads them once per step (vLLM keeps its metadata on
// the GPU the same way) and keeps them alive for the step; the host AttentionMetadata
// stays the source that validation reads. Pointers are not owned.
struct DeviceAttentionMetadata {
  const int32_t* query_start_loc = nullptr;  // [num_seqs + 1]
  const int32_t* seq_lens = nullptr;         // [num_seqs]
  const int32_t* block_table = nullptr;      // [num_seqs, max_blocks_per_seq]
  const int64_t* slot_mapping = nullptr;     // [num key tokens]
};

// One sequence of a step, for BuildAttentionMetadata.
struct SequenceSchedule {
  int32_t context_len = 0;         // tokens already in the cache
  int32_t query_len = 0;           // new tokens this step (>= 1)
  std::vector<int32_t> block_ids;  // the sequence's block table row (covers seq_len tokens)
};

// Builds the metadata of a batch, with slots for the new tokens of each sequence, then
// `num_padding_tokens` padding rows (slot -1) at the end. InvalidArgument for an empty
// batch, query_len < 1 or negative sizes; OutOfRange when a row has too few blocks.
absl::StatusOr<AttentionMetadata> BuildAttentionMetadata(
    absl::Span<const SequenceSchedule> sequences, int block_size, int num_padding_tokens = 0);

}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_METADATA_H_
