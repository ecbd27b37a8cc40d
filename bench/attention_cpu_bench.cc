// CPU paged-attention benchmark: the fast path (RunAttentionCpu) on a prefill shape and a
// decode shape, next to OpenBLAS sgemm on matrices of the same sizes measured in the same
// run, which stands for what this machine can practically do. Prints a table at the end:
// shape, kvstream GFLOP/s, sgemm GFLOP/s, their ratio, and for decode (bound by memory
// bandwidth, not by flops) the KV bytes read per second next to the machine's sequential
// read bandwidth, measured in the same run.
//
//   kvstream_bench_attention_cpu                       # everything, table at the end
//   kvstream_bench_attention_cpu --benchmark_repetitions=3   # table keeps the best run
//   kvstream_bench_attention_cpu --benchmark_filter='shape:1'   # decode only
//
// FLOPs: every multiply-add counts 2. Attention does, per query head and visible (query,
// key) pair, head_size multiply-adds for QK^T and head_size_v for PV; causal prefill counts
// only the visible (lower) triangle. sgemm computes the full products it is given:
//   prefill: per query head, S = Q K^T (M = tokens, N = keys, K = head_size) and
//            O = S V (M = tokens, N = head_size, K = keys): the full square, 2x the causal work;
//   decode:  per (sequence, KV head), the GQA group's queries against that head's keys,
//            S = Q K^T (M = 4 heads, N = context, K = head_size) and O = S V
//            (M = 4, N = head_size, K = context): exactly the attention FLOPs, but on
//            float32 K/V, so sgemm reads twice the bytes that a bf16 cache holds.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/src/cpu/fast_internal.h"
#include "benchmark/benchmark.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/common/numeric.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace kvstream {
namespace {

struct Shape {
  const char* name;
  int num_seqs;
  int context_len;  // cached keys before this step's tokens
  int query_len;
  int num_heads;
  int num_kv_heads;
  int head_size;
  DType cache_dtype;
  KvLayout layout;
  bool causal;
  int gemm_shape;  // the shape whose sgemm this one is compared with
};

constexpr int kBlockSize = 16;

const Shape kShapes[] = {
    {"prefill 1x2048 tok, 32/8 heads, d128, bf16 NHD, causal", 1, 0, 2048, 32, 8, 128,
     DType::kBFloat16, KvLayout::kNHD, true, 0},
    {"decode 16 seqs x 4096 ctx, 32/8 heads, d128, bf16 NHD", 16, 4095, 1, 32, 8, 128,
     DType::kBFloat16, KvLayout::kNHD, true, 1},
    {"decode 16 seqs x 4096 ctx, 32/8 heads, d128, bf16 HND", 16, 4095, 1, 32, 8, 128,
     DType::kBFloat16, KvLayout::kHND, true, 1},
};
constexpr int kNumShapes = 3;

int SeqLen(const Shape& s) { return s.context_len + s.query_len; }

double AttentionFlops(const Shape& s) {
  double pairs = 0;
  for (int t = 0; t < s.query_len; ++t) {
    pairs += s.causal ? s.context_len + t + 1 : SeqLen(s);
  }
  return 4.0 * s.head_size * s.num_heads * pairs * s.num_seqs;
}

double KvBytes(const Shape& s) {
  return 2.0 * s.head_size * s.num_kv_heads * static_cast<double>(SeqLen(s)) * s.num_seqs *
         static_cast<double>(DTypeSize(s.cache_dtype));
}

// Cheap deterministic values in [-1, 1): filling hundreds of MB with <random> is slow.
struct Lcg {
  uint64_t state;
  float Next() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<int32_t>(state >> 32)) * (1.0f / 2147483648.0f);
  }
};

// One attention call's buffers: a cache with shuffled block ids, queries, output.
class AttentionProblem {
 public:
  explicit AttentionProblem(const Shape& s) {
    KvCache::Options options;
    options.spec.block_size = kBlockSize;
    options.spec.num_kv_heads = s.num_kv_heads;
    options.spec.head_size = s.head_size;
    options.spec.head_size_v = s.head_size;
    options.spec.dtype = s.cache_dtype;
    options.spec.quant_mode = IsFp8(s.cache_dtype) ? KvQuantMode::kPerTensor : KvQuantMode::kNone;
    options.layout = s.layout;
    const int blocks_per_seq = (SeqLen(s) + kBlockSize - 1) / kBlockSize;
    options.num_blocks = int64_t{blocks_per_seq} * s.num_seqs;
    auto cache = KvCache::Create(options);
    if (!cache.ok()) {
      std::fprintf(stderr, "KvCache::Create: %s\n", cache.status().ToString().c_str());
      std::abort();
    }
    cache_ = std::move(*cache);
    const KvCacheView view = cache_->view();
    Lcg lcg{42};
    const int64_t k_elems = view.k_strides.block * options.num_blocks;
    for (int64_t i = 0; i < k_elems; ++i) {
      StoreFromFloat(view.k, s.cache_dtype, i, lcg.Next());
      StoreFromFloat(view.v, s.cache_dtype, i, lcg.Next());
    }

    std::vector<int32_t> ids(static_cast<size_t>(options.num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
    block_table_ = ids;
    query_start_loc_.push_back(0);
    for (int i = 0; i < s.num_seqs; ++i) {
      query_start_loc_.push_back(query_start_loc_.back() + s.query_len);
      seq_lens_.push_back(SeqLen(s));
    }
    const int64_t num_tokens = query_start_loc_.back();
    q_.resize(static_cast<size_t>(num_tokens * s.num_heads * s.head_size));
    for (uint16_t& x : q_) x = FloatToBFloat16(lcg.Next());
    out_.resize(q_.size());

    p_.q = q_.data();
    p_.q_dtype = DType::kBFloat16;
    p_.q_token_stride = int64_t{s.num_heads} * s.head_size;
    p_.q_head_stride = s.head_size;
    p_.out = out_.data();
    p_.out_dtype = DType::kBFloat16;
    p_.o_token_stride = p_.q_token_stride;
    p_.o_head_stride = s.head_size;
    p_.num_tokens = num_tokens;
    p_.cache = view;
    p_.query_start_loc = query_start_loc_.data();
    p_.seq_lens = seq_lens_.data();
    p_.block_table = block_table_.data();
    p_.block_table_stride = blocks_per_seq;
    p_.num_seqs = s.num_seqs;
    p_.max_query_len = s.query_len;
    p_.max_seq_len = SeqLen(s);
    p_.num_heads = s.num_heads;
    p_.scale = 1.0f / std::sqrt(static_cast<float>(s.head_size));
    p_.causal = s.causal;
  }

  const PagedAttentionParams& params() const { return p_; }

 private:
  std::unique_ptr<KvCache> cache_;
  std::vector<int32_t> block_table_, query_start_loc_, seq_lens_;
  std::vector<uint16_t> q_, out_;
  PagedAttentionParams p_;
};

// Float32 operands for the matching sgemm calls.
class GemmProblem {
 public:
  explicit GemmProblem(const Shape& s) {
    const int64_t keys = SeqLen(s);
    const int64_t rows = s.query_len == 1 ? s.num_heads / s.num_kv_heads : s.query_len;
    const int64_t batches = s.query_len == 1 ? int64_t{s.num_seqs} * s.num_kv_heads
                                             : int64_t{s.num_seqs} * s.num_heads;
    const int64_t kv_batches = int64_t{s.num_seqs} * s.num_kv_heads;
    Lcg lcg{9};
    q_.resize(static_cast<size_t>(batches * rows * s.head_size));
    k_.resize(static_cast<size_t>(kv_batches * keys * s.head_size));
    v_.resize(k_.size());
    for (float& x : q_) x = lcg.Next();
    for (float& x : k_) x = lcg.Next();
    for (float& x : v_) x = lcg.Next();
    scores_.resize(static_cast<size_t>(rows * keys));
    out_.resize(static_cast<size_t>(rows * s.head_size));
    rows_ = rows;
    keys_ = keys;
    batches_ = batches;
    group_ = batches / kv_batches;
    head_size_ = s.head_size;
  }

  // S = Q K^T and O = S V for every batch entry.
  void Run() {
    const int m = static_cast<int>(rows_);
    const int n = static_cast<int>(keys_);
    const int d = head_size_;
    for (int64_t b = 0; b < batches_; ++b) {
      const float* q = q_.data() + b * rows_ * d;
      const float* k = k_.data() + (b / group_) * keys_ * d;
      const float* v = v_.data() + (b / group_) * keys_ * d;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, d, 1.0f, q, d, k, d, 0.0f,
                  scores_.data(), n);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, d, n, 1.0f, scores_.data(), n,
                  v, d, 0.0f, out_.data(), d);
    }
    benchmark::DoNotOptimize(out_.data());
    benchmark::ClobberMemory();
  }

  double Flops() const { return 4.0 * static_cast<double>(batches_) * rows_ * keys_ * head_size_; }
  double KvBytes() const { return 8.0 * static_cast<double>(k_.size()); }

 private:
  std::vector<float> q_, k_, v_, scores_, out_;
  int64_t rows_ = 0, keys_ = 0, batches_ = 0, group_ = 1;
  int head_size_ = 0;
};

// Problems are built once per shape: the benchmark library calls each function several
// times while it settles on an iteration count.
AttentionProblem& GetAttentionProblem(int shape) {
  static std::map<int, std::unique_ptr<AttentionProblem>> problems;
  auto& slot = problems[shape];
  if (!slot) slot = std::make_unique<AttentionProblem>(kShapes[shape]);
  return *slot;
}
GemmProblem& GetGemmProblem(int shape) {
  static std::map<int, std::unique_ptr<GemmProblem>> problems;
  auto& slot = problems[shape];
  if (!slot) slot = std::make_unique<GemmProblem>(kShapes[shape]);
  return *slot;
}

void SetBlasThreads(int threads) {
#ifdef OPENBLAS_VERSION
  openblas_set_num_threads(threads);
#else
  (void)threads;
#endif
}

int MaxThreads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// state.range(0): shape; state.range(1): threads (0 = all).
void BM_Attention(benchmark::State& state) {
  const Shape& shape = kShapes[state.range(0)];
  const int threads = static_cast<int>(state.range(1));
  AttentionProblem& problem = GetAttentionProblem(static_cast<int>(state.range(0)));
  const internal::CpuIsa isa = internal::SupportedCpuIsas().back();
  for (auto _ : state) {
    const absl::Status st = internal::RunAttentionCpuWith(problem.params(), isa, threads);
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      break;
    }
  }
  const double iters = static_cast<double>(state.iterations());
  state.counters["GFLOP/s"] =
      benchmark::Counter(AttentionFlops(shape) * iters / 1e9, benchmark::Counter::kIsRate);
  state.counters["KV_GB/s"] =
      benchmark::Counter(KvBytes(shape) * iters / 1e9, benchmark::Counter::kIsRate);
  state.SetLabel(absl::StrCat(internal::CpuIsaName(isa), ", ", threads > 0 ? threads : MaxThreads(),
                              " threads"));
}

void BM_Sgemm(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(1));
  GemmProblem& problem = GetGemmProblem(static_cast<int>(state.range(0)));
  SetBlasThreads(threads > 0 ? threads : MaxThreads());
  for (auto _ : state) problem.Run();
  SetBlasThreads(MaxThreads());
  const double iters = static_cast<double>(state.iterations());
  state.counters["GFLOP/s"] =
      benchmark::Counter(problem.Flops() * iters / 1e9, benchmark::Counter::kIsRate);
  state.counters["KV_GB/s"] =
      benchmark::Counter(problem.KvBytes() * iters / 1e9, benchmark::Counter::kIsRate);
}

void AttentionArgs(benchmark::internal::Benchmark* b) {
  for (int shape = 0; shape < kNumShapes; ++shape) {
    for (int threads : {0, 1}) b->Args({shape, threads});
  }
  b->ArgNames({"shape", "threads"});
  b->UseRealTime();
  b->Unit(benchmark::kMillisecond);
}

void SgemmArgs(benchmark::internal::Benchmark* b) {
  for (int shape = 0; shape < kNumShapes; ++shape) {
    if (kShapes[shape].gemm_shape != shape) continue;
    for (int threads : {0, 1}) b->Args({shape, threads});
  }
  b->ArgNames({"shape", "threads"});
  b->UseRealTime();
  b->Unit(benchmark::kMillisecond);
}

// Sequential read bandwidth over as many bytes as the decode shape's KV: the ceiling that
// matters for decode, which reads each KV byte once. range(0): threads (0 = all).
void BM_ReadBandwidth(benchmark::State& state) {
  const int threads = state.range(0) > 0 ? static_cast<int>(state.range(0)) : MaxThreads();
  static const std::vector<uint64_t>* const buffer =
      new std::vector<uint64_t>(static_cast<size_t>(KvBytes(kShapes[1]) / 8), 1);
  const int64_t n = static_cast<int64_t>(buffer->size());
  const uint64_t* data = buffer->data();
  for (auto _ : state) {
    uint64_t total = 0;
#ifdef _OPENMP
#pragma omp parallel for reduction(+ : total) num_threads(threads) schedule(static)
#endif
    for (int64_t i = 0; i < n; ++i) total += data[i];
    benchmark::DoNotOptimize(total);
  }
  state.counters["GB/s"] = benchmark::Counter(8.0 * n * static_cast<double>(state.iterations()) /
                                                  1e9,
                                              benchmark::Counter::kIsRate);
  state.SetLabel(absl::StrCat(threads, " threads"));
}

BENCHMARK(BM_Attention)->Apply(AttentionArgs);
BENCHMARK(BM_Sgemm)->Apply(SgemmArgs);
BENCHMARK(BM_ReadBandwidth)
    ->Arg(0)
    ->Arg(1)
    ->ArgName("threads")
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Whether a run failed: Google Benchmark before 1.8 says so in error_occurred, later
// versions in skipped.
template <typename R>
auto RunFailed(const R& run, int) -> decltype(run.error_occurred, bool()) {
  return run.error_occurred;
}
template <typename R>
bool RunFailed(const R& run, long) {
  return static_cast<bool>(run.skipped);
}

// Passes everything to the console and keeps the per-iteration results for the table.
class CapturingReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.run_type == Run::RT_Iteration && !RunFailed(run, 0)) captured_.push_back(run);
    }
    ConsoleReporter::ReportRuns(runs);
  }
  const std::vector<Run>& captured() const { return captured_; }

 private:
  std::vector<Run> captured_;
};

double Counter(const benchmark::BenchmarkReporter::Run& run, const char* name) {
  auto it = run.counters.find(name);
  return it == run.counters.end() ? 0.0 : static_cast<double>(it->second);
}

void PrintTable(const std::vector<benchmark::BenchmarkReporter::Run>& runs) {
  // Results by "shape:threads".
  std::map<std::string, const benchmark::BenchmarkReporter::Run*> attention, sgemm;
  std::map<std::string, double> read_bandwidth;  // by "threads:N"
  for (const auto& run : runs) {
    const std::string name = run.benchmark_name();
    if (name.rfind("BM_ReadBandwidth", 0) == 0) {
      std::string key = name.substr(name.find("threads:"));
      key = key.substr(0, key.find("/real_time"));
      read_bandwidth[key] = std::max(read_bandwidth[key], Counter(run, "GB/s"));
      continue;
    }
    const size_t shape_pos = name.find("shape:");
    if (shape_pos == std::string::npos) continue;
    std::string key = name.substr(shape_pos);
    key = key.substr(0, key.find("/real_time"));
    // With --benchmark_repetitions the best run counts: on a shared machine the slower ones
    // measure the neighbours.
    auto& slot = (name.rfind("BM_Attention", 0) == 0 ? attention : sgemm)[key];
    if (slot == nullptr || Counter(run, "GFLOP/s") > Counter(*slot, "GFLOP/s")) slot = &run;
  }
  std::printf("\n%-58s %7s %9s %9s %6s %10s %10s %10s\n", "shape", "threads", "kvstream",
              "sgemm", "ratio", "KV GB/s", "read GB/s", "sgemm GB/s");
  std::printf("%-58s %7s %9s %9s %6s %10s %10s %10s\n", "", "", "GFLOP/s", "GFLOP/s", "",
              "kvstream", "sequential", "f32 K/V");
  for (int shape = 0; shape < kNumShapes; ++shape) {
    for (int threads : {0, 1}) {
      const std::string key = absl::StrCat("shape:", shape, "/threads:", threads);
      const std::string gemm_key =
          absl::StrCat("shape:", kShapes[shape].gemm_shape, "/threads:", threads);
      if (attention.count(key) == 0 || sgemm.count(gemm_key) == 0) continue;
      const double ours = Counter(*attention[key], "GFLOP/s");
      const double blas = Counter(*sgemm[gemm_key], "GFLOP/s");
      std::printf("%-58s %7d %9.1f %9.1f %6.2f", kShapes[shape].name,
                  threads > 0 ? threads : MaxThreads(), ours, blas, blas > 0 ? ours / blas : 0.0);
      if (kShapes[shape].query_len == 1) {
        std::printf(" %10.1f %10.1f %10.1f", Counter(*attention[key], "KV_GB/s"),
                    read_bandwidth[absl::StrCat("threads:", threads)],
                    Counter(*sgemm[gemm_key], "KV_GB/s"));
      }
      std::printf("\n");
    }
  }
  std::printf(
      "\nsgemm matched: prefill = per query head Q K^T (2048x2048x128) and S V (2048x128x2048),\n"
      "credited with the full square it computes (kvstream only with the causal half);\n"
      "decode = per (sequence, KV head) Q K^T (4x4096x128) and S V (4x128x4096), float32 K/V.\n"
      "read GB/s: one sequential pass over a buffer as large as the decode KV (the bandwidth\n"
      "ceiling for decode, which reads every KV byte once, from scattered blocks).\n");
}

}  // namespace
}  // namespace kvstream

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvstream::CapturingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  kvstream::PrintTable(reporter.captured());
  benchmark::Shutdown();
  return 0;
}
