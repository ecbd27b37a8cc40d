// Software prefetching of the next KV tile's rows for the CPU attention fast path: the
// rows sit in blocks scattered over memory, which the hardware prefetchers do not guess.
#ifndef KVSTREAM_ATTENTION_CPU_FAST_PREFETCH_H_
#define KVSTREAM_ATTENTION_CPU_FAST_PREFETCH_H_

#include <algorithm>
#include <cstdint>

#include "cpu/fast_target.h"

namespace kvstream {
namespace internal {
namespace cpu_fast {

KVSTREAM_INLINE void PrefetchRow(const char* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
}

// The next tile's rows, asked for while this one is computed: they sit in blocks scattered
// over memory, which the hardware prefetchers do not guess, and decode is bound by them.
// The narrow path asks a key (its K and V rows) at a time at points spread over the whole
// tile, because the core has few miss buffers: a burst fills them, stalls, and then leaves
// the memory system idle for the rest of the tile.
struct TilePrefetcher {
  const char* const* k = nullptr;
  const char* const* v = nullptr;
  int n = 0;       // keys in the next tile; 0: nothing to prefetch
  int issued = 0;  // keys asked for so far
  int64_t k_bytes = 0;
  int64_t v_bytes = 0;

  // Asks for the keys before `end` not yet asked for.
  KVSTREAM_INLINE void Upto(int end) {
    end = std::min(end, n);
    for (; issued < end; ++issued) {
      PrefetchRow(k[issued], k_bytes);
      PrefetchRow(v[issued], v_bytes);
    }
  }
  // Step `step` of `steps` of a phase that owns the keys [from, to).
  KVSTREAM_INLINE void Spread(int step, int steps, int from, int to) {
    Upto(from + (to - from) * (step + 1) / steps);
  }
};

}  // namespace cpu_fast
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CPU_FAST_PREFETCH_H_
