// Benchmarks of the kvsum64 layer checksum (kvstream/cache/layer_checksum.h), each beside
// the ceiling it should be compared with, measured in the same run:
//   DeviceChecksum/<tokens>/<copy>/<odd>: DeviceChecksummer::Enqueue over one layer of
//     Llama-3-8B's KV cache (8 KV heads x head size 128 x bf16, block size 16: 32 KiB per
//     block in K and in V) holding `tokens` tokens in shuffled blocks, the spans its K runs
//     then its V runs, one span per block; copy 0 copies the span table on the
//     checksummer's stream (TableCopy::kInternalStream), 1 on the caller's; odd 1 starts
//     every span one byte into its block and ends it one byte early (the unaligned path).
//     GB/s of span bytes, beside a streaming-read kernel over the same layers' buffers
//     (read_GB/s) and the ratio. Successive calls walk through enough layers (512 MiB) that
//     nothing is served from L2, for the checksum and the read alike. Every result is
//     checked against Kvsum64Host over a host copy of the layer (the run fails otherwise).
//   HostChecksum/<tokens>: Kvsum64Host on one core over the same layer shape in host
//     memory, GB/s beside a plain read of the same spans (summing their words: what one
//     core's loads reach) and the ratio.
// Timing (device): CUDA events around a batch of calls queued behind a kernel that holds
// the stream until all are enqueued, so host-side work never shows up as GPU idle time.
//
//   kvstream_bench_layer_checksum [--benchmark_filter=DeviceChecksum]
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/cuda_bench_kernels.h"
#include "kvstream/cache/layer_checksum.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

constexpr int kLaunchesPerBatch = 20;
constexpr int kIterations = 30;
constexpr int kHoldTimeoutMs = 20000;
constexpr uint64_t kBlockBytes = 16 * 8 * 128 * 2;  // block size x KV heads x head size x bf16
constexpr uint64_t kLayerSetBytes = uint64_t{512} << 20;  // well past the 50 MB L2

struct Gpu {
  CudaStream stream;
  int num_sms = 0;
  DeviceBuffer flag_buffer;  // pinned: the hold kernel polls it
  int* flag = nullptr;
  DeviceBuffer sink;
};

absl::StatusOr<Gpu*> GetGpu() {
  static absl::StatusOr<Gpu*>* gpu = [] {
    auto make = []() -> absl::StatusOr<Gpu*> {
      RETURN_IF_ERROR(CudaAvailability());
      auto g = std::make_unique<Gpu>();
      ASSIGN_OR_RETURN(g->stream, CudaStream::Create(0));
      RETURN_IF_ERROR(CudaErrorToStatus(
          static_cast<int>(cudaDeviceGetAttribute(&g->num_sms, cudaDevAttrMultiProcessorCount, 0)),
          "cudaDeviceGetAttribute"));
      ASSIGN_OR_RETURN(g->flag_buffer,
                       DeviceBuffer::CreateZeroed(sizeof(int), MemoryKind::kPinned));
      g->flag = g->flag_buffer.data_as<int>();
      ASSIGN_OR_RETURN(
          g->sink, DeviceBuffer::Create(sizeof(uint32_t) * g->num_sms * 8, MemoryKind::kDevice));
      return g.release();  // lives for the process
    };
    return new absl::StatusOr<Gpu*>(make());
  }();
  return *gpu;
}

// GPU seconds per call of `enqueue(i)` (enqueuing on gpu.stream), over `launches` calls
// queued behind the hold kernel and run back to back.
absl::StatusOr<double> SecondsPerCall(Gpu& gpu, const std::function<absl::Status(int)>& enqueue,
                                      int launches = kLaunchesPerBatch) {
  ASSIGN_OR_RETURN(CudaEvent start, CudaEvent::Create(/*enable_timing=*/true));
  ASSIGN_OR_RETURN(CudaEvent stop, CudaEvent::Create(/*enable_timing=*/true));
  RETURN_IF_ERROR(enqueue(0));  // first-launch costs outside the timed batch
  RETURN_IF_ERROR(gpu.stream.Synchronize(absl::Seconds(120)));
  __atomic_store_n(gpu.flag, 0, __ATOMIC_RELEASE);
  absl::Status enqueued = CudaErrorToStatus(
      bench::LaunchHoldStream(gpu.flag, kHoldTimeoutMs, gpu.stream.get()), "hold kernel");
  if (enqueued.ok()) enqueued = start.Record(gpu.stream.get());
  for (int i = 0; i < launches && enqueued.ok(); ++i) enqueued = enqueue(i);
  if (enqueued.ok()) enqueued = stop.Record(gpu.stream.get());
  __atomic_store_n(gpu.flag, 1, __ATOMIC_RELEASE);  // release whatever happened
  RETURN_IF_ERROR(enqueued);
  RETURN_IF_ERROR(gpu.stream.Synchronize(absl::Seconds(120)));
  ASSIGN_OR_RETURN(float ms, CudaEvent::ElapsedMilliseconds(start, stop));
  return static_cast<double>(ms) * 1e-3 / launches;
}

void Fail(benchmark::State& state, const absl::Status& status) {
  const std::string message = status.ToString();
  state.SkipWithError(message.c_str());
}

// One layer in device memory: K blocks then V blocks, random bf16 values.
struct Layer {
  DeviceBuffer bytes;
  std::vector<ChecksumSpan> spans;  // K runs, then V runs, in shuffled block order
  uint64_t span_bytes = 0;
  uint64_t host_sum = 0;  // Kvsum64Host over a host copy
};

// `blocks` shuffled blocks; `odd`: each span one byte into its block and two bytes short.
std::vector<std::pair<uint64_t, uint64_t>> LayerRanges(int64_t blocks, uint32_t seed, bool odd) {
  std::vector<uint64_t> ids(static_cast<size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const uint64_t region : {uint64_t{0}, static_cast<uint64_t>(blocks) * kBlockBytes}) {
    for (uint64_t id : ids) {
      ranges.emplace_back(region + id * kBlockBytes + (odd ? 1 : 0),
                          odd ? kBlockBytes - 2 : kBlockBytes);
    }
  }
  return ranges;
}

absl::StatusOr<std::vector<Layer>> MakeLayers(Gpu& gpu, int64_t tokens, bool odd) {
  const int64_t blocks = tokens / 16;
  const uint64_t layer_bytes = 2 * static_cast<uint64_t>(blocks) * kBlockBytes;
  const int count = static_cast<int>(std::max<uint64_t>(2, kLayerSetBytes / layer_bytes));
  std::vector<Layer> layers(static_cast<size_t>(count));
  std::vector<uint8_t> host(layer_bytes);
  for (int l = 0; l < count; ++l) {
    Layer& layer = layers[static_cast<size_t>(l)];
    ASSIGN_OR_RETURN(layer.bytes, DeviceBuffer::Create(layer_bytes, MemoryKind::kDevice));
    RETURN_IF_ERROR(
        CudaErrorToStatus(bench::LaunchFillRandom(layer.bytes.data(), layer_bytes / 2, /*bf16=*/2,
                                                  static_cast<uint32_t>(l + 1), gpu.stream.get()),
                          "fill kernel"));
    RETURN_IF_ERROR(gpu.stream.Synchronize(absl::Seconds(60)));
    RETURN_IF_ERROR(
        CudaErrorToStatus(static_cast<int>(cudaMemcpy(host.data(), layer.bytes.data(), layer_bytes,
                                                      cudaMemcpyDeviceToHost)),
                          "cudaMemcpy to host"));
    std::vector<ChecksumSpan> host_spans;
    for (const auto& [offset, length] : LayerRanges(blocks, static_cast<uint32_t>(l + 7), odd)) {
      layer.spans.push_back({layer.bytes.data_as<uint8_t>() + offset, length});
      host_spans.push_back({host.data() + offset, length});
      layer.span_bytes += length;
    }
    layer.host_sum = Kvsum64Host(host_spans);
  }
  return layers;
}

// GB/s of a streaming read over every layer's whole buffer (one launch per layer, walking
// the layers as the checksum does), the best of three batches.
absl::StatusOr<double> StreamingReadGbps(Gpu& gpu, const std::vector<Layer>& layers) {
  double best = 0;
  for (int round = 0; round < 3; ++round) {
    ASSIGN_OR_RETURN(const double s, SecondsPerCall(gpu, [&](int i) {
                       const Layer& layer = layers[static_cast<size_t>(i) % layers.size()];
                       return CudaErrorToStatus(
                           bench::LaunchStreamingRead(layer.bytes.data(), layer.bytes.size(),
                                                      gpu.sink.data_as<uint32_t>(), gpu.num_sms,
                                                      gpu.stream.get()),
                           "streaming read");
                     }));
    best = std::max(best, static_cast<double>(layers[0].bytes.size()) / s * 1e-9);
  }
  return best;
}

void BM_DeviceChecksum(benchmark::State& state) {
  absl::StatusOr<Gpu*> g = GetGpu();
  if (!g.ok()) {
    Fail(state,
         absl::FailedPreconditionError(absl::StrCat("no usable GPU: ", g.status().message())));
    return;
  }
  Gpu& gpu = **g;
  const int64_t tokens = state.range(0);
  const bool caller_copy = state.range(1) != 0;
  const bool odd = state.range(2) != 0;
  state.SetLabel(absl::StrCat(
      caller_copy ? "table copy on the caller's stream" : "table copy on the checksummer's stream",
      odd ? ", odd offsets" : ""));
  auto run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const std::vector<Layer> layers, MakeLayers(gpu, tokens, odd));
    DeviceChecksummer::Options options;
    options.device = 0;
    options.table_copy = caller_copy ? DeviceChecksummer::TableCopy::kCallerStream
                                     : DeviceChecksummer::TableCopy::kInternalStream;
    ASSIGN_OR_RETURN(std::unique_ptr<DeviceChecksummer> summer, DeviceChecksummer::Create(options));
    ASSIGN_OR_RETURN(DeviceBuffer results,
                     DeviceBuffer::CreateZeroed(8 * kLaunchesPerBatch, MemoryKind::kPinned));
    ASSIGN_OR_RETURN(const double read_gbps, StreamingReadGbps(gpu, layers));
    auto enqueue = [&](int i) {
      return summer->Enqueue(layers[static_cast<size_t>(i) % layers.size()].spans, gpu.stream.get(),
                             results.data_as<uint64_t>() + i);
    };
    double total_s = 0;
    int64_t batches = 0;
    for (auto _ : state) {
      ASSIGN_OR_RETURN(const double s, SecondsPerCall(gpu, enqueue));
      state.SetIterationTime(s);
      total_s += s;
      ++batches;
      for (int i = 0; i < kLaunchesPerBatch; ++i) {
        const Layer& layer = layers[static_cast<size_t>(i) % layers.size()];
        if (results.data_as<uint64_t>()[i] != layer.host_sum) {
          return absl::InternalError(absl::StrCat("call ", i, ": device kvsum64 ",
                                                  absl::Hex(results.data_as<uint64_t>()[i]),
                                                  " != Kvsum64Host ", absl::Hex(layer.host_sum)));
        }
        results.data_as<uint64_t>()[i] = ~layer.host_sum;  // must be written again
      }
    }
    const double gbps =
        static_cast<double>(layers[0].span_bytes) / (total_s / static_cast<double>(batches)) * 1e-9;
    state.counters["GB/s"] = gbps;
    state.counters["read_GB/s"] = read_gbps;
    state.counters["ratio"] = gbps / read_gbps;
    state.counters["spans"] = static_cast<double>(layers[0].spans.size());
    state.counters["MiB"] = static_cast<double>(layers[0].span_bytes) / (1 << 20);
    return absl::OkStatus();
  };
  const absl::Status st = run();
  if (!st.ok()) Fail(state, st);
}

void BM_HostChecksum(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const int64_t blocks = tokens / 16;
  std::vector<uint64_t> storage(2 * static_cast<size_t>(blocks) * kBlockBytes / 8);
  std::mt19937_64 rng(1);
  for (auto& w : storage) w = rng();
  const uint8_t* base = reinterpret_cast<const uint8_t*>(storage.data());
  std::vector<ChecksumSpan> spans;
  uint64_t bytes = 0;
  for (const auto& [offset, length] : LayerRanges(blocks, 2, /*odd=*/false)) {
    spans.push_back({base + offset, length});
    bytes += length;
  }
  // The ceiling: the same spans' words summed (vectorised loads, no mixing).
  auto plain_read = [&] {
    uint64_t s = 0;
    for (const ChecksumSpan& span : spans) {
      const uint64_t* w = static_cast<const uint64_t*>(span.data);
      for (uint64_t i = 0; i < span.length / 8; ++i) s += w[i];
    }
    return s;
  };
  double read_s = 1e30;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(plain_read());
    read_s = std::min(read_s,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  double total_s = 0;
  int64_t runs = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(Kvsum64Host(spans));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
    total_s += s;
    ++runs;
  }
  const double gbps = static_cast<double>(bytes) / (total_s / static_cast<double>(runs)) * 1e-9;
  const double read_gbps = static_cast<double>(bytes) / read_s * 1e-9;
  state.counters["GB/s"] = gbps;
  state.counters["read_GB/s"] = read_gbps;
  state.counters["ratio"] = gbps / read_gbps;
}

BENCHMARK(BM_DeviceChecksum)
    ->ArgNames({"tokens", "caller_copy", "odd"})
    ->Apply([](benchmark::internal::Benchmark* b) {
      for (const int64_t tokens : {8192, 32768}) {
        b->Args({tokens, 0, 0});
        b->Args({tokens, 1, 0});
        b->Args({tokens, 0, 1});
      }
    })
    ->UseManualTime()
    ->Iterations(kIterations)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_HostChecksum)
    ->ArgNames({"tokens"})
    ->Arg(8192)
    ->Arg(32768)
    ->UseManualTime()
    ->Iterations(10)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvstream

BENCHMARK_MAIN();
