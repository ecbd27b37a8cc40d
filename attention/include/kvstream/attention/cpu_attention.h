// The two CPU implementations of paged attention (semantics in backend.h).
//
// RunAttentionReference is the golden reference the tests trust: plain loops over every
// query, head and key, scores and sums in double, fp8 dequantised element by element. It
// is slow on purpose; nothing in the library's hot path uses it.
//
// RunAttentionCpu is the fast path the "cpu" backend uses: per (sequence, KV head, query
// tile) it walks the paged cache in KV tiles, dequantises a tile once for the whole query
// head group, and keeps an online softmax (running max and sum) in float with vectorisable
// inner loops; work items are spread over threads when there is enough work.
#ifndef KVSTREAM_ATTENTION_CPU_ATTENTION_H_
#define KVSTREAM_ATTENTION_CPU_ATTENTION_H_

#include "absl/status/status.h"
#include "kvstream/attention/backend.h"

namespace kvstream {

// Both validate (ValidatePagedAttention) before computing; on error nothing is written.
absl::Status RunAttentionReference(const PagedAttentionParams& params);
absl::Status RunAttentionCpu(const PagedAttentionParams& params);

}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CPU_ATTENTION_H_
