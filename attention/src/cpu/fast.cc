// The CPU fast path of paged attention, RunAttentionCpu (semantics in backend.h; the
// reference in reference.cc is what it must agree with).
//
// Work is split into items (sequence, KV head, tile of query tokens). An item gathers the
// query rows of every head of its GQA group for its tokens (rows = tokens x group), then
// walks the block table in tiles of kKeyTile keys: each K and V tile is dequantised to
// float once and used by all rows, scores go through an online softmax (running max and
// sum, earlier output rescaled), and only tiles that some row can see are visited
// (causal: none past the item's last query; sliding window: none wholly before its first).
//
// Two shapes of item, chosen by row count, with the same arithmetic per row:
//   wide (prefill: up to kTargetRows rows)       narrow (decode, short chunks: <= 16 rows)
//   q_t     [ldk][rp]       Q^T, rows padded     q_rows  [rows][ldk]     Q
//   k_rows  [kKeyTile][ldk] K tile               kt      [ldk][kKeyTile] K tile transposed
//   scores  [kKeyTile][rp]  S^T = K * Q^T        s_rows  [rows][kKeyTile] S = Q * K^T
//   v_rows  [kKeyTile][ldv] V tile; out [rows][ldv] += P * V (both shapes)
// All products are "broadcast one operand, stream the other" register-blocked loops
// (MicroKernel). Wide items stream Q^T across rows; narrow ones stream K^T across keys,
// since a padded Q^T would leave most of each vector idle. Softmax statistics run across
// rows (wide) or across keys (narrow).
//
// BATCH INVARIANCE. The bits of a query row's output depend only on that row's query, its
// sequence's keys and values, and the layer's parameters: not on which other rows (tokens
// of the same sequence, other heads, other sequences) share its call or its item, on the
// thread count, or on decode versus prefill. Disaggregated serving depends on it: the
// decode worker computes the last prompt token as a 1-token query over the transferred
// cache and must match, bit for bit, the colocated run that computed the same token as a
// row of the whole-prompt prefill. It holds because a row's numbers come from one fixed
// sequence of float operations on its own data, whichever shape of item it lands in:
//   - a score is one chain of multiply-adds over d = 0 .. head_size-1 in order, in its own
//     MicroKernel accumulator (k * q in a wide item, q * k in a narrow one: the same
//     product); MulAdd makes every instantiation, whatever its blocking, use the same
//     operation (an explicit fma where the variant has one), and a chain split into
//     chunks only stores and reloads its accumulator;
//   - KV tiles are aligned to position 0 (tile t holds keys t*kKeyTile ..), whatever the
//     item's first query, so a row meets each key in the same tile with the same others;
//   - scores are transformed (cap, ALiBi, mask) by TransformScore and exponentiated by
//     ExpNonPositive, the running max and rescale factor come from OnlineStep, and a
//     row's exponentials are summed in key order, in both shapes (the same inline code,
//     which the compiler contracts alike; the tests hold both shapes to the same bits);
//     a key the row cannot see scores -inf and adds exactly +0, so a tile that ends at
//     the row (decode) and one that goes on (prefill) sum alike;
//   - a tile a row cannot see at all changes nothing for it (alpha = exp(0) = 1 exactly,
//     p = +0), so visiting it (because other rows of the item see it) is as good as
//     skipping it;
//   - O += P * V adds a tile's keys in order per (row, column); keys beyond the row's
//     range add p * v = +-0, which can change only the sign of an exact zero, so the store
//     adds +0.0f (-0 becomes +0, nothing else changes). V must be finite: 0 * inf is NaN.
// The guarantee is per build and instruction-set variant: the variants' vector code
// differs (the generic one has no fma), so they agree with the reference, not bit for bit
// with each other. A variant is picked per machine, so the workers of one machine agree.
//
// Decode reads every byte of K and V once, from blocks scattered over memory, so the row
// addresses of the next tile are computed ahead and prefetched while the current tile is
// computed, a key at a time at points spread over the tile (TilePrefetcher).
//
// The same C++ is compiled three times (generic, AVX2, AVX-512) through target attributes
// and picked at run time, because the library is built for a baseline x86-64 and these
// loops are worth 4-8x more with wide vectors. The transposes use intrinsics (8x8 and
// 16x16 register transposes, the conversion from 16-bit K fused into the loads): as
// plain loops they compile to scalar stores.
//
// Where the pieces are: fast_problem.h (tile geometry, Problem, WorkItem, Scratch),
// fast_prefetch.h, fast_gather.h (conversions into float rows), fast_gemm.h (the
// products), fast_transpose.h and fast_variants.h (the per-instruction-set configs),
// fast_softmax.h, fast_item.cc (ProcessItem and its variants); this file splits a call
// into items and runs them.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/numeric.h"
#include "kvstream/common/status_macros.h"
#include "cpu/fast_internal.h"
#include "cpu/fast_item.h"
#include "cpu/fast_problem.h"
#include "cpu/fast_target.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace kvstream {
namespace internal {
namespace {

using cpu_fast::ItemFn;
using cpu_fast::ItemFunction;
using cpu_fast::kLanes;
using cpu_fast::kTargetRows;
using cpu_fast::Problem;
using cpu_fast::RoundUp;
using cpu_fast::Scratch;
using cpu_fast::WorkItem;

// Below this many multiply-adds a call runs on the calling thread: waking a team costs
// more than it saves.
constexpr int64_t kMinParallelWork = int64_t{1} << 21;

bool CpuSupports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kGeneric:
      return true;
#if KVSTREAM_X86_DISPATCH
    case CpuIsa::kAvx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("bmi2");
    case CpuIsa::kAvx512:
      __builtin_cpu_init();
      return CpuSupports(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq");
#endif
    default:
      return false;
  }
}

const float* Fp8Table(DType dtype) {
  struct Tables {
    float e4m3[256];
    float e5m2[256];
    Tables() {
      for (int b = 0; b < 256; ++b) {
        e4m3[b] = Fp8E4M3ToFloat(static_cast<uint8_t>(b));
        e5m2[b] = Fp8E5M2ToFloat(static_cast<uint8_t>(b));
      }
    }
  };
  static const Tables* const tables = new Tables();
  if (dtype == DType::kFloat8E4M3) return tables->e4m3;
  if (dtype == DType::kFloat8E5M2) return tables->e5m2;
  return nullptr;
}

}  // namespace

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kGeneric: return "generic";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

std::vector<CpuIsa> SupportedCpuIsas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (CpuSupports(isa)) isas.push_back(isa);
  }
  return isas;
}

absl::Status RunAttentionCpuWith(const PagedAttentionParams& p, CpuIsa isa, int num_threads) {
  RETURN_IF_ERROR(ValidatePagedAttention(p));
  if (p.cache.memory == MemoryKind::kDevice) {
    return absl::InvalidArgumentError("paged attention: the cpu backend needs a host cache");
  }
  if (!CpuSupports(isa)) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: this CPU cannot run the ", CpuIsaName(isa), " variant"));
  }

  Problem pb;
  pb.p = &p;
  pb.head_size = p.cache.spec.head_size;
  pb.head_size_v = p.cache.spec.head_size_v;
  pb.ldk = RoundUp(pb.head_size, kLanes);
  pb.ldv = RoundUp(pb.head_size_v, kLanes);
  pb.group = p.num_heads / p.cache.spec.num_kv_heads;
  pb.block_size = p.cache.spec.block_size;
  pb.tile_tokens = std::max(1, kTargetRows / pb.group);
  pb.cap = p.logits_soft_cap > 0 ? p.logits_soft_cap : 0.0f;
  pb.inv_cap = pb.cap > 0 ? 1.0f / pb.cap : 0.0f;
  pb.fp8_table = Fp8Table(p.cache.spec.dtype);
  pb.cache_elem = static_cast<int64_t>(DTypeSize(p.cache.spec.dtype));

  // Work items, the most expensive first so that dynamic scheduling ends evenly.
  std::vector<WorkItem> items;
  int64_t total_cost = 0;
  int max_tokens = 1;
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const int32_t query_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    const int64_t seq_len = p.seq_lens[s];
    for (int32_t t = 0; t < query_len; t += pb.tile_tokens) {
      const int32_t count = std::min(pb.tile_tokens, query_len - t);
      max_tokens = std::max(max_tokens, count);
      const int64_t last_pos = seq_len - query_len + t + count - 1;
      int64_t keys = p.causal ? last_pos + 1 : seq_len;
      if (p.sliding_window > 0) keys = std::min<int64_t>(keys, int64_t{p.sliding_window} + count);
      const int64_t cost = int64_t{count} * pb.group * keys * (pb.head_size + pb.head_size_v);
      for (int32_t g = 0; g < p.cache.spec.num_kv_heads; ++g) {
        items.push_back(WorkItem{s, g, t, count, cost});
        total_cost += cost;
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  pb.max_rows = max_tokens * pb.group;
  pb.max_rows_padded = RoundUp(pb.max_rows, kLanes);

  // An explicit thread count is taken as given (tests use it to put small calls on a team).
  int threads = 1;
#ifdef _OPENMP
  threads = num_threads > 0 ? num_threads : omp_get_max_threads();
#endif
  if (num_threads <= 0 && total_cost < kMinParallelWork) threads = 1;
  threads = static_cast<int>(std::min<int64_t>(threads, static_cast<int64_t>(items.size())));
  threads = std::max(threads, 1);

  std::vector<Scratch> scratch(static_cast<size_t>(threads));
  for (Scratch& sc : scratch) {
    if (!sc.Allocate(pb)) {
      return absl::ResourceExhaustedError("paged attention: cannot allocate cpu scratch buffers");
    }
  }
  const ItemFn fn = ItemFunction(isa);
  const int64_t num_items = static_cast<int64_t>(items.size());
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < num_items; ++i) {
      fn(pb, items[static_cast<size_t>(i)], scratch[static_cast<size_t>(omp_get_thread_num())]);
    }
    return absl::OkStatus();
  }
#endif
  for (int64_t i = 0; i < num_items; ++i) fn(pb, items[static_cast<size_t>(i)], scratch[0]);
  return absl::OkStatus();
}

}  // namespace internal

absl::Status RunAttentionCpu(const PagedAttentionParams& params) {
  const std::vector<internal::CpuIsa> isas = internal::SupportedCpuIsas();
  return internal::RunAttentionCpuWith(params, isas.back(), /*num_threads=*/0);
}

}  // namespace kvstream
