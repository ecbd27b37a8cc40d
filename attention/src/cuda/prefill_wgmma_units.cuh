// The wgmma prefill kernel's work split (prefill_wgmma.cuh). A unit is what one CTA, or one
// pair of CTAs (PrefillWgmmaCluster::kPair), computes from start to end: the packed rows of
// one row tile (a pair: two adjacent row tiles) of one (sequence, KV head), against every
// key tile those rows see. Units are numbered in launch order, sequence by sequence, the
// last row tiles of a sequence first; the KV heads inner or outer (PrefillWgmmaArgs::
// heads_outer).
//
// Which units a CTA takes (UnitWalk):
//   one per CTA (grid = (units of a sequence [x 2 for pairs], num_seqs)): unit
//     blockIdx.y * units_per_seq + cluster, as the hardware hands CTAs out, so the longest
//     run first and the short ones fill the last waves;
//   persistent (grid = (G [x 2], 1), G no more than fit on the device at once): round r
//     takes units [r G, (r + 1) G), CTA (cluster) c the c-th of them in even rounds and
//     the (G - 1 - c)-th in odd ones. Units of one round are of about the same length and
//     grow shorter round by round; the serpentine hands the longest of one round and the
//     shortest of the next to the same CTA, so that the CTAs end together. A CTA keeps its
//     ring of K and V tiles and its barriers from unit to unit: the producer loads the next
//     unit's first tiles while the consumers still finish the last one's.
#ifndef KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_UNITS_CUH_
#define KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_UNITS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernel_params.h"
#include "cuda/prefill_helpers.cuh"
#include "cuda/prefill_wgmma_config.cuh"
#include "cuda/sequence_bounds.cuh"

namespace kvstream {
namespace internal {
namespace prefill_wgmma {

// The units one CTA (or pair) takes, round by round.
struct UnitWalk {
  int cluster;        // the CTA's index along x (pairs: its pair's)
  int clusters;       // persistent: CTAs (pairs) along x
  int seq_y;          // one per CTA: the CTA's index along y (its sequence)
  int units_per_seq;  // num_kv_heads x row tiles (pairs: pairs of row tiles)
  int total;          // units_per_seq x num_seqs
  bool persistent;

  // false past this CTA's last round; else *u is the unit of round r, or -1 when the last
  // round has none for this CTA.
  __host__ __device__ __forceinline__ bool At(int r, int* u) const {
    if (!persistent) {
      *u = seq_y * units_per_seq + cluster;
      return r == 0;
    }
    const int64_t base = static_cast<int64_t>(r) * clusters;
    if (base >= total) return false;
    const int64_t v = base + ((r & 1) != 0 ? clusters - 1 - cluster : cluster);
    *u = v < total ? static_cast<int>(v) : -1;
    return true;
  }
};

// The walk of the CTA at (block_x, block_y) of a grid `grid_x` CTAs wide.
template <bool kPair>
__host__ __device__ __forceinline__ UnitWalk MakeUnitWalk(const PagedKernelParams& p,
                                                          const PrefillWgmmaArgs& a,
                                                          int block_x, int grid_x,
                                                          int block_y) {
  constexpr int kCtas = kPair ? 2 : 1;
  UnitWalk w;
  w.cluster = block_x / kCtas;
  w.clusters = grid_x / kCtas;
  w.seq_y = block_y;
  w.units_per_seq = p.num_kv_heads * (a.num_m_tiles / kCtas);
  w.total = w.units_per_seq * p.num_seqs;  // the launcher checked that it fits
  w.persistent = a.persistent != 0;
  return w;
}

// What one unit is to one CTA of it: its rows, and the key tiles [n_begin, n_end) that it
// walks (a pair: both CTAs' rows and the union of their key ranges, the same for both).
struct Unit {
  int seq;
  int kv_head;
  int m_tile;      // this CTA's row tile, counted from the sequence's first
  SequenceBounds bounds;
  int rows_total;  // packed rows of the sequence: query_len x group
  int row0;        // this CTA's first packed row
  int n_begin;
  int n_end;
  bool loads;      // false: no row of the unit (pair) in the sequence; nothing to walk
};

template <int kBlockM, int kBlockN, bool kPair>
__device__ __forceinline__ Unit LoadUnit(const PagedKernelParams& p, const PrefillWgmmaArgs& a,
                                         const UnitWalk& w, int u, uint32_t cta_rank) {
  Unit t;
  t.seq = u / w.units_per_seq;
  const int in_seq = u - t.seq * w.units_per_seq;
  const int unit_tiles = kPair ? a.num_m_tiles / 2 : a.num_m_tiles;
  t.kv_head = a.heads_outer != 0 ? in_seq / unit_tiles : in_seq % p.num_kv_heads;
  const int unit_m = a.heads_outer != 0 ? in_seq % unit_tiles : in_seq / p.num_kv_heads;
  t.m_tile = a.num_m_tiles - 1 - (kPair ? 2 * unit_m + static_cast<int>(cta_rank) : unit_m);
  const int group = p.num_heads / p.num_kv_heads;
  t.bounds = LoadSequenceBounds(p, t.seq);
  t.rows_total = t.bounds.query_len * group;
  t.row0 = t.m_tile * kBlockM;
  // The rows whose keys the CTA loads: its own, or its pair's (both take the same branch).
  const int load_row0 = kPair ? (t.m_tile & ~1) * kBlockM : t.row0;
  const int load_rows = kPair ? 2 * kBlockM : kBlockM;
  t.loads = load_row0 < t.rows_total;
  t.n_begin = 0;
  t.n_end = 0;
  if (t.loads) {
    const int seq_len = t.bounds.seq_len;
    const int context = seq_len - t.bounds.query_len;
    const int last_row = min(t.rows_total, load_row0 + load_rows) - 1;
    const int kv_lo = cuda::VisibleLo(p, context + load_row0 / group);
    const int kv_hi = cuda::VisibleHi(p, context + last_row / group, seq_len);  // inclusive
    t.n_begin = kv_lo / kBlockN;
    t.n_end = kv_hi / kBlockN + 1;
  }
  return t;
}

}  // namespace prefill_wgmma
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_PREFILL_WGMMA_UNITS_CUH_
