// One sequence's query rows and keys as the attention kernels read them from the device
// copies of query_start_loc and seq_lens. Validation checked the host copies
// (MakePagedKernelParams); a device copy that disagrees with them is an engine bug that must
// not make a kernel read or write outside its buffers (an illegal address also ends the
// process's CUDA context), so a sequence whose device values the host copy could not have
// had is treated as empty: nothing of it is read or written.
#ifndef KVSTREAM_ATTENTION_CUDA_SEQUENCE_BOUNDS_CUH_
#define KVSTREAM_ATTENTION_CUDA_SEQUENCE_BOUNDS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernel_params.h"

namespace kvstream {
namespace internal {

struct SequenceBounds {
  int q_start;    // first query row
  int query_len;  // query rows; 0 for an empty (or inconsistent) sequence
  int seq_len;    // keys, the query rows' included
};

__device__ __forceinline__ SequenceBounds LoadSequenceBounds(const PagedKernelParams& p,
                                                             int seq) {
  const int64_t q_start = p.query_start_loc[seq];
  const int64_t q_end = p.query_start_loc[seq + 1];
  const int64_t seq_len = p.seq_lens[seq];
  const int64_t query_len = q_end - q_start;
  const bool consistent = q_start >= 0 && query_len >= 0 && q_end <= p.num_tokens &&
                          query_len <= p.max_query_len && seq_len >= query_len &&
                          seq_len <= p.max_seq_len &&
                          seq_len <= p.block_table_stride * p.block_size;
  SequenceBounds b;
  b.q_start = consistent ? static_cast<int>(q_start) : 0;
  b.query_len = consistent ? static_cast<int>(query_len) : 0;
  b.seq_len = consistent ? static_cast<int>(seq_len) : 0;
  return b;
}

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_SEQUENCE_BOUNDS_CUH_
