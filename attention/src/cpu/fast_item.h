// One work item of the CPU attention fast path (a sequence's KV head and tile of query
// tokens: fast.cc), compiled once per instruction-set variant. fast.cc splits a call into
// items and runs each through the function that ItemFunction gives.
#ifndef KVSTREAM_ATTENTION_CPU_FAST_ITEM_H_
#define KVSTREAM_ATTENTION_CPU_FAST_ITEM_H_

#include "cpu/fast_internal.h"
#include "cpu/fast_problem.h"

namespace kvstream {
namespace internal {
namespace cpu_fast {

// Computes the output rows of `item` and stores them into pb.p->out, using `sc` (the
// calling thread's, allocated for `pb`) as scratch. Items write disjoint rows, so items of
// one call may run on different threads, each with its own Scratch. REQUIRES: the params
// were validated and the CPU can run the variant.
using ItemFn = void (*)(const Problem& pb, const WorkItem& item, Scratch& sc);

// The item function of variant `isa` (the generic one for a variant this build lacks).
ItemFn ItemFunction(CpuIsa isa);

}  // namespace cpu_fast
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CPU_FAST_ITEM_H_
