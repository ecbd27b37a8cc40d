// Paged decode attention on tensor cores (the FlashInfer GQA decode design): the kernel
// behind LaunchDecodeAttention's tensor-core path (decode_attention.cu). Header-only
// template over the padded head size D and the 16-bit activation type T, taking
// PagedKernelParams (kernel_params.h) and a DecodeTcArgs by value.
//
// Work split. One CTA of 4 warps per (sequence, KV head, head tile, split):
//   grid = (num_kv_heads * head_tiles, num_seqs, num_splits), block = 128
// (KV heads fastest, so that CTAs running together read neighbouring rows of the same
// blocks; see decode_attention.cuh)
// A head tile is up to 8 kNT (kNT = 1 or 2) query heads of one KV head: they are the N
// columns of the m16n8k16 mma (columns past the group are zero), the keys its M rows, so
// every K and V byte serves all of them and a group of 4 heads wastes half of each mma,
// not three quarters as with the heads as the 16 M rows. A split is a contiguous range of
// the sequence's visible keys, a multiple of 64 keys long (the last one shorter).
//
// Data flow inside a CTA:
//   k_cache: [num_blocks, block_size, num_kv_heads, head_size]    (strides from params)
//   v_cache: [num_blocks, block_size, num_kv_heads, head_size_v]
//   -> a cp.async pipeline (L2 evict-first: every row is read once) over a ring of kRing
//      half tiles (a 64-key tile's K, then its V: while the warps use one, kRing - 1 are in
//      flight, and a half's slot is reused as soon as it is consumed), one page-table
//      lookup per key row (looked up ahead of the copy, through a small ring in shared
//      memory that holds each row's K and V byte offsets (RowBytes), so that a copy is an
//      add and a cp.async; rows with nothing to load point at kDecodeZeroRow): 16-bit
//      caches straight into swizzled [64][D] tiles of T; fp8 caches raw into [64][D] byte
//      tiles, each converted to T into one swizzled tile when its turn comes (each warp
//      its own 16 rows: no CTA barrier between the conversion and the warp's mmas)
//   -> warp w takes keys [16 w, 16 w + 16) of every tile: S^T = K Q^T (K from the swizzled
//      tile by ldmatrix, Q^T fragments in registers, fp32 accumulators), base-2 online
//      softmax per head column (its running max may trail the scores by up to 2^8, so
//      that most tiles need no shuffles and no rescale), P^T turned into the B fragment
//      by movmatrix.trans,
//      O^T += V^T P^T (ldmatrix.trans of V)
//   -> the warps' (max, sum, O) merged through shared memory
//   -> num_splits == 1: out [num_tokens, num_heads, head_size_v] written directly; else
//      partial_out [num_seqs, num_heads, num_splits, head_size_v] (unnormalised) and
//      partial_ml [num_seqs, num_heads, num_splits, 2] (base-2 max, sum): the layout of
//      decode_attention.cuh, merged by its DecodeMergeKernel (which applies the V scale).
//
// fp8: the K scale is folded into the softmax scale, the V scale into the output. The
// kFp8InRegisters template argument makes the fp8-only instantiation that stages no 16-bit
// tile: K's mma fragments are converted from the raw tile in registers (the head dimension
// permuted alike in Q's fragments; odd raw rows' chunks XOR 4 against bank conflicts), and
// V's too, each converted pair turned into a V^T fragment by movmatrix.trans (the output
// dims permuted alike, undone where the warps merge).
//
// Shared memory (bytes): loc [kLocTiles][64] RowBytes | q [8 kNT][D] T (swizzled) |
//   16-bit: ring [kRing][64][D] T  /  fp8: raw ring [kRing][64][D] bytes, tile [64][D] T
//   (no tile with kFp8InRegisters)
//
// A host build that defines KVSTREAM_CUDA_EMULATION provides the PTX wrappers (mma_ptx.cuh; and
// __syncthreads, __shfl_xor_sync, threadIdx, blockIdx, shared memory) itself, so that the
// kernel runs unchanged under the warp emulator (tests/gpu/cuda_decode_emulation_gpu_test.cc).
#ifndef KVSTREAM_ATTENTION_CUDA_DECODE_TC_ATTENTION_CUH_
#define KVSTREAM_ATTENTION_CUDA_DECODE_TC_ATTENTION_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/cuda_common.cuh"
#include "cuda/decode_softmax.cuh"
#include "cuda/kernel_params.h"
#include "cuda/mma_ptx.cuh"
#include "cuda/sequence_bounds.cuh"

namespace kvstream {
namespace internal {
namespace decode_tc {

// How the cache's elements reach the 16-bit tiles.
enum DecodeTcCacheKind : int { kCache16 = 0, kCacheE4M3 = 1, kCacheE5M2 = 2 };

// Runtime choices the launcher makes once per call.
struct DecodeTcArgs {
  int32_t group_size;  // num_heads / num_kv_heads
  int32_t head_tiles;  // ceil(group_size / DecodeTcHeadTileRows(group_size))
  int32_t num_splits;  // 1 .. 256
  int32_t cache_kind;  // DecodeTcCacheKind
  float* partial_out;  // num_splits > 1: the workspace (see the file comment)
  float* partial_ml;
};

// Query heads per CTA for a group of `group_size`: one n8 tile up to 8 heads, else two.
inline constexpr int DecodeTcHeadTileRows(int group_size) { return group_size <= 8 ? 8 : 16; }

// How an fp8 cache is staged: the kernel's kFp8InRegisters template argument. false is the
// instantiation shared with 16-bit caches (fp8 a runtime branch): a ring of kRing raw half
// tiles, K and V each converted into the one 16-bit tile. true is the fp8-only
// instantiation with K's and V's fragments converted in registers, no 16-bit tile (the
// launcher's DecodeFp8Staging::kInRegisters; decode_tc_attention.cu builds it at padded
// head size 128 with one n8 tile).
template <int D, int kNT, bool kFp8InRegisters = false>
struct DecodeTcTraits {
  static_assert(D == 64 || D == 128 || D == 256, "padded head sizes 64, 128 and 256");
  static_assert(kNT == 1 || kNT == 2, "one or two n8 tiles of query heads");
  static constexpr int kWarps = 4;  // every instantiation: the launcher relies on it
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = 16 * kWarps;  // keys per tile: 16 per warp
  static constexpr int kRows = 8 * kNT;        // query heads per CTA
  // The copy pipeline is a ring of kRing half tiles (a tile's K or its V): kRing - 1 of
  // them are in flight while one is consumed. Ring and CTAs per SM for D = 64 / 128 / 256:
  // 8 x 3, 3 x 4 (3 with two n8 tiles, whose registers do not fit four), 3 x 2. At D = 128
  // four CTAs of 55 KiB share an SM, so that 64 sequences x 8 KV heads run in one wave of
  // 132 SMs.
  static constexpr int kRing = D == 64 ? 8 : 3;
  static constexpr int kMinBlocksPerSm = D == 64 ? 3 : D == 128 ? (kNT == 1 ? 4 : 3) : 2;
  static constexpr int kTileBytes = kBlockN * D * 2;   // one 16-bit K or V tile
  static constexpr int kRawTileBytes = kBlockN * D;    // one fp8 K or V tile
  // Page-table rows of the tiles between their lookup and their V copy (DecodeTcKernel).
  static constexpr int kLocTiles = (kRing + 1) / 2 + 1;
  static constexpr int kLocBytes = kLocTiles * kBlockN * 16;  // RowBytes per key row
  static constexpr int kQOffset = kLocBytes;
  static constexpr int kQBytes = kRows * D * 2;
  static constexpr int kKvOffset = kQOffset + kQBytes;
  // The warps' partial results at the end: [kWarps][kRows][D] + [kWarps][kRows][2] floats,
  // in the pipeline's shared memory, which is the larger except with kFp8InRegisters (no
  // 16-bit tile): SmemBytes is the larger of the two.
  static constexpr int kMergeBytes = kWarps * kRows * (D + 2) * 4;
  static constexpr int SmemBytes(bool fp8) {
    const int convert_tile = kFp8InRegisters ? 0 : kTileBytes;
    const int pipeline =
        kKvOffset + (fp8 ? kRing * kRawTileBytes + convert_tile : kRing * kTileBytes);
    return pipeline > kMergeBytes ? pipeline : kMergeBytes;
  }
  // kMinBlocksPerSm CTAs (and the 1 KiB the SM reserves for each) in the 228 KiB of an SM.
  static_assert(kMinBlocksPerSm * (SmemBytes(kFp8InRegisters) + 1024) <= 228 * 1024,
                "the CTAs per SM fit in shared memory");
};

// Byte offset of 16-byte chunk `chunk` of row `row` within that row of a raw [rows][D] fp8
// tile (rows are D bytes apart). kSwizzled (kFp8InRegisters): in rows of 128 or 256 bytes
// the chunks of odd rows are XOR 4, so that the K fragment loads of two adjacent rows (one
// phase of a warp's 16-byte loads: 4 lanes per row) hit eight different 16-byte bank
// groups. Rows of 64 bytes need none (two rows fill the 32 banks).
template <int D, bool kSwizzled>
__device__ __forceinline__ int RawChunkInRow(int row, int chunk) {
  const int swizzle = kSwizzled && D >= 128 ? (row & 1) << 2 : 0;
  return (chunk ^ swizzle) * 16;
}

// ---------------------------------------------------------------------------------------
// The shared PTX pieces (mma_ptx.cuh).
using ptx::CpAsync16EvictFirst;
using ptx::CpAsyncCommit;
using ptx::CpAsyncWaitGroup;
using ptx::FastExp2;
using ptx::Fp8ChunkTo;
using ptx::Fp8PairTo;
using ptx::LdMatrixX4;
using ptx::LdMatrixX4Trans;
using ptx::Log2IfPowerOfTwo;
using ptx::Mma16816;
using ptx::MovMatrixTrans;
using ptx::PackPair;
using ptx::PairBits;
using ptx::SmemAddress;
using ptx::SwizzledChunk;
using cuda::FromFloat;  // cuda_common.cuh

// Where one key row of a tile is copied from: byte offsets from k_cache and v_cache (block,
// offset in block and KV head folded in).
struct alignas(16) RowBytes {
  int64_t k;
  int64_t v;
};

// What a key row with nothing to load is copied from (past the split's keys, or a block id
// outside the cache): zeros, one row of the widest tile (256 16-bit values). Its offset
// from a cache pointer stands in for the row's, so that every copy is unconditional.
static __device__ __align__(16) const uint8_t kDecodeZeroRow[512] = {};

// ---------------------------------------------------------------------------------------
// The kernel.

// kFp8InRegisters: a.cache_kind must be kCacheE4M3 or kCacheE5M2.
template <int D, int kNT, typename T, bool kFp8InRegisters = false>
__global__ void __launch_bounds__(DecodeTcTraits<D, kNT, kFp8InRegisters>::kThreads,
                                  DecodeTcTraits<D, kNT, kFp8InRegisters>::kMinBlocksPerSm)
    DecodeTcKernel(const __grid_constant__ PagedKernelParams p,
                   const __grid_constant__ DecodeTcArgs a) {
  using Traits = DecodeTcTraits<D, kNT, kFp8InRegisters>;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kRows = Traits::kRows;
  constexpr int kRing = Traits::kRing;
  constexpr int kDSteps = D / 16;  // k16 steps of K Q^T, m16 blocks of the output
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kNegInf = -INFINITY;

  KVSTREAM_CUDA_SHARED_MEMORY(smem);
  RowBytes* const loc_smem = reinterpret_cast<RowBytes*>(smem);
  uint8_t* const q_smem = smem + Traits::kQOffset;
  uint8_t* const kv_smem = smem + Traits::kKvOffset;
  const uint32_t q_base = SmemAddress(q_smem);
  const uint32_t kv_base = SmemAddress(kv_smem);

  cuda::AllowDependentLaunch();  // the merge kernel waits for this grid's end itself
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int seq = static_cast<int>(blockIdx.y);
  const int kv_head = static_cast<int>(blockIdx.x) / a.head_tiles;
  const int head_tile = static_cast<int>(blockIdx.x) - kv_head * a.head_tiles;
  const int split = static_cast<int>(blockIdx.z);
  const SequenceBounds bounds = LoadSequenceBounds(p, seq);
  if (bounds.query_len <= 0) return;  // no query: nothing to write
  const int q_row = bounds.q_start;
  const int seq_len = bounds.seq_len;
  const int first_head = kv_head * a.group_size + head_tile * kRows;
  const int heads_here = min(kRows, a.group_size - head_tile * kRows);
  // kFp8InRegisters: K's and V's mma fragments come from the raw tiles (raw_k_half,
  // raw_v_half: converted in registers, the head dimension permuted alike in Q's fragments
  // and the output dims in the accumulators), never through a 16-bit tile.
  const bool fp8 = kFp8InRegisters || a.cache_kind != kCache16;
  const int head_size = p.head_size;
  const int head_size_v = p.head_size_v;

  // The decode query sits at position seq_len - 1: every key before it is visible, a
  // window keeps the last sliding_window keys. Splits are whole tiles but the last.
  const int q_pos = seq_len - 1;
  const int kv_begin = p.sliding_window > 0 ? max(0, seq_len - p.sliding_window) : 0;
  const int kv_len = seq_len - kv_begin;
  const int per_split =
      ((kv_len + a.num_splits - 1) / a.num_splits + kBlockN - 1) / kBlockN * kBlockN;
  const int s_begin = kv_begin + min(kv_len, split * per_split);
  const int s_end = kv_begin + min(kv_len, (split + 1) * per_split);
  const int num_tiles = (s_end - s_begin + kBlockN - 1) / kBlockN;

  const int32_t* const block_row = p.block_table + static_cast<int64_t>(seq) * p.block_table_stride;
  const int64_t es = fp8 ? 1 : 2;
  const int64_t k_head_offset = static_cast<int64_t>(kv_head) * p.k_head_stride;
  const int64_t v_head_offset = static_cast<int64_t>(kv_head) * p.v_head_stride;
  // The zero row's offsets from the caches, as integers (the arrays are distinct objects).
  const uintptr_t zero_address = reinterpret_cast<uintptr_t>(kDecodeZeroRow);
  const RowBytes zero_row{
      static_cast<int64_t>(zero_address - reinterpret_cast<uintptr_t>(p.k_cache)),
      static_cast<int64_t>(zero_address - reinterpret_cast<uintptr_t>(p.v_cache))};
  // Page-table lookup of key row r of tile n: the row's byte offsets, or the zero row's past
  // the split or for an id outside the cache (validation checked the host mirror; a device
  // table that disagrees leaves the row zero, not read out of bounds).
  const int block_shift = Log2IfPowerOfTwo(p.block_size);
  auto lookup = [&](int n, int r) -> RowBytes {
    const int j = s_begin + n * kBlockN + r;
    if (j >= s_end) return zero_row;
    const int b = block_shift >= 0 ? j >> block_shift : j / p.block_size;
    const int block = block_row[b];
    if (block < 0 || block >= p.num_blocks) return zero_row;
    const int64_t offset = j - b * p.block_size;
    return RowBytes{
        (block * p.k_block_stride + offset * p.k_token_stride + k_head_offset) * es,
        (block * p.v_block_stride + offset * p.v_token_stride + v_head_offset) * es};
  };

  // ---- Prologue: the page table of the first tiles, Q.
  // The rows of tile n are stored in loc slot n % kLocTiles after the barrier of the loop's
  // half h = 2 n - kRing (before the loop when that is negative) and read by the issues of
  // its K and V halves, at halves h + 1 and h + 2; the slot's previous tile was last read
  // at half h + 2 - 2 kLocTiles < h, its next one is stored at h + 2 kLocTiles > h + 2.
  constexpr int kFirstLocTiles = (kRing + 1) / 2;
  RowBytes loc_ahead = zero_row;  // threads tid < kBlockN: the next tile's rows to store
  if (tid < kBlockN) {
KVSTREAM_CUDA_UNROLL
    for (int n = 0; n < kFirstLocTiles; ++n) loc_smem[n * kBlockN + tid] = lookup(n, tid);
    loc_ahead = lookup(kFirstLocTiles, tid);
  }
  {
    // Q tile: row m is head first_head + m; rows past the group and columns past
    // head_size are zero. Element loads (16 rows, any alignment), all issued before the
    // first store: the stores go through a generic pointer that could alias q, so
    // interleaved they would wait for one load at a time.
    constexpr int kPerThread = kRows * D / kThreads;
    static_assert(kRows * D % kThreads == 0, "whole passes over the Q tile");
    const T* const q = static_cast<const T*>(p.q) +
                       static_cast<int64_t>(q_row) * p.q_token_stride +
                       static_cast<int64_t>(first_head) * p.q_head_stride;
    T values[kPerThread];
KVSTREAM_CUDA_UNROLL
    for (int k = 0; k < kPerThread; ++k) {
      const int i = tid + k * kThreads;
      const int m = i / D;
      const int d = i - m * D;
      values[k] = m < heads_here && d < head_size
                      ? q[static_cast<int64_t>(m) * p.q_head_stride + d]
                      : FromFloat<T>(0.0f);
    }
KVSTREAM_CUDA_UNROLL
    for (int k = 0; k < kPerThread; ++k) {
      const int i = tid + k * kThreads;
      const int m = i / D;
      const int d = i - m * D;
      *reinterpret_cast<T*>(q_smem + SwizzledChunk<D>(m, d >> 3) + (d & 7) * 2) = values[k];
    }
  }
  __syncthreads();

  // Issues the copies of half tile j (tile j / 2's K for even j, its V for odd j) into
  // ring slot j % kRing (16-bit tiles, or raw fp8 tiles). Columns past the head size are
  // copied as zeros (cp.async with no source bytes): a slot holds K and V in turn, and
  // their head sizes may differ. fp8_tag: std::true_type for raw fp8 tiles, so that the
  // loop bounds are constants.
  auto issue_half_as = [&](auto fp8_tag, int j) {
    constexpr bool kRaw = decltype(fp8_tag)::value;
    const bool is_v = (j & 1) != 0;
    const RowBytes* const locs = loc_smem + ((j >> 1) % Traits::kLocTiles) * kBlockN;
    // 16-byte chunks per row: D / 8 of T, or D / 16 of fp8. Up to 16 threads per row, so
    // that a warp's copies cover whole 256-byte row segments.
    constexpr int kChunks = kRaw ? D / 16 : D / 8;
    constexpr int kPerRow = kChunks < 16 ? kChunks : 16;
    constexpr int kRowsPerPass = kThreads / kPerRow;
    constexpr int kRowBytes = kRaw ? D : 2 * D;  // a tile row in shared memory
    static_assert(kRowsPerPass % 8 == 0, "a pass keeps each thread's row modulo 8");
    const int lrow = tid / kPerRow;
    const int lcol = tid % kPerRow;
    const int chunks = (is_v ? head_size_v : head_size) / (kRaw ? 16 : 8);
    // This thread's first chunk of a row.
    const uint8_t* const src =
        static_cast<const uint8_t*>(is_v ? p.v_cache : p.k_cache) + lcol * 16;
    const uint32_t slot_base =
        kv_base + (j % kRing) * (kRaw ? Traits::kRawTileBytes : Traits::kTileBytes);
KVSTREAM_CUDA_UNROLL
    for (int i = 0; i < kChunks / kPerRow; ++i) {
      const int c = lcol + i * kPerRow;
      // Row lrow of the tile; pass `pass` adds whole rows (the swizzle repeats every 8).
      const uint32_t dst0 =
          slot_base +
          (kRaw ? static_cast<uint32_t>(lrow * D + RawChunkInRow<D, kFp8InRegisters>(lrow, c))
                : SwizzledChunk<D>(lrow, c));
KVSTREAM_CUDA_UNROLL
      for (int pass = 0; pass < kBlockN / kRowsPerPass; ++pass) {
        const RowBytes loc = locs[lrow + pass * kRowsPerPass];
        CpAsync16EvictFirst(dst0 + pass * kRowsPerPass * kRowBytes,
                            src + (is_v ? loc.v : loc.k) + i * kPerRow * 16, c < chunks);
      }
    }
  };
  auto issue_half = [&](int j) {
    if (fp8) {
      issue_half_as(std::true_type(), j);
    } else {
      issue_half_as(std::false_type(), j);
    }
  };

  // fp8: converts the calling warp's 16 rows of the raw half tile j into its rows of the
  // one 16-bit tile (zeros past the head size). A warp computes on its own 16 keys only, so
  // no other warp reads these rows: the warp converts while the others compute, and a
  // __syncwarp, not a CTA barrier, orders the rows before its ldmatrix. Every chunk is
  // loaded before the first is converted (one round trip to shared memory, not one per
  // chunk).
  uint8_t* const conv_tile = kv_smem + kRing * Traits::kRawTileBytes;
  auto convert_raw = [&](int j) {
    constexpr int kRawChunks = D / 16;
    constexpr int kPerLane = 16 * kRawChunks / 32;
    static_assert(16 * kRawChunks % 32 == 0, "whole passes over the warp's rows");
    const uint8_t* const raw = kv_smem + (j % kRing) * Traits::kRawTileBytes;
    const int chunks = ((j & 1) != 0 ? head_size_v : head_size) / 16;
    uint4 codes[kPerLane];
KVSTREAM_CUDA_UNROLL
    for (int k = 0; k < kPerLane; ++k) {
      const int i = lane + 32 * k;
      const int r = 16 * warp + i / kRawChunks;
      codes[k] = *reinterpret_cast<const uint4*>(
          raw + r * D + RawChunkInRow<D, kFp8InRegisters>(r, i % kRawChunks));
    }
KVSTREAM_CUDA_UNROLL
    for (int k = 0; k < kPerLane; ++k) {
      const int i = lane + 32 * k;
      const int r = 16 * warp + i / kRawChunks;
      const int c = i % kRawChunks;
      uint32_t out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (c < chunks) Fp8ChunkTo<T>(codes[k], a.cache_kind == kCacheE4M3, out);
      // The 16-bit chunks 2c and 2c + 1, the odd one first where c % 8 >= 4: the 8 lanes
      // of a store's phase (D >= 128: one row, c % 8 = 0..7) then hit 8 different 16-byte
      // bank groups (chunk % 8 distinct), where even chunks first would pair c with c + 4.
      // (D = 64: a phase is c = 0..3 of two adjacent rows, whose swizzles differ in
      // parity, so their even chunks already land in different groups.)
      const int first = (c >> 2) & 1;
      *reinterpret_cast<uint4*>(conv_tile + SwizzledChunk<D>(r, 2 * c + first)) =
          first == 0 ? make_uint4(out[0], out[1], out[2], out[3])
                     : make_uint4(out[4], out[5], out[6], out[7]);
      *reinterpret_cast<uint4*>(conv_tile + SwizzledChunk<D>(r, 2 * c + 1 - first)) =
          first == 0 ? make_uint4(out[4], out[5], out[6], out[7])
                     : make_uint4(out[0], out[1], out[2], out[3]);
    }
    __syncwarp();
  };

  const int num_halves = 2 * num_tiles;
KVSTREAM_CUDA_UNROLL
  for (int j = 0; j < kRing - 1; ++j) {
    if (j < num_halves) issue_half(j);
    CpAsyncCommit();
  }

  // The start of half h: waits for its copies, issues half h + kRing - 1 into the slot the
  // previous half leaves, stores a tile's rows when due, converts fp8; returns the shared
  // address of half h's 16-bit tile (kFp8InRegisters: none, 0).
  const uint32_t conv_base = SmemAddress(conv_tile);
  auto begin_half = [&](int h) -> uint32_t {
    CpAsyncWaitGroup<kRing - 2>();
    __syncthreads();  // half h landed for every thread; half h - 1 is consumed
    if (h + kRing - 1 < num_halves) issue_half(h + kRing - 1);
    CpAsyncCommit();
    if (((h + kRing) & 1) == 0 && tid < kBlockN) {
      const int n = (h + kRing) >> 1;
      loc_smem[(n % Traits::kLocTiles) * kBlockN + tid] = loc_ahead;
      loc_ahead = lookup(n + 1, tid);
    }
    if constexpr (kFp8InRegisters) {
      return 0;  // read raw, converted in registers (raw_k_half, raw_v_half)
    } else {
      if (fp8) {
        convert_raw(h);
        return conv_base;
      }
      return kv_base + (h % kRing) * Traits::kTileBytes;
    }
  };

  // ---- Per-thread state. g = lane / 4, t = lane % 4. In the S^T tile of n8 block nt the
  // thread holds keys g and g + 8 of the warp's 16 (elements {0, 1} and {2, 3}) for heads
  // 8 nt + 2 t and + 1 (elements e % 2); in the O^T accumulators d = 16 dd + g (+ 8) of
  // the same heads. Every per-head value (max, sum, slope) is kept for those two heads.
  const int g = lane >> 2;
  const int quad_col = 2 * (lane & 3);  // 2 t
  const float k_scale = p.k_scale[p.num_scales == 1 ? 0 : kv_head];
  const float v_scale = p.v_scale[p.num_scales == 1 ? 0 : kv_head];
  const ScoreParams score_params = MakeScoreParams(p, k_scale, q_pos);
  float head_slope2[kNT][2];
  float head_max[kNT][2];
  float head_sum[kNT][2];
  float acc_o[kDSteps][kNT][4];
KVSTREAM_CUDA_UNROLL
  for (int nt = 0; nt < kNT; ++nt) {
KVSTREAM_CUDA_UNROLL
    for (int j = 0; j < 2; ++j) {
      const int m = 8 * nt + quad_col + j;
      head_slope2[nt][j] =
          score_params.alibi && m < heads_here ? p.alibi_slopes[first_head + m] * kLog2e : 0.0f;
      head_max[nt][j] = kNegInf;
      head_sum[nt][j] = 0.0f;
    }
KVSTREAM_CUDA_UNROLL
    for (int dd = 0; dd < kDSteps; ++dd) {
KVSTREAM_CUDA_UNROLL
      for (int e = 0; e < 4; ++e) acc_o[dd][nt][e] = 0.0f;
    }
  }

  // ldmatrix addresses. In a swizzled tile every row a lane addresses is lane % 8 modulo
  // 8, so logical chunk 2 kk + s of it sits at (kk / 4) * 128 + ((kk % 4) * 32 ^
  // ((lane % 8 ^ s) * 16)).
  //   K (A operand, keys x d): row lane % 16, chunk 2 kk + lane / 16.
  //   V (A operand V^T, d x keys, ldmatrix.trans): row lane % 8 + 8 (lane / 16), chunk
  //   2 dd + (lane / 8) % 2.
  //   Q (B operand, d x heads): kNT = 1: rows lane % 8, chunks 2 kk + lane / 8 (two k16
  //   steps per ldmatrix.x4); kNT = 2: row lane % 8 + 8 (lane / 16), chunk 2 kk +
  //   (lane / 8) % 2 (one step, both n8 blocks).
  const uint32_t swz_k = static_cast<uint32_t>(((lane & 7) ^ (lane >> 4)) << 4);
  const uint32_t swz_v = static_cast<uint32_t>(((lane & 7) ^ ((lane >> 3) & 1)) << 4);
  const uint32_t k_lane_off = static_cast<uint32_t>((16 * warp + (lane & 15)) * D * 2);
  const uint32_t v_lane_off =
      static_cast<uint32_t>((16 * warp + (lane & 7) + ((lane >> 4) << 3)) * D * 2);
  // Every k16 step of K Q^T and m16 block of V^T P^T runs, also those of padding columns
  // (head sizes below D): the padding of Q, K and V is zero, so they add exact zeros and
  // the loops keep constant bounds.
  constexpr int kBatch = 4;  // K / V fragments loaded ahead of their mma chains
  // Q^T fragments stay in registers unless D = 256 with two n8 blocks (64 registers that
  // the output accumulators need) or kFp8InRegisters (the converted K and V fragments need
  // them: with Q's kept the kernel spilled at D = 128); then they are read from shared
  // memory per step (kFp8InRegisters: q_permuted).
  constexpr bool kQInRegisters = !kFp8InRegisters && D * kNT <= 256;
  const uint32_t q_lane_addr =
      kNT == 1 ? q_base + static_cast<uint32_t>((lane & 7) * D * 2)
               : q_base + static_cast<uint32_t>(((lane & 7) + ((lane >> 4) << 3)) * D * 2);
  uint32_t q_frag[kQInRegisters ? kDSteps : 1][kNT][2];
  // kFp8InRegisters: Q's fragment of k16 step kk for n8 tile nt with the head dimension
  // permuted as raw_k_half reads K: step kk = 4 i + s of lane (g, quad) holds dims 16 (quad
  // + 4 i) + 4 s + {0, 1} (its first register) and + {2, 3} (its second), four dims in a
  // row of Q.
  auto q_permuted = [&](int kk, int nt) -> uint2 {
    const int dim = 16 * ((lane & 3) + 4 * (kk >> 2)) + 4 * (kk & 3);
    return *reinterpret_cast<const uint2*>(q_smem + SwizzledChunk<D>(8 * nt + g, dim >> 3) +
                                           (dim & 7) * 2);
  };
  if constexpr (kQInRegisters) {
    if constexpr (kNT == 1) {
KVSTREAM_CUDA_UNROLL
      for (int kk = 0; kk < kDSteps; kk += 2) {
        uint32_t r[4];
        LdMatrixX4(r, q_lane_addr + static_cast<uint32_t>((((2 * kk + (lane >> 3)) ^ (lane & 7))
                                                          << 4)));
        q_frag[kk][0][0] = r[0];
        q_frag[kk][0][1] = r[1];
        q_frag[kk + 1][0][0] = r[2];
        q_frag[kk + 1][0][1] = r[3];
      }
    } else {
KVSTREAM_CUDA_UNROLL
      for (int kk = 0; kk < kDSteps; ++kk) {
        uint32_t r[4];
        LdMatrixX4(r, q_lane_addr + (kk >> 2) * 128 + (swz_v ^ ((kk & 3) << 5)));
        q_frag[kk][0][0] = r[0];
        q_frag[kk][0][1] = r[1];
        q_frag[kk][kNT - 1][0] = r[2];
        q_frag[kk][kNT - 1][1] = r[3];
      }
    }
  }

  // kFp8InRegisters: chunk quad + 4 i of the calling lane's rows g and g + 8 of the warp's 16 in
  // raw half tile j (the fragment loads of raw_k_half and raw_v_half).
  auto load_raw_chunks = [&](int j, int i, uint4(&codes)[2]) {
    const uint8_t* const raw = kv_smem + (j % kRing) * Traits::kRawTileBytes;
KVSTREAM_CUDA_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const int r = 16 * warp + g + 8 * rh;
      codes[rh] = *reinterpret_cast<const uint4*>(
          raw + r * D + RawChunkInRow<D, true>(r, (lane & 3) + 4 * i));
    }
  };

  // kFp8InRegisters: S^T = K Q^T of the warp's 16 keys straight from raw half tile j. Lane (g,
  // quad) loads 16-byte chunks quad + 4 i of its rows g and g + 8 (every chunk before the first
  // conversion); word s of chunk i gives k16 step 4 i + s: its low pair the fragment's
  // columns 2 quad + {0, 1}, its high pair + 8 (the permutation of q_permuted). Even and odd
  // steps accumulate apart, as the ldmatrix path does.
  auto raw_k_half = [&](auto format_tag, int j, float(&acc_s)[kNT][4],
                        float(&acc_s_odd)[kNT][4]) {
    constexpr auto kFormat = static_cast<__nv_fp8_interpretation_t>(decltype(format_tag)::value);
    constexpr int kChunks = D / 64;  // per row and lane
    uint4 codes[kChunks][2];
KVSTREAM_CUDA_UNROLL
    for (int i = 0; i < kChunks; ++i) load_raw_chunks(j, i, codes[i]);
KVSTREAM_CUDA_UNROLL
    for (int i = 0; i < kChunks; ++i) {
      const uint32_t words[2][4] = {
          {codes[i][0].x, codes[i][0].y, codes[i][0].z, codes[i][0].w},
          {codes[i][1].x, codes[i][1].y, codes[i][1].z, codes[i][1].w}};
KVSTREAM_CUDA_UNROLL
      for (int s = 0; s < 4; ++s) {
        const int kk = 4 * i + s;
        const uint32_t ka[4] = {Fp8PairTo<T, kFormat>(words[0][s] & 0xffffu),
                                Fp8PairTo<T, kFormat>(words[1][s] & 0xffffu),
                                Fp8PairTo<T, kFormat>(words[0][s] >> 16),
                                Fp8PairTo<T, kFormat>(words[1][s] >> 16)};
KVSTREAM_CUDA_UNROLL
        for (int nt = 0; nt < kNT; ++nt) {
          float(&acc)[4] = (kk & 1) != 0 ? acc_s_odd[nt] : acc_s[nt];
          const uint2 four = q_permuted(kk, nt);
          Mma16816<T>(acc, ka, four.x, four.y);
        }
      }
    }
  };

  // kFp8InRegisters: O^T += V^T P^T straight from raw half tile j. Lane (g, quad) loads the chunks
  // of its rows g and g + 8 as raw_k_half does; pair p (dims 2 p, 2 p + 1 of a chunk) of
  // its row is entry (g, quad) of an 8 x 8 matrix (keys x dims) that movmatrix.trans turns
  // into a V^T fragment: rows g of dims 16 (g / 2 + 4 i) + 2 p + g % 2 (VDim), columns the
  // keys 2 quad, + 1 (+ 8 for row g + 8's matrices). Pairs p and p + 1 make the two m8
  // halves of m16 block dd = 4 i + p / 2.
  auto raw_v_half = [&](auto format_tag, int j, const uint32_t(&pb)[kNT][2]) {
    constexpr auto kFormat = static_cast<__nv_fp8_interpretation_t>(decltype(format_tag)::value);
    constexpr int kChunks = D / 64;  // per row and lane
KVSTREAM_CUDA_UNROLL
    for (int i = 0; i < kChunks; ++i) {  // a chunk at a time: the registers hold O^T
      uint4 codes[2];
      load_raw_chunks(j, i, codes);
      const uint32_t words[2][4] = {{codes[0].x, codes[0].y, codes[0].z, codes[0].w},
                                    {codes[1].x, codes[1].y, codes[1].z, codes[1].w}};
KVSTREAM_CUDA_UNROLL
      for (int w = 0; w < 4; ++w) {  // pairs 2 w and 2 w + 1: m16 block 4 i + w
        uint32_t va[4];
KVSTREAM_CUDA_UNROLL
        for (int rh = 0; rh < 2; ++rh) {
          va[2 * rh] = MovMatrixTrans(Fp8PairTo<T, kFormat>(words[rh][w] & 0xffffu));
          va[2 * rh + 1] = MovMatrixTrans(Fp8PairTo<T, kFormat>(words[rh][w] >> 16));
        }
KVSTREAM_CUDA_UNROLL
        for (int nt = 0; nt < kNT; ++nt) {
          Mma16816<T>(acc_o[4 * i + w][nt], va, pb[nt][0], pb[nt][1]);
        }
      }
    }
  };

  // ---- Main loop over key tiles: the K half, then the V half.
  uint32_t pb[kNT][2] = {};  // P^T of the warp's keys, from the K half to the V half
  for (int t = 0; t < num_tiles; ++t) {
    [[maybe_unused]] const uint32_t k_base = begin_half(2 * t);  // kFp8InRegisters: unused
    const int tile_lo = s_begin + t * kBlockN;
    // Warp-uniform: whether any of the warp's 16 keys exist.
    const bool warp_keys = 16 * warp < min(kBlockN, s_end - tile_lo);
    if (warp_keys) {
      // S^T = K Q^T for the warp's 16 keys, the even and the odd k16 steps in two
      // accumulators (two chains of dependent mmas half as long as one), added at the end.
      float acc_s[kNT][4];
      float acc_s_odd[kNT][4];
KVSTREAM_CUDA_UNROLL
      for (int nt = 0; nt < kNT; ++nt) {
KVSTREAM_CUDA_UNROLL
        for (int e = 0; e < 4; ++e) acc_s[nt][e] = acc_s_odd[nt][e] = 0.0f;
      }
      if constexpr (kFp8InRegisters) {
        if (a.cache_kind == kCacheE4M3) {
          raw_k_half(std::integral_constant<int, __NV_E4M3>(), 2 * t, acc_s, acc_s_odd);
        } else {
          raw_k_half(std::integral_constant<int, __NV_E5M2>(), 2 * t, acc_s, acc_s_odd);
        }
      } else {
KVSTREAM_CUDA_UNROLL
        for (int k0 = 0; k0 < kDSteps; k0 += kBatch) {
          uint32_t ka[kBatch][4];
          uint32_t qb[kQInRegisters ? 1 : kBatch][4];
KVSTREAM_CUDA_UNROLL
          for (int i = 0; i < kBatch; ++i) {
            const int kk = k0 + i;
            LdMatrixX4(ka[i], k_base + k_lane_off + (kk >> 2) * 128 + (swz_k ^ ((kk & 3) << 5)));
            if constexpr (!kQInRegisters) {
              LdMatrixX4(qb[i], q_lane_addr + (kk >> 2) * 128 + (swz_v ^ ((kk & 3) << 5)));
            }
          }
KVSTREAM_CUDA_UNROLL
          for (int i = 0; i < kBatch; ++i) {
            const int kk = k0 + i;
KVSTREAM_CUDA_UNROLL
            for (int nt = 0; nt < kNT; ++nt) {
              float(&acc)[4] = (kk & 1) != 0 ? acc_s_odd[nt] : acc_s[nt];
              if constexpr (kQInRegisters) {
                Mma16816<T>(acc, ka[i], q_frag[kQInRegisters ? kk : 0][nt][0],
                            q_frag[kQInRegisters ? kk : 0][nt][1]);
              } else {
                Mma16816<T>(acc, ka[i], qb[kQInRegisters ? 0 : i][2 * nt],
                            qb[kQInRegisters ? 0 : i][2 * nt + 1]);
              }
            }
          }
        }
      }
KVSTREAM_CUDA_UNROLL
      for (int nt = 0; nt < kNT; ++nt) {
KVSTREAM_CUDA_UNROLL
        for (int e = 0; e < 4; ++e) acc_s[nt][e] += acc_s_odd[nt][e];
      }

      // Logits in base 2 (soft cap, ALiBi, the end of the split), then the online softmax
      // (decode_softmax.cuh).
      const int key0 = tile_lo + 16 * warp + g;  // key of acc_s[.][0] and [1]; [2], [3]: + 8
      ToBase2Logits<kNT>(acc_s, score_params, head_slope2, key0, s_begin, s_end);
      OnlineSoftmaxStep<kNT, kDSteps>(acc_s, head_max, head_sum, acc_o);

      // P^T's accumulator holds (key, head) where the B fragment of O^T += V^T P^T wants
      // (head, key): each 8 x 8 half is transposed in registers.
KVSTREAM_CUDA_UNROLL
      for (int nt = 0; nt < kNT; ++nt) {
        pb[nt][0] = MovMatrixTrans(PackPair<T>(acc_s[nt][0], acc_s[nt][1]));
        pb[nt][1] = MovMatrixTrans(PackPair<T>(acc_s[nt][2], acc_s[nt][3]));
      }
    }  // warp_keys

    [[maybe_unused]] const uint32_t v_base = begin_half(2 * t + 1);  // kFp8InRegisters: unused
    if (!warp_keys) continue;
    // O^T += V^T P^T.
    if constexpr (kFp8InRegisters) {
      if (a.cache_kind == kCacheE4M3) {
        raw_v_half(std::integral_constant<int, __NV_E4M3>(), 2 * t + 1, pb);
      } else {
        raw_v_half(std::integral_constant<int, __NV_E5M2>(), 2 * t + 1, pb);
      }
    } else {
KVSTREAM_CUDA_UNROLL
      for (int d0 = 0; d0 < kDSteps; d0 += kBatch) {
        uint32_t va[kBatch][4];
KVSTREAM_CUDA_UNROLL
        for (int i = 0; i < kBatch; ++i) {
          const int dd = d0 + i;
          LdMatrixX4Trans(va[i],
                          v_base + v_lane_off + (dd >> 2) * 128 + (swz_v ^ ((dd & 3) << 5)));
        }
KVSTREAM_CUDA_UNROLL
        for (int i = 0; i < kBatch; ++i) {
KVSTREAM_CUDA_UNROLL
          for (int nt = 0; nt < kNT; ++nt) {
            Mma16816<T>(acc_o[d0 + i][nt], va[i], pb[nt][0], pb[nt][1]);
          }
        }
      }
    }
  }
  CpAsyncWaitGroup<0>();  // only empty groups are pending; shared memory is reused below
  __syncthreads();

  // ---- The warps' partial results through shared memory:
  //   red [kWarps][kRows][D] floats, ml [kWarps][kRows][2] (max, sum).
  float* const red = reinterpret_cast<float*>(smem);
  float* const ml = red + Traits::kWarps * kRows * D;
KVSTREAM_CUDA_UNROLL
  for (int nt = 0; nt < kNT; ++nt) {
KVSTREAM_CUDA_UNROLL
    for (int j = 0; j < 2; ++j) {
      float sum = head_sum[nt][j];
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      sum += __shfl_xor_sync(0xffffffffu, sum, 8);
      sum += __shfl_xor_sync(0xffffffffu, sum, 16);
      const int m = 8 * nt + quad_col + j;
      float* const row = red + (warp * kRows + m) * D;
KVSTREAM_CUDA_UNROLL
      for (int dd = 0; dd < kDSteps; ++dd) {
        if constexpr (kFp8InRegisters) {
          // raw_v_half's rows: dims 16 (g / 2 + 4 (dd / 4)) + 4 (dd % 4) + g % 2, and + 2.
          const int dim = 16 * ((g >> 1) + 4 * (dd >> 2)) + 4 * (dd & 3) + (g & 1);
          row[dim] = acc_o[dd][nt][j];
          row[dim + 2] = acc_o[dd][nt][j + 2];
        } else {
          row[16 * dd + g] = acc_o[dd][nt][j];
          row[16 * dd + g + 8] = acc_o[dd][nt][j + 2];
        }
      }
      if (g == 0) {
        ml[(warp * kRows + m) * 2] = head_max[nt][j];
        ml[(warp * kRows + m) * 2 + 1] = sum;
      }
    }
  }
  __syncthreads();

  T* const out = static_cast<T*>(p.out);
  for (int idx = tid; idx < heads_here * head_size_v; idx += kThreads) {
    const int m = idx / head_size_v;
    const int d = idx - m * head_size_v;
    float big = kNegInf;
KVSTREAM_CUDA_UNROLL
    for (int w = 0; w < Traits::kWarps; ++w) big = fmaxf(big, ml[(w * kRows + m) * 2]);
    float sum = 0.0f;
    float o = 0.0f;
KVSTREAM_CUDA_UNROLL
    for (int w = 0; w < Traits::kWarps; ++w) {
      const float mw = ml[(w * kRows + m) * 2];
      if (mw != kNegInf) {
        const float f = FastExp2(mw - big);
        sum = fmaf(ml[(w * kRows + m) * 2 + 1], f, sum);
        o = fmaf(red[(w * kRows + m) * D + d], f, o);
      }
    }
    const int h = first_head + m;
    if (a.num_splits == 1) {
      const float value = sum > 0.0f ? o / sum * v_scale : 0.0f;
      out[static_cast<int64_t>(q_row) * p.o_token_stride +
          static_cast<int64_t>(h) * p.o_head_stride + d] = FromFloat<T>(value);
    } else {
      const int64_t slot = (static_cast<int64_t>(seq) * p.num_heads + h) * a.num_splits + split;
      a.partial_out[slot * head_size_v + d] = o;
      if (d == 0) {
        a.partial_ml[slot * 2] = big;
        a.partial_ml[slot * 2 + 1] = sum;
      }
    }
  }
}

}  // namespace decode_tc
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_DECODE_TC_ATTENTION_CUH_
