// kvsum64 (kvstream/cache/layer_checksum.h) on the GPU: the kernel, its params struct, and
// the layout of the span table the host stages for it. Above `#if defined(__CUDACC__)`
// everything is plain C++ as well: the arithmetic (shared with Kvsum64Host), the table
// writer (the launcher's), and the kernel's per-thread work as a template over its loads,
// so that the unit tests run exactly the kernel's indexing on the host (HostLoads), thread
// by thread, where no GPU is present.
//
// Work split. B's words are cut into chunks of kChunkWords (32 KiB); a persistent grid
// (the CTAs resident on the device, at most one per chunk) takes chunks in turn. A word is
// owned by the span holding its first byte; the host writes, for each chunk, the index of
// the span holding the chunk's first byte (chunk_first_span), so a CTA walks from there the
// spans that start inside its chunk, with no search. Inside one (span, chunk) part every
// thread takes its share of the words:
//   * a span whose words sit at 8-byte aligned addresses (address - start is a multiple of
//     8: every cudaMalloc'ed block run at a word-aligned position of B) is read with
//     16-byte loads (two words each), after one 8-byte load where the first word is not
//     16-byte aligned and before one for an odd last word;
//   * any other span is read word by word, each word funnel-shifted out of the two aligned
//     8-byte words it straddles (loads never touch an aligned word holding none of the
//     span's bytes, so they stay inside the allocation);
//   * the span's last word, when the span ends inside it, is assembled byte by byte by one
//     thread from this span and the following ones (up to 7 more bytes; zero past N).
// Items are dealt to threads round robin across the spans of a chunk (`rot`), so that
// chunks of many short spans still keep every thread busy.
// Reduction: per thread a 64-bit sum, then the CTA's sum (warp shuffles, shared memory),
// added by one atomic into the table header's 64-bit sum; then a ticket from the header's
// done counter: the CTA that draws the last one reads the sum and writes Mix(sum ^ N) to
// the result. Two atomics per CTA, no second launch, and nothing to reset: each call has
// its own header, which the host zeroes in the same copy as the table.
#ifndef KVSTREAM_CACHE_CUDA_LAYER_CHECKSUM_CUH_
#define KVSTREAM_CACHE_CUDA_LAYER_CHECKSUM_CUH_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/types/span.h"
#include "kvstream/cache/layer_checksum.h"

#if defined(__CUDACC__)
#define KVSTREAM_KVSUM_HD __host__ __device__ __forceinline__
#define KVSTREAM_KVSUM_UNROLL _Pragma("unroll")
#else
#define KVSTREAM_KVSUM_HD inline
#define KVSTREAM_KVSUM_UNROLL
#endif

namespace kvstream {
namespace internal {
namespace kvsum64 {

inline constexpr uint64_t kWeyl = 0x9E3779B97F4A7C15ull;  // 2^64 / golden ratio, odd

// The splitmix64 finaliser: a bijection of 64-bit words with full avalanche.
KVSTREAM_KVSUM_HD uint64_t Mix(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z;
}

// The summand of word `index` (0-based position in B) whose value is `word`.
KVSTREAM_KVSUM_HD uint64_t Term(uint64_t word, uint64_t index) {
  return Mix(word + (index + 1) * kWeyl);
}

// kvsum64 from the sum of the terms and N.
KVSTREAM_KVSUM_HD uint64_t Finish(uint64_t sum, uint64_t total_bytes) {
  return Mix(sum ^ total_bytes);
}

inline constexpr int kThreads = 256;           // per CTA
inline constexpr uint64_t kChunkWords = 4096;  // 32 KiB of B per chunk
inline constexpr uint64_t kChunkBytes = kChunkWords * 8;

// The table one call stages (host layout = device layout), each piece 16-byte aligned:
//   TableHeader                               zeroed: the sum and the CTAs' done counter
//   SpanEntry spans[num_spans]                the non-empty spans, in order
//   uint32_t chunk_first_span[num_chunks]     the span holding byte chunk * kChunkBytes
struct TableHeader {
  uint64_t sum;        // the CTAs' sums, added atomically
  uint32_t done_ctas;  // CTAs that have added theirs
  uint32_t unused;
};
struct SpanEntry {
  uint64_t address;  // device address of the span's first byte
  uint64_t start;    // its offset in B; the span ends where the next starts (last: at N)
};
static_assert(sizeof(TableHeader) == 16 && sizeof(SpanEntry) == 16, "table layout");

inline constexpr size_t RoundUp16(size_t x) { return (x + 15) & ~size_t{15}; }

struct TableLayout {
  size_t spans_offset = 0;
  size_t map_offset = 0;
  size_t bytes = 0;  // all of it, rounded up to 16: what the host writes and copies
};

inline TableLayout LayoutFor(size_t num_spans, uint64_t num_chunks) {
  TableLayout t;
  t.spans_offset = sizeof(TableHeader);
  t.map_offset = t.spans_offset + num_spans * sizeof(SpanEntry);
  t.bytes = RoundUp16(t.map_offset + static_cast<size_t>(num_chunks) * 4);
  return t;
}

inline constexpr uint64_t NumChunks(uint64_t total_bytes) {
  return ((total_bytes + 7) / 8 + kChunkWords - 1) / kChunkWords;
}

// Everything the kernel reads, by value. Pointers are device pointers into one staged
// table (TableLayout) except `result`, which is device memory or mapped pinned host memory.
struct KernelParams {
  const SpanEntry* spans;            // [num_spans]
  const uint32_t* chunk_first_span;  // [num_chunks]
  TableHeader* header;
  uint64_t* result;
  uint64_t num_spans;
  uint64_t total_bytes;  // N
  uint64_t num_chunks;   // NumChunks(N)
};

KVSTREAM_KVSUM_HD uint64_t MinU64(uint64_t a, uint64_t b) { return a < b ? a : b; }
KVSTREAM_KVSUM_HD uint64_t MaxU64(uint64_t a, uint64_t b) { return a > b ? a : b; }

struct WordPair {
  uint64_t x, y;  // the words at address and address + 8
};

// How the code below reads memory: the kernel's loads (DeviceLoads, read-only cache path)
// or plain host reads (HostLoads: the unit tests run the kernel's per-thread code on the
// host over host memory, thread by thread).
struct HostLoads {
  static uint64_t Word(uint64_t address) {  // REQUIRES: 8-byte aligned
    uint64_t w;
    std::memcpy(&w, reinterpret_cast<const void*>(address), 8);
    return w;
  }
  static WordPair Pair(uint64_t address) {  // REQUIRES: 16-byte aligned
    return WordPair{Word(address), Word(address + 8)};
  }
  static uint64_t Byte(uint64_t address) { return *reinterpret_cast<const uint8_t*>(address); }
};

// The word at `address` (not 8-byte aligned): the two aligned words it straddles, both
// holding some of its bytes, funnel-shifted. Loads never touch an aligned word holding
// none of the wanted bytes, so they stay inside the allocation.
template <typename Loads>
KVSTREAM_KVSUM_HD uint64_t UnalignedWord(uint64_t address) {
  const uint64_t aligned = address & ~uint64_t{7};
  const unsigned shift = static_cast<unsigned>(address & 7) * 8;  // 8 .. 56
  return (Loads::Word(aligned) >> shift) | (Loads::Word(aligned + 8) << (64 - shift));
}

// Word `word` of B, which starts inside span `i` (whose bytes up to `end` lie at base +
// offset in B) and runs past the span's end: the rest from the following spans, zero past
// N. One thread.
template <typename Loads>
KVSTREAM_KVSUM_HD uint64_t TailWord(const KernelParams& p, uint64_t i, uint64_t base, uint64_t end,
                                    uint64_t word) {
  const uint64_t first = word * 8;
  const uint64_t last = MinU64(first + 8, p.total_bytes);  // bytes [first, last) exist
  uint64_t w = 0;
  for (uint64_t b = first; b < end; ++b) w |= Loads::Byte(base + b) << ((b - first) * 8);
  uint64_t at = end;
  for (uint64_t k = i + 1; at < last && k < p.num_spans; ++k) {
    const SpanEntry s = p.spans[k];
    const uint64_t s_end = k + 1 < p.num_spans ? p.spans[k + 1].start : p.total_bytes;
    const uint64_t s_base = s.address - s.start;
    const uint64_t stop = MinU64(s_end, last);
    for (uint64_t b = s.start; b < stop; ++b) w |= Loads::Byte(s_base + b) << ((b - first) * 8);
    at = s_end;
  }
  return w;
}

// The sum of this thread's terms for the words span `i` ([start, end) of B, byte b at
// base + b) owns in chunk words [cw0, cw1). The part's items (16-byte pairs, or words,
// then up to three single words) are dealt round robin: this thread takes items `mine`,
// mine + kThreads, ...; *items is how many the part had, by which the caller turns the
// deal for the next part.
template <typename Loads>
KVSTREAM_KVSUM_HD uint64_t SumSpanPart(const KernelParams& p, uint64_t i, uint64_t base,
                                       uint64_t start, uint64_t end, uint64_t cw0, uint64_t cw1,
                                       uint32_t mine, uint64_t* items) {
  const uint64_t ja = MaxU64(cw0, (start + 7) >> 3);  // first word whose first byte is ours
  const uint64_t jo = MinU64(cw1, (end + 7) >> 3);    // past the last such word in the chunk
  *items = 0;
  if (ja >= jo) return 0;
  const uint64_t jf = MinU64(jo, end >> 3);  // past the last word entirely inside the span
  const bool tail = (end & 7) != 0 && (end >> 3) < jo;
  constexpr uint64_t kMask = kThreads - 1;
  uint64_t acc = 0;
  if ((base & 7) == 0) {
    const uint64_t lead = (ja < jf && ((base + ja * 8) & 15) != 0) ? 1 : 0;
    const uint64_t j0 = ja + lead;  // first word of the first 16-byte aligned pair
    const uint64_t n = jf > j0 ? jf - j0 : 0;
    const uint64_t pairs = n >> 1;
    const uint64_t pair_base = base + j0 * 8;
    uint64_t k = mine;
    // Four independent 16-byte loads in flight per thread before any is mixed.
    for (; k + 3 * kThreads < pairs; k += 4 * kThreads) {
      WordPair v[4];
      KVSTREAM_KVSUM_UNROLL
      for (int u = 0; u < 4; ++u) v[u] = Loads::Pair(pair_base + (k + u * kThreads) * 16);
      KVSTREAM_KVSUM_UNROLL
      for (int u = 0; u < 4; ++u) {
        const uint64_t t = (j0 + 2 * (k + u * kThreads) + 1) * kWeyl;
        acc += Mix(v[u].x + t) + Mix(v[u].y + t + kWeyl);
      }
    }
    for (; k < pairs; k += kThreads) {
      const WordPair v = Loads::Pair(pair_base + k * 16);
      const uint64_t t = (j0 + 2 * k + 1) * kWeyl;
      acc += Mix(v.x + t) + Mix(v.y + t + kWeyl);
    }
    // Items pairs, pairs + 1, pairs + 2: the lead word, an odd last word, the tail word.
    if (lead != 0 && (pairs & kMask) == mine) acc += Term(Loads::Word(base + ja * 8), ja);
    if ((n & 1) != 0 && ((pairs + 1) & kMask) == mine) {
      acc += Term(Loads::Word(base + (jf - 1) * 8), jf - 1);
    }
    if (tail && ((pairs + 2) & kMask) == mine) {
      acc += Term(TailWord<Loads>(p, i, base, end, end >> 3), end >> 3);
    }
    *items = pairs + 3;
    return acc;
  }
  const uint64_t n = jf - ja;
  uint64_t k = mine;
  for (; k + 3 * kThreads < n; k += 4 * kThreads) {
    uint64_t w[4];
    KVSTREAM_KVSUM_UNROLL
    for (int u = 0; u < 4; ++u) w[u] = UnalignedWord<Loads>(base + (ja + k + u * kThreads) * 8);
    KVSTREAM_KVSUM_UNROLL
    for (int u = 0; u < 4; ++u) acc += Term(w[u], ja + k + u * kThreads);
  }
  for (; k < n; k += kThreads) acc += Term(UnalignedWord<Loads>(base + (ja + k) * 8), ja + k);
  if (tail && (n & kMask) == mine) {
    acc += Term(TailWord<Loads>(p, i, base, end, end >> 3), end >> 3);
  }
  *items = n + 1;
  return acc;
}

// The sum of the terms thread `thread` of CTA `cta` (of `num_ctas`) contributes: chunks
// cta, cta + num_ctas, ..., in each the parts of the spans that start before the chunk's
// end, from chunk_first_span on. The terms of all threads of all CTAs add up to kvsum64's
// sum, each word counted once.
template <typename Loads>
KVSTREAM_KVSUM_HD uint64_t ThreadSum(const KernelParams& p, uint64_t cta, uint64_t num_ctas,
                                     uint32_t thread) {
  const uint64_t num_words = (p.total_bytes + 7) >> 3;
  uint64_t acc = 0;
  uint32_t rot = 0;  // the thread that takes the next item of the chunk
  for (uint64_t c = cta; c < p.num_chunks; c += num_ctas) {
    const uint64_t cw0 = c * kChunkWords;
    const uint64_t cw1 = MinU64(cw0 + kChunkWords, num_words);
    uint64_t i = p.chunk_first_span[c];
    SpanEntry e = p.spans[i];
    while (true) {
      const bool more = i + 1 < p.num_spans;
      const SpanEntry next = more ? p.spans[i + 1] : SpanEntry{0, p.total_bytes};
      const uint32_t mine = (thread - rot) & (kThreads - 1);
      uint64_t items = 0;
      acc += SumSpanPart<Loads>(p, i, e.address - e.start, e.start, next.start, cw0, cw1, mine,
                                &items);
      rot = static_cast<uint32_t>((rot + items) & (kThreads - 1));
      if (!more || next.start >= cw1 * 8) break;
      e = next;
      ++i;
    }
  }
  return acc;
}

// Writes the table of `spans` (the non-empty ones: `num_spans`, `total_bytes` in all) at
// `table` in `layout` (header, span entries, chunk map). The entries'
// addresses are the spans' pointers as they are.
inline void WriteTable(absl::Span<const ChecksumSpan> spans, const TableLayout& layout,
                       uint64_t total_bytes, uint8_t* table) {
  std::memset(table, 0, sizeof(TableHeader));
  auto* const entries = reinterpret_cast<SpanEntry*>(table + layout.spans_offset);
  auto* const map = reinterpret_cast<uint32_t*>(table + layout.map_offset);
  const uint64_t chunks = NumChunks(total_bytes);
  uint64_t offset = 0;
  uint64_t next_chunk = 0;
  uint32_t index = 0;
  for (const ChecksumSpan& s : spans) {
    if (s.length == 0) continue;
    entries[index] = SpanEntry{reinterpret_cast<uint64_t>(s.data), offset};
    offset += s.length;
    for (; next_chunk < chunks && next_chunk * kChunkBytes < offset; ++next_chunk) {
      map[next_chunk] = index;
    }
    ++index;
  }
}

#if defined(__CUDACC__)

struct DeviceLoads {
  static __device__ __forceinline__ uint64_t Word(uint64_t address) {
    return __ldg(reinterpret_cast<const unsigned long long*>(address));
  }
  static __device__ __forceinline__ WordPair Pair(uint64_t address) {
    const ulonglong2 v = __ldg(reinterpret_cast<const ulonglong2*>(address));
    return WordPair{v.x, v.y};
  }
  static __device__ __forceinline__ uint64_t Byte(uint64_t address) {
    return __ldg(reinterpret_cast<const unsigned char*>(address));
  }
};

__device__ __forceinline__ uint64_t WarpSum(uint64_t x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// kvsum64 of the staged spans into *p.result. Grid: any number of CTAs of kThreads (at most
// num_chunks unless num_chunks is 0, then one), each taking chunks blockIdx.x,
// blockIdx.x + gridDim.x, ...
__global__ void __launch_bounds__(kThreads) Kvsum64Kernel(const KernelParams p) {
  __shared__ uint64_t warp_sums[kThreads / 32];
  const uint64_t acc = WarpSum(ThreadSum<DeviceLoads>(p, blockIdx.x, gridDim.x, threadIdx.x));
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x != 0) return;
  uint64_t cta_sum = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) cta_sum += warp_sums[w];
  auto* const sum = reinterpret_cast<unsigned long long*>(&p.header->sum);
  atomicAdd(sum, static_cast<unsigned long long>(cta_sum));
  __threadfence();  // the add is performed before the ticket is taken
  if (atomicAdd(&p.header->done_ctas, 1u) != gridDim.x - 1) return;
  __threadfence();  // every other CTA's add, fenced before its ticket, is seen
  *p.result = Finish(atomicAdd(sum, 0ull), p.total_bytes);
}

#endif  // defined(__CUDACC__)

}  // namespace kvsum64
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CACHE_CUDA_LAYER_CHECKSUM_CUH_
