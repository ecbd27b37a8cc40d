// Benchmarks of the CUDA kernels, each beside the bandwidth (or nothing) it should be
// compared with, measured in the same run on the same GPU:
//   CacheUpdate/<tokens>/<fp8>/<method>: CacheUpdateCuda, 8 KV heads x 128, block size 16,
//     bf16 inputs into a bf16 cache (fp8 0) or an fp8 e4m3 cache with a per-tensor scale of
//     0.05 (fp8 1: a calibrated scale) or of 1 (fp8 2: the default scale, converted as is),
//     with method 0 the default (kReciprocal: the split reciprocal for 0.05), 1 the
//     per-element division, 2 the reciprocal bracket (cache_update.cuh,
//     CacheUpdateFp8Method); GB/s of bytes read + written, and the ratio to
//     cudaMemcpyAsync device-to-device of the same traffic.
//   Decode/<seqs>/<seq_len>/<kernel>/<splits>: LaunchDecodeAttention (bf16, 32 query / 8 KV
//     heads, head size 128, block size 16, shuffled blocks) with kernel 0 the CUDA-core one,
//     1 the tensor-core one with cp.async, 2 the tensor-core one with TMA (launchers.h,
//     DecodeKernel) and 3 the TMA one with the merge kernel, splits 0 the launcher's choice
//     and > 0 a fixed split count; TB/s of K and V read, and the ratio to a streaming-read
//     kernel over the same cache buffers.
//   DecodeFp8/<seqs>/<seq_len>/<kernel>/<fp16>: the same over an fp8 e4m3 cache (per-tensor
//     scales), kernel 0 or 1, the launcher's splits, bf16 (fp16 0) or fp16 (1) q and out;
//     TB/s of the fp8 K and V.
//   PagedRead/<seqs>/<seq_len>/<order>/<splits>: decode's reads without its compute
//     (LaunchPagedRead: the K and V rows of a Decode batch's cache, one CTA per KV head,
//     sequence and split, cp.async into a shared ring), with order 0 Decode's shuffled block
//     table, 1 the table sorted and 2 one contiguous run per sequence and head (the
//     unpaged layout); TB/s and the ratio to the same streaming read.
//   Prefill/<tokens>/<variant>: the prefill kernel (bf16, causal, head size 128, 32 / 8
//     heads, one sequence) through LaunchPrefillAttention, variant 0 the baseline
//     configuration and 1 the fast one (launchers.h, PrefillVariant); TFLOP/s counting
//     4 * n^2 * d * heads / 2 for the causal half.
// Timing: CUDA events around a batch of launches queued behind a kernel that holds the
// stream until everything is enqueued, so host-side validation never shows up as GPU idle
// time; each reported iteration is the mean of one batch.
//
// Under a profiler that replays kernels (Nsight Compute), the hold kernel would wait for its
// timeout at every batch: KVSTREAM_BENCH_NO_HOLD=1 leaves it out (timings then include host
// enqueue gaps and are for the profiler's eyes only).
//
//   kvstream_bench_cuda_kernels [--benchmark_filter=Decode] [--benchmark_repetitions=3]
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/cuda_bench_kernels.h"
#include "cache/src/cuda/cache_update.cuh"
#include "cuda/kernel_params.h"
#include "cuda/launchers.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cuda_attention.h"
#include "kvstream/cache/cache_update.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

constexpr int kLaunchesPerBatch = 20;
// Batches per benchmark: each is timed on its own, so a handful gives a stable mean (the
// default, iterating until the summed GPU time reaches a minimum, would run tens of
// thousands of batches of a microsecond kernel, each with host set-up).
constexpr int kIterations = 30;
constexpr int kHoldTimeoutMs = 20000;

// Process-wide GPU state, made on first use.
struct Gpu {
  CudaStream stream;
  int num_sms = 0;
  int compute_major = 0;
  int* flag = nullptr;  // pinned host memory the hold kernel polls
  DeviceBuffer flag_buffer;
  DeviceBuffer sink;
  std::unique_ptr<AttentionBackend> backend;
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
      RETURN_IF_ERROR(CudaErrorToStatus(
          static_cast<int>(
              cudaDeviceGetAttribute(&g->compute_major, cudaDevAttrComputeCapabilityMajor, 0)),
          "cudaDeviceGetAttribute"));
      ASSIGN_OR_RETURN(g->flag_buffer, DeviceBuffer::CreateZeroed(sizeof(int), MemoryKind::kPinned));
      g->flag = g->flag_buffer.data_as<int>();
      ASSIGN_OR_RETURN(g->sink,
                       DeviceBuffer::Create(sizeof(uint32_t) * g->num_sms * 8, MemoryKind::kDevice));
      CudaBackendOptions options;
      options.stream = g->stream.get();
      ASSIGN_OR_RETURN(g->backend, CreateCudaAttentionBackend(options));
      return g.release();  // lives for the process
    };
    return new absl::StatusOr<Gpu*>(make());
  }();
  return *gpu;
}

// Releases the hold kernel when it goes out of scope, whatever happened in between.
class HoldRelease {
 public:
  explicit HoldRelease(int* flag) : flag_(flag) {}
  ~HoldRelease() { __atomic_store_n(flag_, 1, __ATOMIC_RELEASE); }
  HoldRelease(const HoldRelease&) = delete;
  HoldRelease& operator=(const HoldRelease&) = delete;

 private:
  int* flag_;
};

// GPU seconds per call of `enqueue` (which enqueues on gpu.stream), over `launches` calls
// queued behind the hold kernel and run back to back.
absl::StatusOr<double> SecondsPerCall(Gpu& gpu, const std::function<absl::Status()>& enqueue,
                                      int launches = kLaunchesPerBatch) {
  ASSIGN_OR_RETURN(CudaEvent start, CudaEvent::Create(/*enable_timing=*/true));
  ASSIGN_OR_RETURN(CudaEvent stop, CudaEvent::Create(/*enable_timing=*/true));
  // One call before the stream is held: whatever a first launch does on the host (kernel
  // attributes, lazy module loading) must not wait behind the hold kernel.
  RETURN_IF_ERROR(enqueue());
  RETURN_IF_ERROR(gpu.stream.Synchronize(absl::Seconds(120)));
  __atomic_store_n(gpu.flag, 0, __ATOMIC_RELEASE);
  {
    HoldRelease release(gpu.flag);
    static const bool hold = std::getenv("KVSTREAM_BENCH_NO_HOLD") == nullptr;
    if (hold) {
      RETURN_IF_ERROR(CudaErrorToStatus(
          bench::LaunchHoldStream(gpu.flag, kHoldTimeoutMs, gpu.stream.get()), "hold kernel"));
    }
    RETURN_IF_ERROR(start.Record(gpu.stream.get()));
    for (int i = 0; i < launches; ++i) RETURN_IF_ERROR(enqueue());
    RETURN_IF_ERROR(stop.Record(gpu.stream.get()));
  }
  RETURN_IF_ERROR(gpu.stream.Synchronize(absl::Seconds(120)));
  ASSIGN_OR_RETURN(float ms, CudaEvent::ElapsedMilliseconds(start, stop));
  return static_cast<double>(ms) * 1e-3 / launches;
}

// The fastest of a few batches: the reference measurements.
absl::StatusOr<double> BestSecondsPerCall(Gpu& gpu, const std::function<absl::Status()>& enqueue) {
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    ASSIGN_OR_RETURN(double s, SecondsPerCall(gpu, enqueue));
    best = i == 0 ? s : std::min(best, s);
  }
  return best;
}

void Fail(benchmark::State& state, const absl::Status& status) {
  const std::string message = status.ToString();
  state.SkipWithError(message.c_str());
}

bool SkipWithoutGpu(benchmark::State& state, Gpu** gpu) {
  absl::StatusOr<Gpu*> g = GetGpu();
  if (!g.ok()) {
    const std::string message = absl::StrCat("no usable GPU: ", g.status().message());
    state.SkipWithError(message.c_str());
    return true;
  }
  *gpu = *g;
  return false;
}

int DTypeCode(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 0;
    case DType::kFloat16: return 1;
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3: return 3;
    default: return 4;
  }
}

absl::Status FillRandom(Gpu& gpu, void* data, size_t count, DType dtype, uint32_t seed) {
  return CudaErrorToStatus(
      bench::LaunchFillRandom(data, count, DTypeCode(dtype), seed, gpu.stream.get()),
      "fill kernel");
}

template <typename T>
absl::StatusOr<DeviceBuffer> Upload(const std::vector<T>& values) {
  const size_t bytes = values.size() * sizeof(T);
  ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Create(bytes, MemoryKind::kDevice));
  RETURN_IF_ERROR(CudaErrorToStatus(
      static_cast<int>(cudaMemcpy(buffer.data(), values.data(), bytes, cudaMemcpyHostToDevice)),
      "cudaMemcpy"));
  return buffer;
}

// A device KvCache of `num_blocks` blocks of random values.
absl::StatusOr<std::unique_ptr<KvCache>> RandomCache(Gpu& gpu, const KvCacheSpec& spec,
                                                     int64_t num_blocks) {
  KvCache::Options options;
  options.spec = spec;
  options.layout = KvLayout::kNHD;
  options.num_blocks = num_blocks;
  options.memory = MemoryKind::kDevice;
  ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(options));
  if (IsFp8(spec.dtype)) {
    const std::vector<float> ones(spec.quant_mode == KvQuantMode::kPerHead ? spec.num_kv_heads : 1,
                                  0.05f);
    RETURN_IF_ERROR(cache->SetScales(ones, ones));
  }
  const size_t k_count = static_cast<size_t>(num_blocks * spec.KBytesPerBlock()) / DTypeSize(spec.dtype);
  const size_t v_count = static_cast<size_t>(num_blocks * spec.VBytesPerBlock()) / DTypeSize(spec.dtype);
  RETURN_IF_ERROR(FillRandom(gpu, cache->view().k, k_count, spec.dtype, 1));
  RETURN_IF_ERROR(FillRandom(gpu, cache->view().v, v_count, spec.dtype, 2));
  return cache;
}

std::vector<int32_t> ShuffledBlocks(int64_t n, uint32_t seed) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

// TB/s of a streaming read of the cache's whole K and V buffers (one launch each).
absl::StatusOr<double> StreamingReadTbps(Gpu& gpu, const KvCache& cache) {
  const size_t k_bytes = static_cast<size_t>(cache.num_blocks() * cache.spec().KBytesPerBlock());
  const size_t v_bytes = static_cast<size_t>(cache.num_blocks() * cache.spec().VBytesPerBlock());
  ASSIGN_OR_RETURN(const double read_s, BestSecondsPerCall(gpu, [&]() -> absl::Status {
    RETURN_IF_ERROR(CudaErrorToStatus(
        bench::LaunchStreamingRead(cache.view().k, k_bytes, gpu.sink.data_as<uint32_t>(),
                                   gpu.num_sms, gpu.stream.get()),
        "streaming read"));
    return CudaErrorToStatus(
        bench::LaunchStreamingRead(cache.view().v, v_bytes, gpu.sink.data_as<uint32_t>(),
                                   gpu.num_sms, gpu.stream.get()),
        "streaming read");
  }));
  return static_cast<double>(k_bytes + v_bytes) / read_s * 1e-12;
}

// Runs the benchmark's iterations, each one batch of `launches` calls of `enqueue` timed by
// SecondsPerCall, and returns the mean GPU seconds per call over them.
absl::StatusOr<double> MeanSecondsPerCall(benchmark::State& state, Gpu& gpu,
                                          const std::function<absl::Status()>& enqueue,
                                          int launches = kLaunchesPerBatch) {
  double total_s = 0;
  int64_t batches = 0;
  for (auto _ : state) {
    ASSIGN_OR_RETURN(double s, SecondsPerCall(gpu, enqueue, launches));
    state.SetIterationTime(s);
    total_s += s;
    ++batches;
  }
  return total_s / static_cast<double>(batches);
}

// Reports TB/s for calls that read `bytes` each in `seconds`, beside the streaming read's
// `read_tbps` and their ratio.
void ReportTbps(benchmark::State& state, double bytes, double seconds, double read_tbps) {
  const double tbps = bytes / seconds * 1e-12;
  state.counters["TB/s"] = tbps;
  state.counters["read_TB/s"] = read_tbps;
  state.counters["ratio"] = tbps / read_tbps;
}

// ---------------------------------------------------------------------------------------

constexpr int kKvHeads = 8;
constexpr int kHeads = 32;
constexpr int kHeadSize = 128;
constexpr int kBlockSize = 16;

// A batch on the GPU (`act_dtype` q and out, bf16 or fp16; a `cache_dtype` cache: bf16, or
// fp8 with per-tensor scales 0.05), with the host mirrors validation reads: `seqs`
// sequences of `seq_len` keys whose last `query_len` are this step's queries, 32 / 8 heads
// of size 128, block size 16, block ids shuffled (`seed`), random K, V and q. `params`
// points into the batch, which therefore stays where it was made.
struct PagedBatch {
  KvCacheSpec spec;
  std::unique_ptr<KvCache> cache;
  std::vector<int32_t> block_table, query_start_loc, seq_lens;
  DeviceBuffer d_table, d_qsl, d_lens, q, out;
  PagedAttentionParams params;
};

absl::StatusOr<std::unique_ptr<PagedBatch>> MakePagedBatch(
    Gpu& gpu, int seqs, int seq_len, int query_len, uint32_t seed,
    DType cache_dtype = DType::kBFloat16, DType act_dtype = DType::kBFloat16,
    int block_size = kBlockSize) {
  auto b = std::make_unique<PagedBatch>();
  b->spec.block_size = block_size;
  b->spec.num_kv_heads = kKvHeads;
  b->spec.head_size = b->spec.head_size_v = kHeadSize;
  b->spec.dtype = cache_dtype;
  b->spec.quant_mode = IsFp8(cache_dtype) ? KvQuantMode::kPerTensor : KvQuantMode::kNone;
  const int blocks_per_seq = (seq_len + block_size - 1) / block_size;
  const int64_t num_blocks = int64_t{seqs} * blocks_per_seq;
  ASSIGN_OR_RETURN(b->cache, RandomCache(gpu, b->spec, num_blocks));
  b->block_table = ShuffledBlocks(num_blocks, seed);
  b->query_start_loc.resize(static_cast<size_t>(seqs) + 1);
  for (int i = 0; i <= seqs; ++i) b->query_start_loc[static_cast<size_t>(i)] = i * query_len;
  b->seq_lens.assign(static_cast<size_t>(seqs), seq_len);
  ASSIGN_OR_RETURN(b->d_table, Upload(b->block_table));
  ASSIGN_OR_RETURN(b->d_qsl, Upload(b->query_start_loc));
  ASSIGN_OR_RETURN(b->d_lens, Upload(b->seq_lens));
  const int num_tokens = seqs * query_len;
  const size_t q_elements = static_cast<size_t>(num_tokens) * kHeads * kHeadSize;
  ASSIGN_OR_RETURN(b->q, DeviceBuffer::Create(q_elements * 2, MemoryKind::kDevice));
  ASSIGN_OR_RETURN(b->out, DeviceBuffer::Create(q_elements * 2, MemoryKind::kDevice));
  RETURN_IF_ERROR(FillRandom(gpu, b->q.data(), q_elements, act_dtype, seed + 1));

  PagedAttentionParams& p = b->params;
  p.q = b->q.data();
  p.q_dtype = act_dtype;
  p.q_token_stride = kHeads * kHeadSize;
  p.q_head_stride = kHeadSize;
  p.out = b->out.data();
  p.out_dtype = act_dtype;
  p.o_token_stride = kHeads * kHeadSize;
  p.o_head_stride = kHeadSize;
  p.num_tokens = num_tokens;
  p.cache = b->cache->view();
  p.query_start_loc = b->d_qsl.data_as<int32_t>();
  p.seq_lens = b->d_lens.data_as<int32_t>();
  p.block_table = b->d_table.data_as<int32_t>();
  p.block_table_stride = blocks_per_seq;
  p.num_seqs = seqs;
  p.max_query_len = query_len;
  p.max_seq_len = seq_len;
  p.num_heads = kHeads;
  p.scale = 0.08838834764f;
  p.causal = true;
  p.host.query_start_loc = b->query_start_loc.data();
  p.host.seq_lens = b->seq_lens.data();
  p.host.block_table = b->block_table.data();
  return b;
}

void BM_CacheUpdate(benchmark::State& state) {
  Gpu* gpu = nullptr;
  if (SkipWithoutGpu(state, &gpu)) return;
  const int64_t tokens = state.range(0);
  const DType cache_dtype = state.range(1) == 0 ? DType::kBFloat16 : DType::kFloat8E4M3;
  const bool unit_scale = state.range(1) == 2;
  const internal::CacheUpdateFp8Method method =
      state.range(2) == 1   ? internal::CacheUpdateFp8Method::kDivision
      : state.range(2) == 2 ? internal::CacheUpdateFp8Method::kBracket
                            : internal::CacheUpdateFp8Method::kReciprocal;
  state.SetLabel(state.range(1) == 0    ? "bf16->bf16"
                 : state.range(2) == 1  ? "bf16->fp8_e4m3 scale 0.05, division"
                 : state.range(2) == 2  ? "bf16->fp8_e4m3 scale 0.05, bracket"
                 : unit_scale           ? "bf16->fp8_e4m3 scale 1, unit"
                                        : "bf16->fp8_e4m3 scale 0.05, reciprocal");
  auto run = [&]() -> absl::Status {
    KvCacheSpec spec;
    spec.block_size = kBlockSize;
    spec.num_kv_heads = kKvHeads;
    spec.head_size = spec.head_size_v = kHeadSize;
    spec.dtype = cache_dtype;
    spec.quant_mode = IsFp8(cache_dtype) ? KvQuantMode::kPerTensor : KvQuantMode::kNone;
    const int64_t num_blocks = 2 * tokens / kBlockSize;  // half the cache used, scattered
    ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, RandomCache(*gpu, spec, num_blocks));
    if (unit_scale) {
      const std::vector<float> ones{1.0f};
      RETURN_IF_ERROR(cache->SetScales(ones, ones));
    }
    const size_t elements = static_cast<size_t>(tokens) * kKvHeads * kHeadSize;
    ASSIGN_OR_RETURN(DeviceBuffer key, DeviceBuffer::Create(elements * 2, MemoryKind::kDevice));
    ASSIGN_OR_RETURN(DeviceBuffer value, DeviceBuffer::Create(elements * 2, MemoryKind::kDevice));
    RETURN_IF_ERROR(FillRandom(*gpu, key.data(), elements, DType::kBFloat16, 3));
    RETURN_IF_ERROR(FillRandom(*gpu, value.data(), elements, DType::kBFloat16, 4));
    const std::vector<int32_t> blocks = ShuffledBlocks(num_blocks, 5);
    std::vector<int64_t> slots(static_cast<size_t>(tokens));
    for (int64_t t = 0; t < tokens; ++t) {
      slots[static_cast<size_t>(t)] =
          int64_t{blocks[static_cast<size_t>(t / kBlockSize)]} * kBlockSize + t % kBlockSize;
    }
    ASSIGN_OR_RETURN(DeviceBuffer d_slots, Upload(slots));
    CacheUpdateParams p;
    p.key = key.data();
    p.value = value.data();
    p.key_token_stride = p.value_token_stride = kKvHeads * kHeadSize;
    p.key_head_stride = p.value_head_stride = kHeadSize;
    p.input_dtype = DType::kBFloat16;
    p.slot_mapping = d_slots.data_as<int64_t>();
    p.host_slot_mapping = slots.data();
    p.num_tokens = tokens;
    p.cache = cache->view();
    const double bytes =
        2.0 * static_cast<double>(elements) * (2.0 + static_cast<double>(DTypeSize(cache_dtype)));

    // The reference: a device-to-device copy with the same read + write traffic.
    const size_t copy_bytes = static_cast<size_t>(bytes / 2) / 16 * 16;
    ASSIGN_OR_RETURN(DeviceBuffer src, DeviceBuffer::Create(copy_bytes, MemoryKind::kDevice));
    ASSIGN_OR_RETURN(DeviceBuffer dst, DeviceBuffer::Create(copy_bytes, MemoryKind::kDevice));
    ASSIGN_OR_RETURN(double copy_s, BestSecondsPerCall(*gpu, [&] {
      return CudaErrorToStatus(
          static_cast<int>(cudaMemcpyAsync(dst.data(), src.data(), copy_bytes,
                                           cudaMemcpyDeviceToDevice,
                                           static_cast<cudaStream_t>(gpu->stream.get()))),
          "cudaMemcpyAsync");
    }));
    const double copy_gbps = 2.0 * static_cast<double>(copy_bytes) / copy_s * 1e-9;

    ASSIGN_OR_RETURN(const double seconds, MeanSecondsPerCall(state, *gpu, [&] {
      return internal::CacheUpdateCudaWithMethod(p, gpu->stream.get(), method);
    }));
    const double gbps = bytes / seconds * 1e-9;
    state.counters["GB/s"] = gbps;
    state.counters["memcpy_GB/s"] = copy_gbps;
    state.counters["ratio"] = gbps / copy_gbps;
    return absl::OkStatus();
  };
  const absl::Status st = run();
  if (!st.ok()) Fail(state, st);
}

// Decode: `seqs` sequences of `seq_len` keys, one query token each, over a `cache_dtype`
// cache, on the kernel `kernel_arg` names (0: CUDA cores, 1: tensor cores with cp.async,
// 2: tensor cores with TMA, the default on the bf16 shapes, up to 4 splits merged in the
// kernel as the backend runs it; 3: the TMA kernel with the merge kernel instead) with
// `forced_splits` splits (0: the launcher's choice). TB/s of K and V read once.
void RunDecode(benchmark::State& state, int seqs, int seq_len, int64_t kernel_arg,
               int forced_splits, DType cache_dtype, DType act_dtype = DType::kBFloat16,
               internal::DecodeFp8Staging fp8_staging = internal::DecodeFp8Staging::kAuto) {
  Gpu* gpu = nullptr;
  if (SkipWithoutGpu(state, &gpu)) return;
  const internal::DecodeKernel kernel = kernel_arg >= 2   ? internal::DecodeKernel::kTensorCoresTma
                                        : kernel_arg == 1 ? internal::DecodeKernel::kTensorCores
                                                          : internal::DecodeKernel::kCudaCores;
  auto run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::unique_ptr<PagedBatch> batch,
                     MakePagedBatch(*gpu, seqs, seq_len, 1, 6, cache_dtype, act_dtype));
    const PagedAttentionParams& p = batch->params;
    const KvCacheSpec& spec = batch->spec;
    const KvCache* cache = batch->cache.get();
    const double kv_bytes = static_cast<double>(seqs) * seq_len * kKvHeads *
                            (2.0 * kHeadSize) *
                            static_cast<double>(DTypeSize(cache_dtype));  // K and V

    // The reference: one streaming read of the same K and V buffers.
    ASSIGN_OR_RETURN(const double read_tbps, StreamingReadTbps(*gpu, *cache));

    // The launcher directly, so that the kernel can be chosen; the workspace is allocated
    // once, as a caller that keeps one would.
    ASSIGN_OR_RETURN(internal::PagedKernelParams kp, internal::MakePagedKernelParams(p));
    internal::DecodeLaunchOptions options;
    options.num_sms = gpu->num_sms;
    options.dependent_merge = gpu->compute_major >= 9;  // as the backend launches it
    options.tma = gpu->compute_major >= 9;
    options.kernel = kernel;
    options.num_splits = forced_splits;
    options.fp8_staging = fp8_staging;
    DeviceBuffer workspace;
    options.workspace = [&workspace](size_t bytes) -> absl::StatusOr<void*> {
      if (bytes > workspace.size()) {
        ASSIGN_OR_RETURN(workspace, DeviceBuffer::Create(bytes, MemoryKind::kDevice));
      }
      return workspace.data();
    };
    DeviceBuffer counters;
    if (kernel_arg != 3) {
      options.arrival_counters = [&](size_t count) -> absl::StatusOr<uint32_t*> {
        return internal::ZeroedArrivalCounters(counters, count, count,
                                               static_cast<cudaStream_t>(gpu->stream.get()));
      };
    }
    auto enqueue = [&] {
      return internal::LaunchDecodeAttention(kp, p.q_dtype, p.out_dtype, spec.dtype, options,
                                             static_cast<cudaStream_t>(gpu->stream.get()));
    };
    ASSIGN_OR_RETURN(const double seconds, MeanSecondsPerCall(state, *gpu, enqueue));
    ReportTbps(state, kv_bytes, seconds, read_tbps);
    return absl::OkStatus();
  };
  const absl::Status st = run();
  if (!st.ok()) Fail(state, st);
}

// bf16 cache: range(2) the kernel, range(3) the splits (RunDecode).
void BM_Decode(benchmark::State& state) {
  RunDecode(state, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)),
            state.range(2), static_cast<int>(state.range(3)), DType::kBFloat16);
}

// fp8 e4m3 cache (per-tensor scales; half of bf16's bytes, dequantised in the kernel):
// range(2) the kernel, 0 (CUDA cores) or 1 (tensor cores, the default for fp8), the
// launcher's splits; range(3) the activations, 0 bf16 and 1 fp16; range(4) the tensor-core
// kernel's fp8 staging (internal::DecodeFp8Staging: 0 kAuto, the default, which is
// kInRegisters at these shapes; 1 kShared; 2 kInRegisters). The streaming read is of the
// fp8 cache.
void BM_DecodeFp8(benchmark::State& state) {
  RunDecode(state, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)),
            state.range(2), 0, DType::kFloat8E4M3,
            state.range(3) == 0 ? DType::kBFloat16 : DType::kFloat16,
            static_cast<internal::DecodeFp8Staging>(state.range(4)));
}

// Decode's reads alone: the K and V rows BM_Decode reads, from BM_Decode's batch, through
// LaunchPagedRead (no compute; `splits` CTAs per sequence and
// head). `order` 0: BM_Decode's shuffled block table; 1: the same table sorted, so that
// each sequence's blocks lie in order; 2: no table, each (sequence, head)'s keys one
// contiguous run (the unpaged layout torch's decode reads). TB/s of K and V read, and the
// ratio to the streaming read of the same buffers.
void BM_PagedRead(benchmark::State& state) {
  Gpu* gpu = nullptr;
  if (SkipWithoutGpu(state, &gpu)) return;
  const int seqs = static_cast<int>(state.range(0));
  const int seq_len = static_cast<int>(state.range(1));
  const int64_t order = state.range(2);
  const int splits = static_cast<int>(state.range(3));
  auto run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::unique_ptr<PagedBatch> batch, MakePagedBatch(*gpu, seqs, seq_len, 1, 6));
    std::vector<int32_t> sorted = batch->block_table;
    std::sort(sorted.begin(), sorted.end());
    ASSIGN_OR_RETURN(DeviceBuffer d_sorted, Upload(sorted));
    ASSIGN_OR_RETURN(DeviceBuffer sink,
                     DeviceBuffer::Create(static_cast<size_t>(kKvHeads) * seqs * splits * 4,
                                          MemoryKind::kDevice));
    const KvCacheView view = batch->cache->view();
    bench::PagedReadArgs args{};
    args.k = view.k;
    args.v = view.v;
    args.table = order == 2   ? nullptr
                 : order == 1 ? d_sorted.data_as<int32_t>()
                              : batch->d_table.data_as<int32_t>();
    args.seqs = seqs;
    args.seq_len = seq_len;
    args.heads = kKvHeads;
    args.splits = splits;
    args.blocks_per_seq = static_cast<int>(batch->params.block_table_stride);
    args.block_shift = 4;  // kBlockSize
    args.block_stride = view.k_strides.block * 2;
    args.token_stride = view.k_strides.token * 2;
    args.head_stride = view.k_strides.head * 2;
    args.sink = sink.data_as<uint32_t>();
    ASSIGN_OR_RETURN(const double read_tbps, StreamingReadTbps(*gpu, *batch->cache));
    const double kv_bytes = static_cast<double>(seqs) * seq_len * kKvHeads * kHeadSize * 2.0 * 2.0;
    auto enqueue = [&] {
      return CudaErrorToStatus(bench::LaunchPagedRead(args, gpu->stream.get()), "paged read");
    };
    ASSIGN_OR_RETURN(const double seconds, MeanSecondsPerCall(state, *gpu, enqueue));
    ReportTbps(state, kv_bytes, seconds, read_tbps);
    return absl::OkStatus();
  };
  const absl::Status st = run();
  if (!st.ok()) Fail(state, st);
}

// Prefill: one sequence of `tokens` tokens, causal, all of them queries, 32/8 heads, d128,
// bf16, in pages of `block_size` tokens. `kernel` 0: the mma.sync baseline variant; 1: its
// fast variant; 2: the wgmma kernel (sm_90a), single CTAs; 3: the wgmma kernel, CTA pairs
// (PrefillWgmmaCluster); `heads_outer` 0 or 1: its grid's KV heads inner or outer
// (PrefillWgmmaOrder); `persistent` 0 or 1: a CTA (pair) per unit or persistent CTAs
// (PrefillWgmmaGrid); `schedule` 0 for the launcher's default or 1, 2, 3 for serial,
// overlap and ping-pong (PrefillWgmmaSchedule, in the enum's order).
void BM_Prefill(benchmark::State& state) {
  Gpu* gpu = nullptr;
  if (SkipWithoutGpu(state, &gpu)) return;
  const int tokens = static_cast<int>(state.range(0));
  const int block_size = static_cast<int>(state.range(1));
  const int64_t kernel = state.range(2);
  const bool heads_outer = state.range(3) != 0;
  const bool persistent = state.range(4) != 0;
  const auto schedule = static_cast<internal::PrefillWgmmaSchedule>(state.range(5));
  if (kernel >= 2 && !(gpu->compute_major == 9 && internal::PrefillWgmmaCompiled())) {
    state.SkipWithError("the wgmma kernel needs compute capability 9.0 and a build for sm_90a");
    return;
  }
  auto run = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::unique_ptr<PagedBatch> batch,
                     MakePagedBatch(*gpu, 1, tokens, tokens, 8, DType::kBFloat16,
                                    DType::kBFloat16, block_size));
    const PagedAttentionParams& p = batch->params;
    const double n = tokens;
    const double flops = 4.0 * n * n * kHeadSize * kHeads / 2.0;
    ASSIGN_OR_RETURN(const internal::PagedKernelParams kp, internal::MakePagedKernelParams(p));
    internal::PrefillLaunchOptions options;
    options.variant = kernel == 0   ? internal::PrefillVariant::kBaseline
                      : kernel == 1 ? internal::PrefillVariant::kFast
                                    : internal::PrefillVariant::kWgmma;
    options.wgmma = kernel >= 2;
    options.wgmma_cluster =
        kernel == 3 ? internal::PrefillWgmmaCluster::kPair : internal::PrefillWgmmaCluster::kSingle;
    options.wgmma_order =
        heads_outer ? internal::PrefillWgmmaOrder::kHeadsOuter : internal::PrefillWgmmaOrder::kHeadsInner;
    options.wgmma_grid =
        persistent ? internal::PrefillWgmmaGrid::kPersistent : internal::PrefillWgmmaGrid::kPerUnit;
    options.wgmma_schedule = schedule;
    const auto enqueue = [&] {
      return internal::LaunchPrefillAttention(kp, DType::kBFloat16, DType::kBFloat16,
                                              DType::kBFloat16, options,
                                              static_cast<cudaStream_t>(gpu->stream.get()));
    };

    ASSIGN_OR_RETURN(const double seconds,
                     MeanSecondsPerCall(state, *gpu, enqueue, /*launches=*/5));
    state.counters["TFLOP/s"] = flops / seconds * 1e-12;
    return absl::OkStatus();
  };
  const absl::Status st = run();
  if (!st.ok()) Fail(state, st);
}

BENCHMARK(BM_CacheUpdate)
    ->ArgNames({"tokens", "fp8", "method"})
    ->Apply([](benchmark::internal::Benchmark* b) {
      for (const int64_t tokens : {4096, 16384, 65536}) {
        b->Args({tokens, 0, 0});  // bf16 cache (the method does not apply)
        b->Args({tokens, 1, 0});  // fp8, scale 0.05: reciprocal (the split reciprocal)
        b->Args({tokens, 1, 2});  // fp8, scale 0.05: the bracket
        b->Args({tokens, 1, 1});  // fp8, scale 0.05: division
        b->Args({tokens, 2, 0});  // fp8, scale 1 (the default): no multiply
      }
    })
    ->UseManualTime()
    ->Iterations(kIterations)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Decode)
    ->ArgNames({"seqs", "seq_len", "kernel", "splits"})
    ->Apply([](benchmark::internal::Benchmark* b) {
      for (const int64_t kernel : {0, 1, 2, 3}) {
        b->Args({64, 4096, kernel, 0});
        b->Args({16, 32768, kernel, 0});
      }
      // The launchers' split choices against fixed ones (tensor cores, cp.async and TMA).
      for (const int64_t splits : {1, 2, 4, 8}) b->Args({64, 4096, 1, splits});
      for (const int64_t splits : {4, 8, 16, 32, 64}) b->Args({16, 32768, 1, splits});
      for (const int64_t splits : {1, 2}) b->Args({64, 4096, 2, splits});
      for (const int64_t splits : {2, 4, 8}) b->Args({16, 32768, 2, splits});
      // A batch below one wave (64 CTAs without splits): the launcher's choice against
      // fixed ones.
      for (const int64_t splits : {0, 2, 4, 8, 16}) b->Args({8, 4096, 1, splits});
      for (const int64_t splits : {0, 4, 8, 16}) b->Args({8, 4096, 2, splits});
      b->Args({8, 4096, 3, 0});
    })
    ->UseManualTime()
    ->Iterations(kIterations)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeFp8)
    ->ArgNames({"seqs", "seq_len", "kernel", "fp16", "staging"})
    ->Apply([](benchmark::internal::Benchmark* b) {
      for (const int64_t fp16 : {0, 1}) {
        b->Args({64, 4096, 0, fp16, 0});
        b->Args({16, 32768, 0, fp16, 0});
        // Each staging in turn per shape, so that a drift of the clock touches all alike.
        for (int64_t staging = 0; staging <= 2; ++staging) {
          b->Args({64, 4096, 1, fp16, staging});
        }
        for (int64_t staging = 0; staging <= 2; ++staging) {
          b->Args({16, 32768, 1, fp16, staging});
        }
      }
    })
    ->UseManualTime()
    ->Iterations(kIterations)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PagedRead)
    ->ArgNames({"seqs", "seq_len", "order", "splits"})
    ->Apply([](benchmark::internal::Benchmark* b) {
      for (const int64_t order : {0, 1, 2}) {
        for (const int64_t splits : {1, 4, 8}) b->Args({64, 4096, order, splits});
        for (const int64_t splits : {4, 8}) b->Args({16, 32768, order, splits});
      }
    })
    ->UseManualTime()
    ->Iterations(kIterations)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Prefill)
    ->ArgNames({"tokens", "block", "kernel", "heads_outer", "persistent", "schedule"})
    ->Apply([](benchmark::internal::Benchmark* b) {
      b->Args({8192, 16, 0, 0, 0, 0});
      b->Args({8192, 16, 1, 0, 0, 0});
      // The wgmma kernel's clusterings, grid orders, grids and schedules side by side, per
      // length and page size.
      for (const int64_t tokens : {4096, 8192, 16384, 32768}) {
        for (const int64_t block : {16, 64}) {
          for (const int64_t kernel : {2, 3}) {
            for (const int64_t outer : {0, 1}) {
              for (const int64_t persistent : {0, 1}) {
                b->Args({tokens, block, kernel, outer, persistent, 0});
              }
            }
            for (const int64_t schedule : {1, 2, 3})
              b->Args({tokens, block, kernel, 1, 0, schedule});
          }
        }
      }
    })
    ->UseManualTime()
    ->Iterations(kIterations)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvstream

BENCHMARK_MAIN();
