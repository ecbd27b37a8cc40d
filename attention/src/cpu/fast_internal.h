// Test and benchmark hooks of the CPU attention fast path (fast.cc): which instruction-set
// variant runs and on how many threads, so that tests exercise every variant this machine
// can execute (not only the best one) and the benchmark can measure one core.
#ifndef KVSTREAM_ATTENTION_CPU_FAST_INTERNAL_H_
#define KVSTREAM_ATTENTION_CPU_FAST_INTERNAL_H_

#include <vector>

#include "absl/status/status.h"
#include "kvstream/attention/backend.h"

namespace kvstream {
namespace internal {

// Variants of the fast path's kernels; each is the same C++ compiled for another
// instruction set and picked at run time.
enum class CpuIsa { kGeneric, kAvx2, kAvx512 };

const char* CpuIsaName(CpuIsa isa);

// The variants this CPU can run, kGeneric first; the last is what RunAttentionCpu uses.
std::vector<CpuIsa> SupportedCpuIsas();

// RunAttentionCpu with a chosen variant and thread count. num_threads <= 0: OpenMP's
// default, and one thread for calls too small to be worth a team (what RunAttentionCpu
// does); > 0: that many (at most one per work item), however small the call. The output
// bits do not depend on the thread count, only on `isa` (see fast.cc).
// InvalidArgument when the CPU cannot run `isa`.
absl::Status RunAttentionCpuWith(const PagedAttentionParams& params, CpuIsa isa,
                                 int num_threads);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CPU_FAST_INTERNAL_H_
