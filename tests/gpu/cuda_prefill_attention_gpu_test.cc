// Tests of the CUDA prefill attention kernel (LaunchPrefillAttention, prefill_attention.cuh)
// against the golden CPU reference (RunAttentionReference) on the same inputs: grids of
// block sizes, GQA ratios, head sizes (padded and not, head_size_v != head_size), query and
// cache dtypes (fp8 with per-tensor and per-head scales), NHD / HND, strided and dense
// query/output rows, causal and bidirectional masks, sliding windows, ALiBi and soft caps,
// over mixed batches of prefills, chunked prefills, decode rows and empty queries. Also the
// exact extent of the masks, the limits the launcher rejects, and a timing of the large
// causal prefill the kernel is tuned for. Each grid runs every variant: the baseline, the
// fast one and, on a compute capability 9.0 device of a build with sm_90a code, the wgmma
// kernel (prefill_wgmma.cuh), each where it applies; the wgmma kernel's own edge cases
// (block sizes 16 to 256, page boundaries, tiny and ragged sequences) have a test of
// their own.
//
// Every test skips where no GPU can be used.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention_test_util.h"
#include "cuda/kernel_params.h"
#include "cuda/launchers.h"
#include "gpu_test_util.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/numeric.h"

namespace kvstream {
namespace {

using ::kvstream::gpu_test::ExpectQueryRowsClose;
using ::kvstream::testing_util::AttnCase;
using ::kvstream::testing_util::AttnProblem;
using ::kvstream::testing_util::CacheKind;
using ::kvstream::testing_util::FeatureGridCase;
using ::kvstream::testing_util::HeadConfig;
using ::kvstream::testing_util::HeadSizes;
using ::kvstream::testing_util::QuantSuffix;
using ::kvstream::testing_util::SeqSpec;
using ::kvstream::testing_util::ShapeGridCase;
using ::kvstream::testing_util::ShortDType;
using ::kvstream::testing_util::TestLayout;
using ::kvstream::testing_util::TestLayoutName;

#define SKIP_WITHOUT_GPU()                                              \
  do {                                                                  \
    const absl::Status gpu_status = CudaAvailability();                 \
    if (!gpu_status.ok()) {                                             \
      GTEST_SKIP() << "no usable GPU: " << gpu_status.message();        \
    }                                                                   \
  } while (0)

// A device allocation owned by the test; freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Allocates `bytes` (at least 1) and copies `host` (may be null: no copy) into it.
  absl::Status Upload(const void* host, size_t bytes) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = std::max<size_t>(bytes, 1);
    cudaError_t e = cudaMalloc(&ptr_, bytes_);
    if (e != cudaSuccess) return CudaErrorToStatus(e, "cudaMalloc");
    if (host != nullptr && bytes > 0) {
      e = cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice);
      if (e != cudaSuccess) return CudaErrorToStatus(e, "cudaMemcpy to device");
    }
    return absl::OkStatus();
  }
  absl::Status Download(void* host, size_t bytes) const {
    return CudaErrorToStatus(cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost),
                             "cudaMemcpy to host");
  }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

size_t CacheBytes(const PagedAttentionParams& p, const CacheStrides& st, int dim) {
  const KvCacheSpec& spec = p.cache.spec;
  const int64_t last =
      st.Offset(p.cache.num_blocks - 1, spec.block_size - 1, spec.num_kv_heads - 1, dim - 1);
  return static_cast<size_t>(last + 1) * DTypeSize(spec.dtype);
}

// How the GPU run lays out its activations.
struct GpuIo {
  // false: the problem's own strided rows (odd token strides: unaligned, element path);
  // true: dense rows [num_tokens][num_heads][head_size] (16-byte chunks when sizes allow).
  bool dense = false;
  // Which kernel configuration runs. kFast or kWgmma where it does not apply (or, for
  // kWgmma, where the device cannot run it): RunOnGpu returns Unimplemented and launches
  // nothing.
  internal::PrefillVariant variant = internal::PrefillVariant::kAuto;
  // The wgmma kernel's schedule, CTA clustering and grid order (kWgmma and kAuto).
  internal::PrefillWgmmaSchedule schedule = internal::PrefillWgmmaSchedule::kDefault;
  internal::PrefillWgmmaCluster cluster = internal::PrefillWgmmaCluster::kDefault;
  internal::PrefillWgmmaOrder order = internal::PrefillWgmmaOrder::kDefault;
  internal::PrefillWgmmaGrid grid = internal::PrefillWgmmaGrid::kDefault;
  int max_ctas = 0;  // persistent grids: at most this many CTAs (pairs); 0: the device's
};

using internal::PrefillWgmmaCluster;
const char* ClusterName(PrefillWgmmaCluster c) {
  switch (c) {
    case PrefillWgmmaCluster::kSingle: return "single CTAs";
    case PrefillWgmmaCluster::kPair: return "CTA pairs";
    default: return "default clustering";
  }
}
constexpr PrefillWgmmaCluster kClusters[] = {PrefillWgmmaCluster::kSingle,
                                             PrefillWgmmaCluster::kPair};
bool TmaTakesBlocks(int block_size) {
  return block_size >= 16 && block_size <= 256 && (block_size & (block_size - 1)) == 0;
}

using internal::PrefillWgmmaSchedule;
const char* ScheduleName(PrefillWgmmaSchedule s) {
  switch (s) {
    case PrefillWgmmaSchedule::kSerial: return "serial";
    case PrefillWgmmaSchedule::kOverlap: return "overlap";
    case PrefillWgmmaSchedule::kPingPong: return "ping-pong";
    default: return "default";
  }
}
constexpr PrefillWgmmaSchedule kSchedules[] = {
    PrefillWgmmaSchedule::kSerial, PrefillWgmmaSchedule::kOverlap, PrefillWgmmaSchedule::kPingPong};

using internal::PrefillVariant;
const char* VariantName(PrefillVariant v) {
  switch (v) {
    case PrefillVariant::kFast: return "fast";
    case PrefillVariant::kBaseline: return "baseline";
    case PrefillVariant::kWgmma: return "wgmma";
    default: return "auto";
  }
}

// Whether this device and build run the wgmma kernel (PrefillLaunchOptions::wgmma).
bool DeviceRunsWgmma() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0 && internal::PrefillWgmmaCompiled();
}

const std::vector<PrefillVariant>& AllVariants() {
  static const std::vector<PrefillVariant> v = {PrefillVariant::kBaseline, PrefillVariant::kFast,
                                                PrefillVariant::kWgmma};
  return v;
}

// Runs the CUDA kernel on device copies of `host` (a problem's host params) and leaves the
// result in `out`, which has the layout and contents of AttnProblem::NewOut() beforehand.
absl::Status RunOnGpu(const PagedAttentionParams& host, std::vector<uint8_t>& out,
                      const GpuIo& io = {}, float* milliseconds = nullptr, int repeats = 1) {
  const size_t q_elem = DTypeSize(host.q_dtype);
  const size_t o_elem = DTypeSize(host.out_dtype);
  const int head_size = host.cache.spec.head_size;
  const int head_size_v = host.cache.spec.head_size_v;
  const int64_t q_row = int64_t{host.num_heads} * head_size;    // elements of one token
  const int64_t o_row = int64_t{host.num_heads} * head_size_v;

  PagedAttentionParams dev = host;
  DeviceBuffer q, o, k, v, loc, lens, table, slopes;
  if (io.dense) {
    std::vector<uint8_t> dense(static_cast<size_t>(host.num_tokens * q_row) * q_elem);
    for (int64_t t = 0; t < host.num_tokens; ++t) {
      std::memcpy(dense.data() + t * q_row * q_elem,
                  static_cast<const uint8_t*>(host.q) + t * host.q_token_stride * q_elem,
                  static_cast<size_t>(q_row) * q_elem);
    }
    if (absl::Status s = q.Upload(dense.data(), dense.size()); !s.ok()) return s;
    dev.q_token_stride = q_row;
    std::vector<uint8_t> dense_out(static_cast<size_t>(host.num_tokens * o_row) * o_elem,
                                   AttnProblem::kSentinel);
    if (absl::Status s = o.Upload(dense_out.data(), dense_out.size()); !s.ok()) return s;
    dev.o_token_stride = o_row;
  } else {
    const size_t q_bytes = static_cast<size_t>(host.num_tokens * host.q_token_stride) * q_elem;
    if (absl::Status s = q.Upload(host.q, q_bytes); !s.ok()) return s;
    if (absl::Status s = o.Upload(out.data(), out.size()); !s.ok()) return s;
  }
  if (absl::Status s = k.Upload(host.cache.k, CacheBytes(host, host.cache.k_strides, head_size));
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          v.Upload(host.cache.v, CacheBytes(host, host.cache.v_strides, head_size_v));
      !s.ok()) {
    return s;
  }
  const size_t num_seqs = static_cast<size_t>(host.num_seqs);
  if (absl::Status s = loc.Upload(host.query_start_loc, (num_seqs + 1) * sizeof(int32_t));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = lens.Upload(host.seq_lens, num_seqs * sizeof(int32_t)); !s.ok()) return s;
  if (absl::Status s = table.Upload(
          host.block_table, num_seqs * static_cast<size_t>(host.block_table_stride) * 4);
      !s.ok()) {
    return s;
  }
  if (host.alibi_slopes != nullptr) {
    if (absl::Status s = slopes.Upload(host.alibi_slopes,
                                       static_cast<size_t>(host.num_heads) * sizeof(float));
        !s.ok()) {
      return s;
    }
    dev.alibi_slopes = static_cast<const float*>(slopes.get());
  }
  dev.q = q.get();
  dev.out = o.get();
  dev.cache.k = k.get();
  dev.cache.v = v.get();
  dev.cache.memory = MemoryKind::kDevice;
  dev.query_start_loc = static_cast<const int32_t*>(loc.get());
  dev.seq_lens = static_cast<const int32_t*>(lens.get());
  dev.block_table = static_cast<const int32_t*>(table.get());
  dev.host.query_start_loc = host.query_start_loc;
  dev.host.seq_lens = host.seq_lens;
  dev.host.block_table = host.block_table;
  dev.host.alibi_slopes = host.alibi_slopes;

  absl::StatusOr<internal::PagedKernelParams> kernel_params = internal::MakePagedKernelParams(dev);
  if (!kernel_params.ok()) return kernel_params.status();
  if (io.variant == PrefillVariant::kFast &&
      !internal::PrefillFastVariantApplies(*kernel_params, host.q_dtype,
                                           host.cache.spec.dtype)) {
    return absl::UnimplementedError("the fast variant does not apply");
  }
  const bool wgmma = DeviceRunsWgmma();
  if (io.variant == PrefillVariant::kWgmma) {
    if (!wgmma) return absl::UnimplementedError("this device does not run the wgmma kernel");
    if (!internal::PrefillWgmmaApplies(*kernel_params, host.q_dtype, host.out_dtype,
                                       host.cache.spec.dtype)) {
      return absl::UnimplementedError("the wgmma kernel does not apply");
    }
  }
  internal::PrefillLaunchOptions launch_options;
  launch_options.variant = io.variant;
  launch_options.wgmma = wgmma;
  launch_options.wgmma_schedule = io.schedule;
  launch_options.wgmma_cluster = io.cluster;
  launch_options.wgmma_order = io.order;
  launch_options.wgmma_grid = io.grid;
  launch_options.wgmma_max_ctas = io.max_ctas;
  cudaEvent_t start = nullptr, stop = nullptr;
  if (milliseconds != nullptr) {
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
  }
  for (int i = 0; i < repeats; ++i) {
    if (i == 1 && start != nullptr) cudaEventRecord(start);  // the first run warms up
    if (absl::Status s = internal::LaunchPrefillAttention(*kernel_params, host.q_dtype,
                                                          host.out_dtype, host.cache.spec.dtype,
                                                          launch_options, nullptr);
        !s.ok()) {
      return s;
    }
  }
  if (start != nullptr) {
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    cudaEventElapsedTime(milliseconds, start, stop);
    *milliseconds /= static_cast<float>(std::max(1, repeats - 1));
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  if (absl::Status s = CudaErrorToStatus(cudaDeviceSynchronize(), "prefill attention kernel");
      !s.ok()) {
    return s;
  }
  if (io.dense) {
    std::vector<uint8_t> dense_out(static_cast<size_t>(host.num_tokens * o_row) * o_elem);
    if (absl::Status s = o.Download(dense_out.data(), dense_out.size()); !s.ok()) return s;
    for (int64_t t = 0; t < host.num_tokens; ++t) {
      std::memcpy(out.data() + t * host.o_token_stride * o_elem,
                  dense_out.data() + t * o_row * o_elem, static_cast<size_t>(o_row) * o_elem);
    }
    return absl::OkStatus();
  }
  return o.Download(out.data(), out.size());
}

// Absolute + relative tolerance for outputs in [-1, 1]: the flash kernel rounds P to the
// 16-bit type before P V, and both sides round the output once.
float AbsTolerance(DType dtype) { return dtype == DType::kFloat16 ? 4e-3f : 1.2e-2f; }

// Whether the fast variant must run `c` (PrefillFastVariantApplies): the cache in q's
// dtype, equal head sizes of 64 or 128, and a layout whose rows are 16-byte aligned.
bool FastVariantExpected(const AttnCase& c) {
  return c.cache_dtype == c.q_dtype && c.head_size == c.head_size_v &&
         (c.head_size == 64 || c.head_size == 128) && c.layout != TestLayout::kPadded;
}

// Whether the wgmma kernel must run `c` on a device that runs it (PrefillWgmmaApplies):
// the cache in q's dtype or fp8, equal head sizes of 64, 128 or (16-bit caches) 256,
// dense (16-byte aligned) activations and cache rows, and a block size TMA boxes take (a
// power of two in [16, 256]).
bool WgmmaExpected(const AttnCase& c, const GpuIo& io) {
  const bool fp8 = IsFp8(c.cache_dtype);
  return (c.cache_dtype == c.q_dtype || fp8) && c.head_size == c.head_size_v &&
         (c.head_size == 64 || c.head_size == 128 || (c.head_size == 256 && !fp8)) &&
         c.layout != TestLayout::kPadded && io.dense && TmaTakesBlocks(c.block_size);
}

void ExpectVariantMatchesReference(AttnProblem& pb, const std::vector<uint8_t>& ref_out,
                                   const GpuIo& io);

// Runs the reference once and the GPU kernel on `pb` in both variants (the fast one where
// it applies, failing if it does not where FastVariantExpected says it must) and compares
// every output element; checks that nothing outside the batch's rows was written and that
// no NaN appeared.
void ExpectGpuMatchesReference(AttnProblem& pb, const GpuIo& io = {}) {
  std::vector<uint8_t> ref_out = pb.NewOut();
  const absl::Status ref_status = RunAttentionReference(pb.params(ref_out));
  ASSERT_TRUE(ref_status.ok()) << ref_status;
  for (PrefillVariant variant : AllVariants()) {
    GpuIo variant_io = io;
    variant_io.variant = variant;
    if (variant != PrefillVariant::kWgmma) {
      SCOPED_TRACE(absl::StrCat(VariantName(variant), " variant"));
      ExpectVariantMatchesReference(pb, ref_out, variant_io);
      continue;
    }
    for (PrefillWgmmaCluster cluster : kClusters) {  // every schedule and clustering
      for (PrefillWgmmaSchedule schedule : kSchedules) {
        SCOPED_TRACE(absl::StrCat("wgmma variant, ", ClusterName(cluster), ", ",
                                  ScheduleName(schedule), " schedule"));
        variant_io.schedule = schedule;
        variant_io.cluster = cluster;
        ExpectVariantMatchesReference(pb, ref_out, variant_io);
      }
    }
  }
}

void ExpectVariantMatchesReference(AttnProblem& pb, const std::vector<uint8_t>& ref_out,
                                   const GpuIo& io) {
  const AttnCase& c = pb.config();
  std::vector<uint8_t> out = pb.NewOut();
  const absl::Status st = RunOnGpu(pb.params(out), out, io);
  if (io.variant == PrefillVariant::kFast && absl::IsUnimplemented(st)) {
    EXPECT_FALSE(FastVariantExpected(c)) << "the fast variant should apply: " << st;
    return;
  }
  if (io.variant == PrefillVariant::kWgmma && absl::IsUnimplemented(st)) {
    EXPECT_FALSE(DeviceRunsWgmma() && WgmmaExpected(c, io))
        << "the wgmma kernel should apply: " << st;
    return;
  }
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(pb.CountStrayWrites(out), 0) << "wrote outside the batch's rows";
  // Absolute tolerance by dtype, plus 1% relative.
  ExpectQueryRowsClose(pb, ref_out, out, AbsTolerance(c.out_dtype), 1e-2);
}

// The batch most grids use: prefill, chunked prefill and decode rows, an empty query, and
// a prefill long enough for several query and key tiles (130 tokens x the group's heads).
std::vector<SeqSpec> MixedBatch() {
  return {{0, 33}, {67, 33}, {99, 1}, {6, 1}, {0, 7}, {0, 1}, {20, 0}, {0, 130}};
}

// ---------------------------------------------------------------------------------------
// Block sizes x head configurations, each over every head size (64, 80, 128, 256, and
// head_size_v != head_size: 192/128, 64/48), bfloat16.

class CudaPrefillShapeTest : public ::testing::TestWithParam<std::tuple<int, HeadConfig>> {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaPrefillShapeTest, MatchesReference) {
  const auto& [block_size, heads] = GetParam();
  for (HeadSizes sizes : {HeadSizes{64, 64}, HeadSizes{80, 80}, HeadSizes{128, 128},
                          HeadSizes{256, 256}, HeadSizes{192, 128}, HeadSizes{64, 48}}) {
    SCOPED_TRACE(absl::StrCat("head_size ", sizes.k, " head_size_v ", sizes.v));
    AttnCase c = ShapeGridCase(block_size, heads, sizes);
    c.q_dtype = DType::kBFloat16;
    c.out_dtype = DType::kBFloat16;
    c.seqs = MixedBatch();
    c.seed = static_cast<uint32_t>(block_size * 1000 + heads.group * 10 + sizes.v);
    AttnProblem pb(c);
    ExpectGpuMatchesReference(pb, GpuIo{sizes.k == 128});
    if (HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaPrefillShapeTest,
    ::testing::Combine(::testing::Values(1, 5, 16),
                       ::testing::Values(HeadConfig{4, 1}, HeadConfig{2, 2}, HeadConfig{2, 4},
                                         HeadConfig{2, 8}, HeadConfig{1, 3})),
    [](const auto& test_info) {
      const HeadConfig& h = std::get<1>(test_info.param);
      return absl::StrCat("bs", std::get<0>(test_info.param), "_kv", h.num_kv_heads, "x", h.group,
                          h.group == 1 ? "_MHA" : h.num_kv_heads == 1 ? "_MQA" : "_GQA");
    });

// ---------------------------------------------------------------------------------------
// Query dtype x cache dtype and scale mode, each over layouts, head sizes (fp8 rows of 80
// bytes and padded layouts take the element path, the others cp.async) and strided / dense
// activations.

// CacheKind::dtype kFloat16 here means "the query's 16-bit type".
class CudaPrefillDTypeTest : public ::testing::TestWithParam<std::tuple<DType, CacheKind>> {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaPrefillDTypeTest, MatchesReference) {
  const auto& [q_dtype, cache] = GetParam();
  // kPadded's odd head and token gaps leave no row 16-byte aligned: the element path.
  for (TestLayout layout : {TestLayout::kNHD, TestLayout::kHND, TestLayout::kPadded}) {
    for (HeadSizes sizes : {HeadSizes{64, 64}, HeadSizes{80, 80}, HeadSizes{128, 128},
                            HeadSizes{96, 48}}) {
      for (bool dense : {false, true}) {
        SCOPED_TRACE(absl::StrCat(TestLayoutName(layout), " head_size ", sizes.k, "/", sizes.v,
                                  dense ? " dense" : " strided"));
        AttnCase c;
        c.q_dtype = q_dtype;
        c.out_dtype = q_dtype;
        c.cache_dtype = IsFp8(cache.dtype) ? cache.dtype : q_dtype;
        c.quant = cache.quant;
        c.layout = layout;
        c.block_size = 16;
        c.head_size = sizes.k;
        c.head_size_v = sizes.v;
        c.seqs = {{0, 7}, {26, 7}, {99, 1}, {0, 1}, {32, 1}, {3, 70}};
        c.seed = 7;
        AttnProblem pb(c);
        ExpectGpuMatchesReference(pb, GpuIo{dense});
        if (HasFailure()) return;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllDTypes, CudaPrefillDTypeTest,
    ::testing::Combine(::testing::Values(DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(CacheKind{DType::kFloat16, KvQuantMode::kNone},
                                         CacheKind{DType::kFloat8E4M3, KvQuantMode::kPerTensor},
                                         CacheKind{DType::kFloat8E4M3, KvQuantMode::kPerHead},
                                         CacheKind{DType::kFloat8E5M2, KvQuantMode::kPerTensor},
                                         CacheKind{DType::kFloat8E5M2, KvQuantMode::kPerHead})),
    [](const auto& test_info) {
      const CacheKind& cache = std::get<1>(test_info.param);
      const bool fp8 = IsFp8(cache.dtype);
      return absl::StrCat("q", ShortDType(std::get<0>(test_info.param)), "_cache",
                          fp8 ? ShortDType(cache.dtype) : "Same",
                          QuantSuffix(cache.quant));
    });

// ---------------------------------------------------------------------------------------
// Features: causal or not x sliding window x ALiBi x soft cap, each over head_size_v 64 and
// 48 and both layouts, with sequences long enough to skip whole key tiles.

using FeatureParam = std::tuple<bool, int, bool, bool>;
class CudaPrefillFeatureTest : public ::testing::TestWithParam<FeatureParam> {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaPrefillFeatureTest, MatchesReference) {
  const auto& [causal, window, alibi, cap] = GetParam();
  for (int head_size_v : {64, 48}) {
    for (TestLayout layout : {TestLayout::kNHD, TestLayout::kHND}) {
      SCOPED_TRACE(absl::StrCat("head_size_v ", head_size_v, " ", TestLayoutName(layout)));
      AttnCase c = FeatureGridCase({causal, window, alibi, cap, head_size_v, layout});
      c.q_dtype = DType::kBFloat16;
      c.out_dtype = DType::kBFloat16;
      c.seqs = {{0, 21}, {150, 20}, {200, 1}, {3, 1}, {40, 3}, {0, 150}, {250, 0}};
      AttnProblem pb(c);
      ExpectGpuMatchesReference(pb, GpuIo{layout == TestLayout::kHND});
      if (HasFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Features, CudaPrefillFeatureTest,
    ::testing::Combine(::testing::Bool(), ::testing::Values(0, 5, 70), ::testing::Bool(),
                       ::testing::Bool()),
    [](const auto& test_info) {
      const FeatureParam& f = test_info.param;
      return absl::StrCat(std::get<0>(f) ? "causal" : "bidir", "_window", std::get<1>(f),
                          std::get<2>(f) ? "_alibi" : "", std::get<3>(f) ? "_cap" : "");
    });

// ---------------------------------------------------------------------------------------
// Long mixed batches: many query tiles (517 tokens x 4 heads per KV head), many key tiles,
// odd lengths, a decode row far into a long sequence, an empty query.

struct LongCase {
  const char* name;
  DType q_dtype;
  DType cache_dtype;
  KvQuantMode quant;
  bool causal;
  int window;
  bool alibi_and_cap;
  bool dense;
};

class CudaPrefillLongTest : public ::testing::TestWithParam<LongCase> {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaPrefillLongTest, MatchesReference) {
  const LongCase& lc = GetParam();
  AttnCase c;
  c.q_dtype = lc.q_dtype;
  c.out_dtype = lc.q_dtype;
  c.cache_dtype = lc.cache_dtype;
  c.quant = lc.quant;
  c.causal = lc.causal;
  c.sliding_window = lc.window;
  c.alibi = lc.alibi_and_cap;
  c.soft_cap = lc.alibi_and_cap ? 30.0f : 0.0f;
  c.num_kv_heads = 2;
  c.group = 4;
  c.head_size = 128;
  c.head_size_v = 128;
  c.block_size = 16;
  c.seqs = {{0, 517}, {300, 130}, {1000, 1}, {0, 7}, {77, 0}, {5, 1}, {1, 1}};
  c.seed = 3;
  AttnProblem pb(c);
  ExpectGpuMatchesReference(pb, GpuIo{lc.dense});
}

INSTANTIATE_TEST_SUITE_P(
    Batches, CudaPrefillLongTest,
    ::testing::Values(
        LongCase{"bf16_causal", DType::kBFloat16, DType::kBFloat16, KvQuantMode::kNone, true, 0,
                 false, true},
        LongCase{"bf16_causal_strided", DType::kBFloat16, DType::kBFloat16, KvQuantMode::kNone,
                 true, 0, false, false},
        LongCase{"bf16_bidir", DType::kBFloat16, DType::kBFloat16, KvQuantMode::kNone, false, 0,
                 false, true},
        LongCase{"bf16_causal_window100", DType::kBFloat16, DType::kBFloat16,
                 KvQuantMode::kNone, true, 100, false, true},
        LongCase{"bf16_bidir_window100", DType::kBFloat16, DType::kBFloat16, KvQuantMode::kNone,
                 false, 100, false, true},
        LongCase{"bf16_causal_alibi_cap", DType::kBFloat16, DType::kBFloat16,
                 KvQuantMode::kNone, true, 0, true, true},
        LongCase{"f16_causal", DType::kFloat16, DType::kFloat16, KvQuantMode::kNone, true, 0,
                 false, true},
        LongCase{"bf16_e4m3_perhead_causal", DType::kBFloat16, DType::kFloat8E4M3,
                 KvQuantMode::kPerHead, true, 0, false, true},
        LongCase{"f16_e5m2_pertensor_window100_alibi_cap", DType::kFloat16, DType::kFloat8E5M2,
                 KvQuantMode::kPerTensor, true, 100, true, false}),
    [](const auto& test_info) { return std::string(test_info.param.name); });

// ---------------------------------------------------------------------------------------
// The masks' exact extent: changing the key and value at one position moves exactly the
// outputs of the queries that see it, and leaves the others bit for bit (the kernel is
// deterministic).

TEST(CudaPrefillMaskTest, OneKeyMovesExactlyTheRowsThatSeeIt) {
  SKIP_WITHOUT_GPU();
  struct MaskCase {
    bool causal;
    int window;
  };
  for (MaskCase mc : {MaskCase{true, 0}, MaskCase{false, 0}, MaskCase{true, 4},
                      MaskCase{false, 4}, MaskCase{true, 70}, MaskCase{false, 65}}) {
    for (int pos : {0, 63, 64, 70, 127, 149}) {
      for (PrefillVariant variant : AllVariants()) {
        if (variant == PrefillVariant::kWgmma && !DeviceRunsWgmma()) continue;
        SCOPED_TRACE(absl::StrCat(mc.causal ? "causal" : "bidirectional", " window ", mc.window,
                                  " key ", pos, " ", VariantName(variant), " variant"));
        AttnCase c;
        c.seqs = {{10, 140}};  // query positions 10 .. 149
        c.num_kv_heads = 1;
        c.group = 2;
        c.causal = mc.causal;
        c.sliding_window = mc.window;
        // float16: an output's last place is small enough that every row that sees the
        // changed key moves.
        c.q_dtype = DType::kFloat16;
        c.out_dtype = DType::kFloat16;
        c.cache_dtype = DType::kFloat16;
        c.pad_tokens = 1;
        AttnProblem pb(c);
        std::vector<uint8_t> before = pb.NewOut();
        GpuIo io;
        io.variant = variant;
        io.dense = variant == PrefillVariant::kWgmma;  // its rows must be 16-byte aligned
        const absl::Status first = RunOnGpu(pb.params(before), before, io);
        ASSERT_TRUE(first.ok()) << first;
        for (int d = 0; d < c.head_size; ++d) pb.SetCache(false, 0, pos, 0, d, 0.9f);
        for (int d = 0; d < c.head_size_v; ++d) pb.SetCache(true, 0, pos, 0, d, 5.0f);
        std::vector<uint8_t> after = pb.NewOut();
        ASSERT_TRUE(RunOnGpu(pb.params(after), after, io).ok());
        int wrong = 0;
        for (int t = 0; t < 140; ++t) {
          const int qp = 10 + t;
          bool sees = !mc.causal || pos <= qp;
          if (mc.window > 0) sees = sees && std::abs(qp - pos) <= mc.window - 1;
          for (int h = 0; h < 2; ++h) {
            bool moved = false;
            for (int d = 0; d < c.head_size_v; ++d) {
              moved |= pb.Out(before, t, h, d) != pb.Out(after, t, h, d);
            }
            if (moved != sees && ++wrong <= 5) {
              ADD_FAILURE() << "query at position " << qp << " head " << h
                            << (sees ? " should see" : " must not see") << " the key";
            }
          }
        }
        EXPECT_EQ(wrong, 0);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// What the launcher rejects, naming it; nothing is launched.

internal::PagedKernelParams SupportedKernelParams() {
  internal::PagedKernelParams p{};
  p.num_heads = 8;
  p.num_kv_heads = 2;
  p.head_size = 128;
  p.head_size_v = 128;
  p.block_size = 16;
  p.num_seqs = 1;
  p.max_query_len = 1;
  p.max_seq_len = 1;
  p.scale = 1.0f;
  p.num_scales = 1;
  p.k_scale[0] = 1.0f;
  p.v_scale[0] = 1.0f;
  return p;
}

TEST(CudaPrefillLimitsTest, UnsupportedCombinationsAreInvalidArgument) {
  SKIP_WITHOUT_GPU();
  const internal::PagedKernelParams ok = SupportedKernelParams();
  struct Bad {
    internal::PagedKernelParams params;
    DType q, out, cache;
    const char* names;
  };
  internal::PagedKernelParams big_head = ok;
  big_head.head_size = 512;
  big_head.head_size_v = 512;
  internal::PagedKernelParams big_head_v = ok;
  big_head_v.head_size_v = 320;
  const Bad cases[] = {
      {ok, DType::kFloat32, DType::kFloat32, DType::kFloat32, "float32"},
      {ok, DType::kBFloat16, DType::kFloat32, DType::kBFloat16, "out dtype"},
      {ok, DType::kBFloat16, DType::kBFloat16, DType::kFloat16, "cache dtype"},
      {ok, DType::kFloat16, DType::kFloat16, DType::kFloat32, "cache dtype"},
      {big_head, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16, "head_size=512"},
      {big_head_v, DType::kFloat16, DType::kFloat16, DType::kFloat8E4M3, "head_size_v=320"},
  };
  // Rejected with InvalidArgument naming what was wrong (bad.names and `also`).
  auto expect_rejected = [](const Bad& bad, const internal::PrefillLaunchOptions& options,
                            const char* also) {
    const absl::Status st =
        internal::LaunchPrefillAttention(bad.params, bad.q, bad.out, bad.cache, options, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(std::string(st.message()).find(bad.names), std::string::npos) << st;
    EXPECT_NE(std::string(st.message()).find(also), std::string::npos) << st;
  };
  for (const Bad& bad : cases) expect_rejected(bad, {}, "");
  // The fast variant, asked for where it does not apply.
  internal::PrefillLaunchOptions fast;
  fast.variant = PrefillVariant::kFast;
  internal::PagedKernelParams unequal = ok;
  unequal.head_size_v = 64;
  for (const Bad& bad : {Bad{ok, DType::kBFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                             "fast variant"},
                         Bad{big_head_v, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16,
                             "head_size_v"},
                         Bad{unequal, DType::kFloat16, DType::kFloat16, DType::kFloat16,
                             "fast variant"}}) {
    expect_rejected(bad, fast, "");
  }
  // The wgmma kernel, asked for where it does not apply or where the device cannot run it.
  internal::PrefillLaunchOptions wgmma;
  wgmma.variant = PrefillVariant::kWgmma;
  wgmma.wgmma = true;
  internal::PagedKernelParams odd_block = ok;
  odd_block.block_size = 24;
  internal::PagedKernelParams head_256 = ok;
  head_256.head_size = 256;
  head_256.head_size_v = 256;
  for (const Bad& bad : {Bad{head_256, DType::kBFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                             "head sizes 256/256"},
                         Bad{unequal, DType::kFloat16, DType::kFloat16, DType::kFloat16,
                             "head sizes 128/64"},
                         Bad{odd_block, DType::kFloat16, DType::kFloat16, DType::kFloat16,
                             "block size 24 is not a power of two in [16, 256] (TMA loads)"}}) {
    expect_rejected(bad, wgmma, "wgmma kernel does not apply");
  }
  // Pairs take what single CTAs take, no more (params the kernel otherwise takes: a cache
  // of 4 blocks with NHD strides, in blocks of 24 keys).
  internal::PagedKernelParams cached_odd = ok;
  cached_odd.num_blocks = 4;
  cached_odd.k_token_stride = cached_odd.v_token_stride = 2 * 128;
  cached_odd.k_head_stride = cached_odd.v_head_stride = 128;
  cached_odd.block_size = 24;
  cached_odd.k_block_stride = cached_odd.v_block_stride = 24 * 2 * 128;
  internal::PrefillLaunchOptions pair = wgmma;
  pair.wgmma_cluster = PrefillWgmmaCluster::kPair;
  expect_rejected(Bad{cached_odd, DType::kFloat16, DType::kFloat16, DType::kFloat16,
                      "block size 24 is not a power of two"},
                  pair, "wgmma kernel does not apply");
  wgmma.wgmma = false;
  expect_rejected(Bad{ok, DType::kBFloat16, DType::kBFloat16, DType::kBFloat16, "wgmma"}, wgmma,
                  "sm_90a");
}

// ---------------------------------------------------------------------------------------
// The wgmma kernel's own edges: every block size it takes (one TMA box per page below 128
// keys, one per 128-key tile of a larger block), sequences that end one key before, at and
// after a page or a 128-key tile, tiny ones (1 and 2 keys, a single query row against
// cached keys), and ragged batches, over both layouts, both 16-bit types and both head
// sizes; the cache is NaN past every sequence's end, in the last page too.

// Block size, head size, q dtype, cache (CacheKind::dtype kFloat16: q's own dtype).
using WgmmaEdgeParam = std::tuple<int, int, DType, CacheKind>;
class CudaPrefillWgmmaEdgeTest : public ::testing::TestWithParam<WgmmaEdgeParam> {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaPrefillWgmmaEdgeTest, MatchesReference) {
  const auto& [block_size, head_size, dtype, cache] = GetParam();
  for (TestLayout layout : {TestLayout::kNHD, TestLayout::kHND}) {
    for (bool causal : {true, false}) {
      SCOPED_TRACE(absl::StrCat(TestLayoutName(layout), causal ? " causal" : " bidirectional"));
      AttnCase c;
      c.q_dtype = dtype;
      c.out_dtype = dtype;
      c.cache_dtype = IsFp8(cache.dtype) ? cache.dtype : dtype;
      c.quant = cache.quant;
      c.layout = layout;
      c.causal = causal;
      c.block_size = block_size;
      c.head_size = head_size;
      c.head_size_v = head_size;
      c.num_kv_heads = 2;
      c.group = 3;  // 128-row tiles that end inside a token's heads
      const int b = block_size;
      c.seqs = {{0, 1},          {0, 2},       {b - 1, 1},   {b - 1, 2},   {0, b - 1},
                {0, b},          {0, b + 1},   {127, 1},     {128, 1},     {127, 2},
                {0, 127},        {0, 129},     {b, 128},     {255, 130},   {3, 200},
                {2 * b + 1, 40}, {5, 0},       {0, 300}};
      c.seed = static_cast<uint32_t>(block_size * 31 + head_size);
      AttnProblem pb(c);
      // Both grid orders, a CTA (pair) per unit and persistent grids: every (sequence, KV
      // head, row tile) computed once either way, the pairs' partners included. Persistent
      // grids of 3 and 7 CTAs (pairs): each walks many units in both directions of the
      // serpentine, its ring and barriers carried from unit to unit, and some have none
      // in the last round.
      for (internal::PrefillWgmmaOrder order :
           {internal::PrefillWgmmaOrder::kHeadsInner, internal::PrefillWgmmaOrder::kHeadsOuter}) {
        for (int max_ctas : {-1, 3, 7}) {
          SCOPED_TRACE(absl::StrCat(
              order == internal::PrefillWgmmaOrder::kHeadsOuter ? "KV heads outer, "
                                                                : "KV heads inner, ",
              max_ctas < 0 ? "a CTA per unit" : absl::StrCat("persistent, ", max_ctas, " CTAs")));
          GpuIo io;
          io.dense = true;
          io.order = order;
          io.grid = max_ctas < 0 ? internal::PrefillWgmmaGrid::kPerUnit
                                 : internal::PrefillWgmmaGrid::kPersistent;
          io.max_ctas = max_ctas < 0 ? 0 : max_ctas;
          ExpectGpuMatchesReference(pb, io);
          if (HasFailure()) return;
        }
      }
    }
  }
}

std::string WgmmaEdgeName(const ::testing::TestParamInfo<WgmmaEdgeParam>& info) {
  const CacheKind& cache = std::get<3>(info.param);
  return absl::StrCat("bs", std::get<0>(info.param), "_d", std::get<1>(info.param), "_",
                      ShortDType(std::get<2>(info.param)),
                      IsFp8(cache.dtype) ? absl::StrCat("_cache", ShortDType(cache.dtype),
                                                        QuantSuffix(cache.quant))
                                         : "");
}

INSTANTIATE_TEST_SUITE_P(
    Pages, CudaPrefillWgmmaEdgeTest,
    ::testing::Combine(::testing::Values(16, 32, 64, 128, 256), ::testing::Values(64, 128, 256),
                       ::testing::Values(DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(CacheKind{DType::kFloat16, KvQuantMode::kNone})),
    WgmmaEdgeName);

// fp8 caches: raw rows converted in the kernel.
INSTANTIATE_TEST_SUITE_P(
    Fp8Pages, CudaPrefillWgmmaEdgeTest,
    ::testing::Combine(::testing::Values(16, 64, 256), ::testing::Values(64, 128),
                       ::testing::Values(DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(CacheKind{DType::kFloat8E4M3, KvQuantMode::kPerTensor},
                                         CacheKind{DType::kFloat8E5M2, KvQuantMode::kPerHead})),
    WgmmaEdgeName);

// ---------------------------------------------------------------------------------------
// The shape the kernels are tuned for: one 8k-token causal prefill, bfloat16, head size 128,
// 32 query / 8 KV heads, block size 16 and 64 (and the same over an fp8 e4m3 cache). Prints
// the throughput (counting 4 n^2 d heads / 2 flops) of every variant and wgmma schedule,
// and checks a few rows of the last run against the reference run as single-token calls.

class CudaPrefillPerformanceTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

// Times every prefill variant that takes a causal 8k-token prefill of 32/8 heads, d128,
// bf16 q and out over a cache of `cache_dtype` (per-tensor scales where fp8) in blocks of
// `block_size`, prints their TFLOP/s, and checks the last run's output at a few rows.
void TimeCausal8kHead128(int block_size, DType cache_dtype) {
  constexpr int kTokens = 8192;
  const bool fp8 = IsFp8(cache_dtype);
  AttnCase c;
  c.seqs = {{0, kTokens}};
  c.num_kv_heads = 8;
  c.group = 4;
  c.head_size = 128;
  c.head_size_v = 128;
  c.block_size = block_size;
  c.q_dtype = DType::kBFloat16;
  c.out_dtype = DType::kBFloat16;
  c.cache_dtype = cache_dtype;
  c.quant = fp8 ? KvQuantMode::kPerTensor : KvQuantMode::kNone;
  c.pad_tokens = 0;
  AttnProblem pb(c);
  // The baseline first, then the fast variant (16-bit caches), then (where the device runs
  // it) the wgmma kernel: the last one's output is checked below.
  std::vector<uint8_t> out;
  struct Run {
    PrefillVariant variant;
    PrefillWgmmaSchedule schedule;
    PrefillWgmmaCluster cluster;
  };
  constexpr PrefillWgmmaSchedule kDefaultSchedule = PrefillWgmmaSchedule::kDefault;
  constexpr PrefillWgmmaCluster kDefaultCluster = PrefillWgmmaCluster::kDefault;
  std::vector<Run> runs = {{PrefillVariant::kBaseline, kDefaultSchedule, kDefaultCluster}};
  if (!fp8) {  // the fast variant takes 16-bit caches only
    runs.push_back({PrefillVariant::kFast, kDefaultSchedule, kDefaultCluster});
  }
  if (DeviceRunsWgmma()) {
    // Each clustering with every schedule (fp8 caches run the serial one only), then the
    // defaults.
    for (PrefillWgmmaCluster cluster : kClusters) {
      for (PrefillWgmmaSchedule schedule : kSchedules) {
        if (!fp8 || schedule == PrefillWgmmaSchedule::kSerial) {
          runs.push_back({PrefillVariant::kWgmma, schedule, cluster});
        }
      }
    }
    runs.push_back({PrefillVariant::kWgmma, kDefaultSchedule, kDefaultCluster});
  }
  for (const Run& run : runs) {
    out = pb.NewOut();
    float ms = 0;
    GpuIo io;
    io.dense = true;
    io.variant = run.variant;
    io.schedule = run.schedule;
    io.cluster = run.cluster;
    const absl::Status st = RunOnGpu(pb.params(out), out, io, &ms, /*repeats=*/11);
    ASSERT_TRUE(st.ok()) << st;
    const double flops = 4.0 * kTokens * kTokens * 128.0 * 32 / 2;
    const std::string name =
        run.variant == PrefillVariant::kWgmma
            ? absl::StrCat("wgmma variant, ", ClusterName(run.cluster), ", ",
                           ScheduleName(run.schedule), " schedule")
            : absl::StrCat(VariantName(run.variant), " variant");
    std::printf("[ PERF     ] causal prefill 8k bf16 d128 32/8 heads, %s cache bs%d, %s: "
                "%.3f ms, %.1f TFLOP/s\n",
                ShortDType(cache_dtype), c.block_size, name.c_str(), ms,
                flops / (ms * 1e-3) / 1e12);
  }

  // Rows at a few positions: the reference as a one-token call whose query sits at `pos`.
  PagedAttentionParams full = pb.params(out);
  for (int pos : {0, 1, 1000, 4095, kTokens - 1}) {
    SCOPED_TRACE(absl::StrCat("position ", pos));
    PagedAttentionParams one = full;
    const int32_t loc[2] = {0, 1};
    const int32_t len[1] = {pos + 1};
    one.query_start_loc = loc;
    one.seq_lens = len;
    one.num_tokens = 1;
    one.max_query_len = 1;
    one.max_seq_len = pos + 1;
    one.q = static_cast<const uint8_t*>(full.q) + pos * full.q_token_stride * 2;
    std::vector<uint8_t> ref(static_cast<size_t>(full.o_token_stride) * 2);
    one.out = ref.data();
    ASSERT_TRUE(RunAttentionReference(one).ok());
    int failures = 0;
    for (int h = 0; h < 32; ++h) {
      for (int d = 0; d < 128; ++d) {
        const float want = LoadAsFloat(ref.data(), DType::kBFloat16, int64_t{h} * 128 + d);
        const float got = pb.Out(out, pos, h, d);
        if (!(std::fabs(want - got) <= AbsTolerance(DType::kBFloat16) + 1e-2 * std::fabs(want)) &&
            ++failures <= 5) {
          ADD_FAILURE() << "head " << h << " d " << d << ": reference " << want << " gpu "
                        << got;
        }
      }
    }
    EXPECT_EQ(failures, 0);
  }
}

TEST_P(CudaPrefillPerformanceTest, Causal8kBf16Head128) {
  TimeCausal8kHead128(GetParam(), DType::kBFloat16);
}

// The same over an fp8 e4m3 cache (half the bytes of K and V, converted in the kernel).
TEST_P(CudaPrefillPerformanceTest, Causal8kFp8E4m3Head128) {
  TimeCausal8kHead128(GetParam(), DType::kFloat8E4M3);
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, CudaPrefillPerformanceTest, ::testing::Values(16, 64),
                         [](const auto& test_info) {
                           return absl::StrCat("bs", test_info.param);
                         });

}  // namespace
}  // namespace kvstream
