// What the CPU attention fast path's work items share and use: the tile geometry, the
// per-call Problem, a WorkItem (sequence, KV head, tile of query tokens) and the per-thread
// Scratch buffers. The design (item shapes, batch invariance) is at the top of fast.cc.
#ifndef KVSTREAM_ATTENTION_CPU_FAST_PROBLEM_H_
#define KVSTREAM_ATTENTION_CPU_FAST_PROBLEM_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "kvstream/attention/backend.h"
#include "kvstream/common/int_math.h"

namespace kvstream {
namespace internal {
namespace cpu_fast {

inline constexpr int kKeyTile = 64;     // keys per tile: a K and a V tile stay in L1/L2
inline constexpr int kTargetRows = 64;  // query rows per item (tokens x group) in prefill
inline constexpr int kLanes = 16;       // padding unit of every vector-swept row
// Items with at most this many rows are narrow (see the top of fast.cc).
inline constexpr int kNarrowMaxRows = kLanes;

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();
inline constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

inline int64_t RoundUp(int64_t x, int64_t m) { return CeilDiv(x, m) * m; }

// What every item of one call shares.
struct Problem {
  const PagedAttentionParams* p = nullptr;
  int head_size = 0;
  int head_size_v = 0;
  int64_t ldk = 0;  // head_size rounded up to kLanes
  int64_t ldv = 0;  // head_size_v rounded up to kLanes
  int group = 0;    // query heads per KV head
  int64_t block_size = 0;
  int tile_tokens = 0;  // query tokens per item (prefill)
  int max_rows = 0;
  int64_t max_rows_padded = 0;
  float cap = 0;
  float inv_cap = 0;
  const float* fp8_table = nullptr;  // unscaled fp8 -> float, 256 entries; null if not fp8
  int64_t cache_elem = 0;            // bytes per cache element
};

struct WorkItem {
  int32_t seq = 0;
  int32_t kv_head = 0;
  int32_t t_begin = 0;  // first query token of the item, relative to the sequence
  int32_t t_count = 0;
  int64_t cost = 0;     // multiply-adds, for scheduling
};

struct FreeDeleter {
  void operator()(void* ptr) const { std::free(ptr); }
};
template <typename T>
using AlignedBuffer = std::unique_ptr<T[], FreeDeleter>;

template <typename T>
AlignedBuffer<T> AllocZeroed(int64_t n) {
  const size_t bytes = static_cast<size_t>(RoundUp(std::max<int64_t>(n, 1) * sizeof(T), 64));
  void* ptr = std::aligned_alloc(64, bytes);
  if (ptr != nullptr) std::memset(ptr, 0, bytes);
  return AlignedBuffer<T>(static_cast<T*>(ptr));
}

// Per-thread buffers, sized once per call. Padding columns of q_rows and k_rows are never
// written, so they stay zero; zero_row stands in for the keys that pad a K tile to a
// multiple of kLanes (its bytes read as 0 in every cache type).
struct Scratch {
  AlignedBuffer<float> q_rows, q_t, k_rows, kt, v_rows, s_rows, scores, out, zero_row;
  AlignedBuffer<float> m, l, alpha, tile_max, sub, sum, slope;
  AlignedBuffer<int32_t> pos, lo, hi;
  AlignedBuffer<float> k_table, v_table;
  // Row addresses of the current and the next KV tile.
  const char* k_ptrs[2][kKeyTile];
  const char* v_ptrs[2][kKeyTile];
  const char* k_row_ptrs[kKeyTile];  // rows of k_rows, for transposing converted tiles
  std::vector<const char*> q_row_ptrs;  // rows of q_rows, for transposing Q

  bool Allocate(const Problem& pb) {
    const int64_t rp = pb.max_rows_padded;
    q_rows = AllocZeroed<float>(pb.max_rows * pb.ldk);
    q_t = AllocZeroed<float>(pb.ldk * rp);
    k_rows = AllocZeroed<float>(kKeyTile * pb.ldk);
    kt = AllocZeroed<float>(pb.ldk * kKeyTile);
    v_rows = AllocZeroed<float>(kKeyTile * pb.ldv);
    s_rows = AllocZeroed<float>(kNarrowMaxRows * kKeyTile);
    scores = AllocZeroed<float>(kKeyTile * rp);
    out = AllocZeroed<float>(pb.max_rows * pb.ldv);
    zero_row = AllocZeroed<float>(pb.ldk);
    m = AllocZeroed<float>(rp);
    l = AllocZeroed<float>(rp);
    alpha = AllocZeroed<float>(rp);
    tile_max = AllocZeroed<float>(rp);
    sub = AllocZeroed<float>(rp);
    sum = AllocZeroed<float>(rp);
    slope = AllocZeroed<float>(rp);
    pos = AllocZeroed<int32_t>(rp);
    lo = AllocZeroed<int32_t>(rp);
    hi = AllocZeroed<int32_t>(rp);
    k_table = AllocZeroed<float>(256);
    v_table = AllocZeroed<float>(256);
    if (!(q_rows && q_t && k_rows && kt && v_rows && s_rows && scores && out && zero_row && m &&
          l && alpha && tile_max && sub && sum && slope && pos && lo && hi && k_table && v_table)) {
      return false;
    }
    for (int jj = 0; jj < kKeyTile; ++jj) {
      k_row_ptrs[jj] = reinterpret_cast<const char*>(k_rows.get() + jj * pb.ldk);
    }
    q_row_ptrs.resize(static_cast<size_t>(rp));
    return true;
  }
};

}  // namespace cpu_fast
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CPU_FAST_PROBLEM_H_
