// Benchmark of the CPU cache update (CacheUpdateCpu): new tokens' keys and values written
// into scattered slots of a paged cache, in GB/s of bytes read plus written, beside a memcpy
// of the same byte count measured in the same run (the ceiling: the update reads each input
// byte once and writes each cache byte once). Prints a table with the ratio at the end.
//
//   kvstream_bench_cache_update [--benchmark_repetitions=3]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "kvstream/cache/cache_update.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/common/numeric.h"

namespace kvstream {
namespace {

constexpr int kHeads = 8, kHeadSize = 128, kBlockSize = 16;
const int kTokens[] = {4096, 16384};
struct CacheKind {
  const char* name;
  DType dtype;
};
const CacheKind kKinds[] = {{"bf16->bf16", DType::kBFloat16}, {"bf16->fp8", DType::kFloat8E4M3}};

struct Case {
  std::unique_ptr<KvCache> cache;
  Tensor key, value;
  std::vector<int64_t> slots;
  double bytes = 0;  // read + written
};

Case MakeCase(int tokens, DType cache_dtype) {
  Case c;
  KvCacheSpec spec;
  spec.block_size = kBlockSize;
  spec.num_kv_heads = kHeads;
  spec.head_size = spec.head_size_v = kHeadSize;
  spec.dtype = cache_dtype;
  spec.quant_mode = IsFp8(cache_dtype) ? KvQuantMode::kPerTensor : KvQuantMode::kNone;
  const int blocks = tokens / kBlockSize * 2;  // half the cache is used, blocks scattered
  c.cache = std::move(KvCache::Create({spec, KvLayout::kNHD, blocks})).value();
  if (IsFp8(cache_dtype)) (void)c.cache->SetScales({0.05f}, {0.05f});
  c.key = Tensor::Zeros({tokens, kHeads, kHeadSize}, DType::kBFloat16);
  c.value = Tensor::Zeros({tokens, kHeads, kHeadSize}, DType::kBFloat16);
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int64_t i = 0; i < c.key.numel(); ++i) {
    c.key.SetFloat(i, d(rng));
    c.value.SetFloat(i, d(rng));
  }
  std::vector<int32_t> ids(blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  for (int t = 0; t < tokens; ++t) c.slots.push_back(int64_t{ids[t / kBlockSize]} * kBlockSize + t % kBlockSize);
  const double in = 2.0 * tokens * kHeads * kHeadSize * 2;
  const double out = 2.0 * tokens * kHeads * kHeadSize * DTypeSize(cache_dtype);
  c.bytes = in + out;
  return c;
}

std::map<std::string, double> results;  // label -> GB/s (best)

void Record(const std::string& label, double gbps) {
  double& r = results[label];
  r = std::max(r, gbps);
}

void BM_CacheUpdate(benchmark::State& state) {
  const int tokens = kTokens[state.range(0)];
  const CacheKind kind = kKinds[state.range(1)];
  Case c = MakeCase(tokens, kind.dtype);
  for (auto _ : state) {
    absl::Status s = ReshapeAndCache(c.key.view(), c.value.view(), *c.cache, c.slots);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::ClobberMemory();
  }
  const double gbps = c.bytes * state.iterations() / 1e9;
  state.counters["GB/s"] = benchmark::Counter(gbps, benchmark::Counter::kIsRate);
  state.SetLabel(std::string(kind.name) + " " + std::to_string(tokens) + " tok");
}

void BM_Memcpy(benchmark::State& state) {
  const int tokens = kTokens[state.range(0)];
  const CacheKind kind = kKinds[state.range(1)];
  // As many bytes copied as the update writes into the cache.
  const size_t out = size_t{2} * tokens * kHeads * kHeadSize * DTypeSize(kind.dtype);
  std::vector<char> src(out, 1), dst(out, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), out);
    benchmark::ClobberMemory();
  }
  const double bytes = 2.0 * static_cast<double>(out);
  state.counters["GB/s"] =
      benchmark::Counter(bytes * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}

BENCHMARK(BM_CacheUpdate)->ArgsProduct({{0, 1}, {0, 1}})->UseRealTime();
BENCHMARK(BM_Memcpy)->ArgsProduct({{0, 1}, {0, 1}})->UseRealTime();

class Capture : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.run_type != Run::RT_Iteration) continue;
      auto it = r.counters.find("GB/s");
      if (it != r.counters.end()) Record(r.benchmark_name(), it->second.value);
    }
    ConsoleReporter::ReportRuns(runs);
  }
};

}  // namespace
}  // namespace kvstream

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  kvstream::Capture reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  std::printf("\n%-12s %8s %12s %12s %7s\n", "cache", "tokens", "update GB/s", "memcpy GB/s",
              "ratio");
  for (int t = 0; t < 2; ++t) {
    for (int k = 0; k < 2; ++k) {
      const std::string args = "/" + std::to_string(t) + "/" + std::to_string(k) + "/real_time";
      const double u = kvstream::results["BM_CacheUpdate" + args];
      const double m = kvstream::results["BM_Memcpy" + args];
      std::printf("%-12s %8d %12.2f %12.2f %7.2f\n", kvstream::kKinds[k].name,
                  kvstream::kTokens[t], u, m, m > 0 ? u / m : 0.0);
    }
  }
  std::printf("\nGB/s = (bytes read + bytes written) / s, 1e9 bytes. memcpy copies as many bytes\n"
              "as the update writes into the cache (read + write counted alike). Keys and\n"
              "values [tokens, 8 heads, 128] bf16 into an NHD cache of scattered 16-token blocks.\n");
  return 0;
}
