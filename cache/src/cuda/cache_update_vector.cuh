// The CUDA cache update's vector paths (cache_update.cuh describes the work split): a
// token's K and V rows as 8-element chunks, the lane's walk through them (LaneWalk,
// WalkTokenVec), the regular walk (WalkTokenRegular) where the rows' shape allows it, and
// UpdateTokenVec, the vector update of same-dtype copies, 16/32-bit conversions and fp8
// through the division.
#ifndef KVSTREAM_CACHE_CUDA_CACHE_UPDATE_VECTOR_CUH_
#define KVSTREAM_CACHE_CUDA_CACHE_UPDATE_VECTOR_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cache_update_host.h"
#include "cache_update_params.cuh"
#include "cache_update_types.cuh"

namespace kvstream {
namespace internal {
namespace cache_update {

// 8 elements as one aligned access: 32 bytes (two 16-byte accesses) for 32-bit types, 16
// for 16-bit, 8 for fp8.
template <typename B>
struct alignas(sizeof(B) * kVecElems >= 16 ? 16 : sizeof(B) * kVecElems) Vec8 {
  B v[kVecElems];
};

// Element e of a chunk, read out of the chunk's 32-bit words for 16-bit types: indexing
// the 16-bit elements makes the compiler split a chunk into eight registers as soon as it
// is loaded, twice the four it needs while the other loads are in flight.
template <typename B>
__device__ __forceinline__ B ChunkElement(const Vec8<B>& chunk, int e) {
  if constexpr (sizeof(B) == 2) {
    const uint32_t word = reinterpret_cast<const uint32_t*>(&chunk)[e / 2];
    return static_cast<B>(e % 2 != 0 ? word >> 16 : word & 0xffffu);
  } else {
    return chunk.v[e];
  }
}

// Chunks a lane has in flight (vector paths): 64 bytes of input, four 16-byte chunks of
// 16-bit inputs or two 32-byte chunks of 32-bit inputs. On the H200 this beat 128 bytes
// (8 KV heads x 128, 4k / 16k / 64k tokens: bf16 copy 0.90 / 0.92 / 0.93 of a D2D copy
// against 0.85 / 0.91 / 0.92; fp8 at scale 0.05 0.60 / 0.85 / 0.88 against 0.56 / 0.79 /
// 0.84): fewer registers let four CTAs per SM run, and a warp's second batch of loads
// overlaps other warps' stores.
template <typename InBits>
inline constexpr int kUnroll = 64 / static_cast<int>(sizeof(Vec8<InBits>));

// The fp8 scale of (K or V, head): its index into fp8_scale, and the scale.
__device__ __forceinline__ int ScaleIndex(const KernelParams& p, bool is_v, int head) {
  return (is_v ? kMaxScales : 0) + (p.num_scales > 1 ? head : 0);
}

__device__ __forceinline__ float ScaleFor(const KernelParams& p, bool is_v, int head) {
  return p.fp8_scale[ScaleIndex(p, is_v, head)].scale;
}

// The cache rows of slot `slot`: false for padding (-1) and for slots outside
// [0, num_slots) (see KernelParams), which are skipped. Called after a warp's first input
// loads are issued, so that the slot's load and the inputs' loads overlap instead of adding
// up (a warp's whole life is a few dependent memory round trips).
template <typename OutBits>
__device__ __forceinline__ bool ResolveSlot(const KernelParams& p, int64_t slot,
                                            OutBits** k_dst, OutBits** v_dst) {
  if (slot < 0 || slot >= p.num_slots) return false;
  const int64_t block = slot / p.block_size;
  const int64_t offset = slot - block * p.block_size;
  *k_dst =
      static_cast<OutBits*>(p.k_cache) + block * p.k_block_stride + offset * p.k_token_stride;
  *v_dst =
      static_cast<OutBits*>(p.v_cache) + block * p.v_block_stride + offset * p.v_token_stride;
  return true;
}

// ---- Vector paths: a lane's walk through its token's chunks ----
//
// A warp's token is one space of 8-element chunks, K's heads then V's; in step s of the
// walk, lane l handles chunk 32 s + l. With k_total K chunks, steps s < k_steps =
// k_total / 32 lie wholly in K and steps s > k_steps wholly in V; step k_steps is split
// when k_rem = k_total % 32 is not 0 (lanes < k_rem in K, the others in V). Which of these
// a step is depends on s alone, the same for the whole warp: K steps take K's sizes and
// strides straight from the params, V steps V's, and only the split step chooses per lane.
// A lane's head and first element are found by a magic-number division (LocateChunk) at
// the start of each batch of steps (once per token unless a token has more than 32 *
// kUnroll chunks) and when the lane starts V (at V's chunk (l - k_rem) mod 32: in the split
// step, or for a lane still in K there, the step after); in between, a step moves them by
// a fixed number of heads and elements (StepChunk), so that no chunk pays for a division.

__device__ __forceinline__ int MagicDivide(int n, DivMagic m) {
  return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * m.mul) >> m.shift);
}

// A chunk's place within K or within V.
struct ChunkPos {
  int head;
  int first;  // first element within the head: a multiple of kVecElems, < the head size
};

// Chunk j of K or V, whose heads are `chunks_per_head` chunks (magic numbers m).
__device__ __forceinline__ ChunkPos LocateChunk(int j, int chunks_per_head, DivMagic m) {
  ChunkPos c;
  c.head = MagicDivide(j, m);
  c.first = (j - c.head * chunks_per_head) * kVecElems;
  return c;
}

// 32 chunks on: 32 * 8 elements are step_head heads and step_first elements, plus a carry
// into the next head when first passes the head size. Past the end the head keeps
// growing; callers check the chunk index before touching memory.
__device__ __forceinline__ void StepChunk(ChunkPos& c, int step_head, int step_first,
                                          int head_size) {
  c.first += step_first;
  const bool carry = c.first >= head_size;
  c.first -= carry ? head_size : 0;
  c.head += step_head + (carry ? 1 : 0);
}

// The chunk's offset in a row whose heads are `head_stride` apart: 32-bit (the launcher
// checks that a token's rows fit), unsigned so that the unused offsets of chunks past the
// end cannot overflow.
__device__ __forceinline__ uint32_t ChunkOffset(ChunkPos c, int64_t head_stride) {
  return static_cast<uint32_t>(c.head) * static_cast<uint32_t>(head_stride) +
         static_cast<uint32_t>(c.first);
}

// One lane's walk through its token.
struct LaneWalk {
  ChunkPos pos;  // the lane's chunk at the current step: in K, then (from step k_steps) in V
  int k_steps;   // steps wholly in K
  int k_rem;     // K chunks in step k_steps
  int lane;

  // The walk at step s0: one magic-number division, at the start of each batch (so that
  // nothing of the walk stays live while a batch converts and stores).
  __device__ __forceinline__ void Start(const KernelParams& p, int lane_index, int s0) {
    const int k_per_head = p.head_size / kVecElems;
    const int k_total = p.num_kv_heads * k_per_head;
    const int idx = 32 * s0 + lane_index;
    pos = idx < k_total ? LocateChunk(idx, k_per_head, p.k_chunks_per_head)
                        : LocateChunk(idx - k_total, p.head_size_v / kVecElems,
                                      p.v_chunks_per_head);
    k_steps = k_total / 32;
    k_rem = k_total % 32;
    lane = lane_index;
  }
};

// Where a loaded chunk goes, kept from its load to its store: its offset in the token's K
// or V cache row, with V marked in bit 31 (offsets are below 2^31: HeadOffsetsFitInt32 in
// the launcher), so that the store needs no other record; for fp8 caches its ScaleIndex.
struct ChunkDst {
  uint32_t off;
  int scale_index = 0;

  __device__ __forceinline__ bool InV() const { return (off >> 31) != 0; }
  template <typename OutBits>
  __device__ __forceinline__ OutBits* Address(OutBits* k_row, OutBits* v_row) const {
    return (InV() ? v_row : k_row) + (off & 0x7fffffffu);
  }
};

// One chunk of a token's input row, through the read-only path (ld.global.nc): the rows
// are global memory, read-only for the kernel, but reach here through TokenRow, which
// hides where the pointer came from.
template <typename InBits>
__device__ __forceinline__ Vec8<InBits> LoadInputChunk(const InBits* src) {
  static_assert(sizeof(Vec8<InBits>) % sizeof(uint4) == 0, "16- or 32-byte chunks");
  Vec8<InBits> v;
  uint4* words = reinterpret_cast<uint4*>(&v);
#pragma unroll
  for (size_t i = 0; i < sizeof(v) / sizeof(uint4); ++i) {
    words[i] = __ldg(reinterpret_cast<const uint4*>(src) + i);
  }
  return v;
}

// A chunk at `c` in K (in_v false) or V: its destination, and its input address in `row`
// (the token's K or V input row); a chunk that does not exist reads the row's first chunk
// instead (in bounds, never stored), so that the loads need no branch.
template <typename InBits, bool kFp8Cache>
__device__ __forceinline__ const InBits* PlaceChunk(const KernelParams& p, ChunkPos c,
                                                    bool in_v, const InBits* row,
                                                    int64_t row_head_stride,
                                                    int64_t cache_head_stride, bool exists,
                                                    ChunkDst& dst) {
  dst.off = ChunkOffset(c, cache_head_stride) | (in_v ? 0x80000000u : 0u);
  if constexpr (kFp8Cache) dst.scale_index = ScaleIndex(p, in_v, c.head);
  return row + (exists ? ChunkOffset(c, row_head_stride) : 0u);
}

// Step s of the walk: the chunk's input address and destination (as PlaceChunk), with the
// walk moved on to step s + 1.
template <typename InBits, bool kFp8Cache>
__device__ __forceinline__ const InBits* NextChunk(const KernelParams& p, const InBits* key,
                                                   const InBits* value, int s, bool exists,
                                                   LaneWalk& w, ChunkDst& dst) {
  const ChunkPos c = w.pos;
  if (s < w.k_steps) {  // the whole warp in K
    StepChunk(w.pos, p.k_step_head, p.k_step_first, p.head_size);
    return PlaceChunk<InBits, kFp8Cache>(p, c, false, key, p.key_head_stride, p.k_head_stride,
                                         exists, dst);
  }
  if (s > w.k_steps) {  // the whole warp in V
    StepChunk(w.pos, p.v_step_head, p.v_step_first, p.head_size_v);
    return PlaceChunk<InBits, kFp8Cache>(p, c, true, value, p.value_head_stride,
                                         p.v_head_stride, exists, dst);
  }
  // Into V: the lane's first V chunk is V's chunk (lane - k_rem) mod 32, in this step for
  // lanes >= k_rem, in the next for the others (here at their last K chunk).
  w.pos = LocateChunk((w.lane - w.k_rem) & 31, p.head_size_v / kVecElems, p.v_chunks_per_head);
  if (w.lane < w.k_rem) {
    return PlaceChunk<InBits, kFp8Cache>(p, c, false, key, p.key_head_stride, p.k_head_stride,
                                         exists, dst);
  }
  const ChunkPos v = w.pos;
  StepChunk(w.pos, p.v_step_head, p.v_step_first, p.head_size_v);
  return PlaceChunk<InBits, kFp8Cache>(p, v, true, value, p.value_head_stride, p.v_head_stride,
                                       exists, dst);
}

// The loads of a batch: steps s0 .. s0 + kSteps - 1 (chunks 32 * s0 + u * 32 + lane), all
// issued before any is used; the walk `w` moves on past them.
template <typename InBits, bool kFp8Cache, int kSteps>
__device__ __forceinline__ void LoadChunks(const KernelParams& p, const InBits* key,
                                           const InBits* value, int s0, int total,
                                           LaneWalk& w, Vec8<InBits> (&in)[kSteps],
                                           ChunkDst (&dst)[kSteps]) {
  const int warp_left = total - 32 * s0;  // step u has chunks when u * 32 < warp_left
  const int left = warp_left - w.lane;    // chunk u exists when u * 32 < left
#pragma unroll
  for (int u = 0; u < kSteps; ++u) {
    if (u * 32 < warp_left) {  // else the whole warp is past the end (small tokens)
      const InBits* src =
          NextChunk<InBits, kFp8Cache>(p, key, value, s0 + u, u * 32 < left, w, dst[u]);
      in[u] = LoadInputChunk(src);
    }
  }
}

// A token's input row for the vector paths, computed once and kept as a pointer: hidden
// from the optimizer, which would otherwise fold token * stride into every chunk's
// address and, short of registers, recompute it per chunk (six instructions).
template <typename T>
__device__ __forceinline__ const T* TokenRow(const void* base, int64_t token, int64_t stride) {
  const T* row = static_cast<const T*>(base) + token * stride;
  asm("" : "+l"(row));
  return row;
}

// Vector paths. REQUIRES (checked by the launcher): head sizes, input strides and cache
// block/token/head strides multiples of 8 elements, cache dim strides 1, base pointers
// aligned to their Vec8, a token's K and V rows (input and cache) within int32 offsets,
// the walk's fields of KernelParams set (k_step_first ... v_chunks_per_head).
//
// The walk both vector paths share: batches of loads (LoadChunks), the slot resolved while
// the first batch is in flight, then store_chunk(in, out, scale_index) for every chunk
// that exists, which converts `in` and writes it at `out` (its dst.Address(k_row, v_row)).
// kHalves: the 64 bytes a lane has in flight are two half batches instead of one batch,
// and each half is loaded again as soon as it is stored, so that a lane's conversions
// overlap its next loads (one walk for the whole token). On the H200 (8 KV heads x 128,
// 4k / 16k / 64k tokens, fractions of a D2D copy) this helps the fp8 fast paths (scale
// 0.05: 0.68 / 0.90 / 0.93 -> 0.69 / 0.94 / 0.97; scale 1: 0.88 / 0.93 / 0.97 -> 0.88 /
// 0.95 / 0.97) and hurts the 16-bit copy (0.85-0.88 / 0.92 / 0.93 -> 0.76-0.78 / 0.84 /
// 0.89), whose stores are twice as large: UpdateTokenVecFp8 takes it, UpdateTokenVec not.
template <typename InBits, typename OutBits, bool kFp8Cache, bool kHalves = false,
          typename StoreChunk>
__device__ __forceinline__ void WalkTokenVec(const KernelParams& p, int64_t token,
                                             const int64_t* slot_ptr, int lane,
                                             StoreChunk&& store_chunk) {
  const InBits* __restrict__ key = TokenRow<InBits>(p.key, token, p.key_token_stride);
  const InBits* __restrict__ value = TokenRow<InBits>(p.value, token, p.value_token_stride);
  const int64_t slot = *slot_ptr;  // consumed after the first loads are on their way
  OutBits* k_dst = nullptr;
  OutBits* v_dst = nullptr;
  const int total = p.num_kv_heads * (p.head_size / kVecElems + p.head_size_v / kVecElems);
  if constexpr (kHalves) {
    constexpr int kHalf = kUnroll<InBits> / 2;  // steps per half batch
    static_assert(kHalf >= 1, "two half batches");
    Vec8<InBits> in[2][kHalf];
    ChunkDst dst[2][kHalf];
    LaneWalk walk;
    walk.Start(p, lane, 0);
    LoadChunks<InBits, kFp8Cache, kHalf>(p, key, value, 0, total, walk, in[0], dst[0]);
    if (32 * kHalf < total) {
      LoadChunks<InBits, kFp8Cache, kHalf>(p, key, value, kHalf, total, walk, in[1], dst[1]);
    }
    if (!ResolveSlot(p, slot, &k_dst, &v_dst)) return;
    // Half h of round s0 holds steps s0 + h kHalf ...; the walk moves on in step order.
    for (int s0 = 0; 32 * s0 < total; s0 += 2 * kHalf) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int s = s0 + h * kHalf;
        if (32 * s >= total) break;
        const int left = total - 32 * s - lane;  // chunk u exists when u * 32 < left
#pragma unroll
        for (int u = 0; u < kHalf; ++u) {
          if (u * 32 < left) {
            store_chunk(in[h][u], dst[h][u].Address(k_dst, v_dst), dst[h][u].scale_index);
          }
        }
        if (32 * (s + 2 * kHalf) < total) {
          LoadChunks<InBits, kFp8Cache, kHalf>(p, key, value, s + 2 * kHalf, total, walk,
                                               in[h], dst[h]);
        }
      }
    }
  } else {
    for (int s0 = 0; 32 * s0 < total; s0 += kUnroll<InBits>) {
      LaneWalk walk;
      walk.Start(p, lane, s0);
      Vec8<InBits> in[kUnroll<InBits>];
      ChunkDst dst[kUnroll<InBits>];
      LoadChunks<InBits, kFp8Cache, kUnroll<InBits>>(p, key, value, s0, total, walk, in, dst);
      if (s0 == 0) {
        if (!ResolveSlot(p, slot, &k_dst, &v_dst)) return;
      }
      const int left = total - 32 * s0 - lane;  // chunk u exists when u * 32 < left
#pragma unroll
      for (int u = 0; u < kUnroll<InBits>; ++u) {
        if (u * 32 < left) store_chunk(in[u], dst[u].Address(k_dst, v_dst), dst[u].scale_index);
      }
    }
  }
}

// ---- Vector paths, regular rows: a walk without bookkeeping per chunk ----
//
// Where K and V heads have one size and the same head strides (input and cache), a lane can
// take kAdj adjacent chunks (one address, the next chunk at an immediate offset) and, where
// a head's C = head size / 8 chunks are a power of two of such runs, R = C / kAdj <= 32,
// lane l's run sits, in every step of 32 runs, at the same element (l mod R) * kAdj * 8 of
// a head 32 / R heads further on: its place is one multiply-add from the lane's first head.
// Where K's steps are also a whole number of groups of kGroup steps, a group is all K or
// all V, the same for the whole warp, and every lane has a run in every step: no compare,
// carry or existence test per chunk (WalkTokenVec spends about 20 instructions per chunk
// on them). The launcher sets run_shift = log2 R, regular_k_groups (K's groups) and the
// steps' strides where a shape qualifies (8 KV heads x 128 from 16-bit inputs: into fp8,
// runs of 2 chunks and 2 K steps; into 16 bits, single chunks and 4 K steps).
//
// kSlots groups are in flight per lane: 1 (load a group, store it, load the next: the 16-bit
// copy) or 2 (each slot loaded again as soon as it is stored: the fp8 paths, as
// WalkTokenVec's kHalves). The slot is resolved while the first loads are in flight, and
// store_chunk(in, out, scale_index) converts a chunk and writes it at `out`.
template <typename InBits, typename OutBits, bool kFp8Cache, int kAdj, int kGroup, int kSlots,
          typename StoreChunk>
__device__ __forceinline__ void WalkTokenRegular(const KernelParams& p, int64_t token,
                                                 const int64_t* slot_ptr, int lane,
                                                 StoreChunk&& store_chunk) {
  static_assert(kSlots == 1 || kSlots == 2, "groups come in K / V pairs: kSlots divides them");
  const InBits* __restrict__ key = TokenRow<InBits>(p.key, token, p.key_token_stride);
  const InBits* __restrict__ value = TokenRow<InBits>(p.value, token, p.value_token_stride);
  const int64_t slot = *slot_ptr;  // consumed after the first loads are on their way
  // The lane's run in step 0 of K (and of V: same strides): input and cache offsets. A step
  // moves both by 32 / R heads (step_in, step_out).
  const int lane_head = lane >> p.run_shift;
  const uint32_t first =
      static_cast<uint32_t>(lane & ((1 << p.run_shift) - 1)) * (kAdj * kVecElems);
  uint32_t lane_in = static_cast<uint32_t>(lane_head * p.key_head_stride) + first;
  uint32_t lane_out = static_cast<uint32_t>(lane_head * p.k_head_stride) + first;
  // Kept in registers: the compiler would otherwise recompute them for every group.
  asm("" : "+r"(lane_in), "+r"(lane_out));
  const int k_groups = p.regular_k_groups;
  const int groups = 2 * k_groups;  // K's, then as many of V's
  Vec8<InBits> in[kSlots][kGroup][kAdj];
  // Group g's loads into slot sl (a compile-time index once the callers' loops unroll).
  auto load_group = [&](int g, int sl) {
    const bool in_v = g >= k_groups;
    const uint32_t step0 = static_cast<uint32_t>((in_v ? g - k_groups : g) * kGroup);
    const InBits* row = in_v ? value : key;
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      const InBits* src = row + (lane_in + (step0 + u) * p.step_in);
#pragma unroll
      for (int a = 0; a < kAdj; ++a) in[sl][u][a] = LoadInputChunk(src + a * kVecElems);
    }
  };
#pragma unroll
  for (int sl = 0; sl < kSlots; ++sl) load_group(sl, sl);  // groups >= 2
  OutBits* k_dst = nullptr;
  OutBits* v_dst = nullptr;
  if (!ResolveSlot(p, slot, &k_dst, &v_dst)) return;
  for (int g0 = 0; g0 < groups; g0 += kSlots) {
#pragma unroll
    for (int sl = 0; sl < kSlots; ++sl) {
      const int g = g0 + sl;
      const bool in_v = g >= k_groups;
      // Group g's first step within K or V, as in load_group (a shared helper measured 3
      // more instructions per 4 chunks in the fp8 loop).
      const uint32_t step0 = static_cast<uint32_t>((in_v ? g - k_groups : g) * kGroup);
      OutBits* const row = in_v ? v_dst : k_dst;
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        OutBits* const out = row + (lane_out + (step0 + u) * p.step_out);
        const int head = lane_head + static_cast<int>(step0 + u) * (32 >> p.run_shift);
        const int scale_index = kFp8Cache ? ScaleIndex(p, in_v, head) : 0;
#pragma unroll
        for (int a = 0; a < kAdj; ++a) store_chunk(in[sl][u][a], out + a * kVecElems, scale_index);
      }
      if (g + kSlots < groups) load_group(g + kSlots, sl);
    }
  }
}

// The regular walk's shape per input type: a lane's batch (64 bytes of input, kUnroll
// chunks) is kSlots groups (2 with kHalves) of kRegularGroup steps of runs of
// kRegularAdjacent chunks: runs of 2 on the fp8 paths from 16-bit inputs (8-byte stores),
// single chunks elsewhere (on the 16-bit copy, whose stores are 16 bytes, runs of 2
// measured 0.54 / 0.80 / 0.85 of a D2D copy at 4k / 16k / 64k tokens against 0.91-0.95 /
// 0.92 / 0.93 for single chunks).
template <typename InBits, bool kHalves>
inline constexpr int kRegularAdjacent = kHalves && kUnroll<InBits> >= 4 ? 2 : 1;
template <typename InBits, bool kHalves>
inline constexpr int kRegularGroup =
    kUnroll<InBits> / (kHalves ? 2 : 1) / kRegularAdjacent<InBits, kHalves>;

// A token's walk: the regular one where the launcher picked it (kRegular), else the
// general one. store_chunk(in, out, scale_index) as WalkTokenRegular's.
template <typename InBits, typename OutBits, bool kFp8Cache, bool kHalves, bool kRegular,
          typename StoreChunk>
__device__ __forceinline__ void WalkToken(const KernelParams& p, int64_t token,
                                          const int64_t* slot_ptr, int lane,
                                          StoreChunk&& store_chunk) {
  if constexpr (kRegular) {
    WalkTokenRegular<InBits, OutBits, kFp8Cache, kRegularAdjacent<InBits, kHalves>,
                     kRegularGroup<InBits, kHalves>, kHalves ? 2 : 1>(p, token, slot_ptr, lane,
                                                                      store_chunk);
  } else {
    WalkTokenVec<InBits, OutBits, kFp8Cache, kHalves>(p, token, slot_ptr, lane, store_chunk);
  }
}

// Same-dtype copies and 16/32-bit conversions (Convert), and fp8 through the division.
template <typename In, typename Out, bool kRegular>
__device__ __forceinline__ void UpdateTokenVec(const KernelParams& p, int64_t token,
                                               const int64_t* slot_ptr, int lane) {
  using InBits = typename In::Bits;
  using OutBits = typename Out::Bits;
  WalkToken<InBits, OutBits, Out::kFp8, /*kHalves=*/false, kRegular>(
      p, token, slot_ptr, lane, [&](const Vec8<InBits>& in, OutBits* dst, int scale_index) {
        const float scale = Out::kFp8 ? p.fp8_scale[scale_index].scale : 1.0f;
        Vec8<OutBits> out;
        if constexpr (std::is_same<In, Out>::value) {
          out = in;  // the bits, untouched (Convert)
        } else {
#pragma unroll
          for (int e = 0; e < kVecElems; ++e) {
            out.v[e] = Convert<In, Out>(ChunkElement(in, e), scale);
          }
        }
        *reinterpret_cast<Vec8<OutBits>*>(dst) = out;
      });
}

}  // namespace cache_update
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CACHE_CUDA_CACHE_UPDATE_VECTOR_CUH_
