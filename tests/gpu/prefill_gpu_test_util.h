// The machinery the CUDA prefill attention tests share (cuda_prefill_attention_gpu_test.cc,
// cuda_prefill_wgmma_gpu_test.cc): RunOnGpu, which runs LaunchPrefillAttention on device
// copies of a problem's host params in a chosen variant, wgmma schedule, clustering and grid
// (GpuIo); the names and lists of those choices; whether the device runs the wgmma kernel
// and whether each variant must apply to a case; and the comparison of every variant with
// the golden CPU reference (ExpectGpuMatchesReference).
#ifndef KVSTREAM_TESTS_GPU_PREFILL_GPU_TEST_UTIL_H_
#define KVSTREAM_TESTS_GPU_PREFILL_GPU_TEST_UTIL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cuda/kernel_params.h"
#include "cuda/launchers.h"
#include "gpu_test_util.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/status_macros.h"
#include "tests/unit/attention_test_util.h"

namespace kvstream {
namespace gpu_test {

// Bytes of a cache array with strides `st` and rows of `dim` elements: up to its last
// element, plus one.
inline size_t CacheBytes(const PagedAttentionParams& p, const CacheStrides& st, int dim) {
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

inline const char* ClusterName(internal::PrefillWgmmaCluster c) {
  switch (c) {
    case internal::PrefillWgmmaCluster::kSingle: return "single CTAs";
    case internal::PrefillWgmmaCluster::kPair: return "CTA pairs";
    default: return "default clustering";
  }
}
inline constexpr internal::PrefillWgmmaCluster kClusters[] = {
    internal::PrefillWgmmaCluster::kSingle, internal::PrefillWgmmaCluster::kPair};
inline bool TmaTakesBlocks(int block_size) {
  return block_size >= 16 && block_size <= 256 && (block_size & (block_size - 1)) == 0;
}

inline const char* ScheduleName(internal::PrefillWgmmaSchedule s) {
  switch (s) {
    case internal::PrefillWgmmaSchedule::kSerial: return "serial";
    case internal::PrefillWgmmaSchedule::kOverlap: return "overlap";
    case internal::PrefillWgmmaSchedule::kPingPong: return "ping-pong";
    default: return "default";
  }
}
inline constexpr internal::PrefillWgmmaSchedule kSchedules[] = {
    internal::PrefillWgmmaSchedule::kSerial, internal::PrefillWgmmaSchedule::kOverlap,
    internal::PrefillWgmmaSchedule::kPingPong};

inline const char* VariantName(internal::PrefillVariant v) {
  switch (v) {
    case internal::PrefillVariant::kFast: return "fast";
    case internal::PrefillVariant::kBaseline: return "baseline";
    case internal::PrefillVariant::kWgmma: return "wgmma";
    default: return "auto";
  }
}

// Whether this device and build run the wgmma kernel (PrefillLaunchOptions::wgmma).
inline bool DeviceRunsWgmma() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0 && internal::PrefillWgmmaCompiled();
}

inline const std::vector<internal::PrefillVariant>& AllVariants() {
  static const std::vector<internal::PrefillVariant> v = {internal::PrefillVariant::kBaseline,
                                                          internal::PrefillVariant::kFast,
                                                          internal::PrefillVariant::kWgmma};
  return v;
}

// As ToDevice, but never an empty buffer: the launcher rejects null pointers, so an array
// of 0 bytes still gets a device allocation (1 byte, never read).
inline absl::StatusOr<DeviceBuffer> ToDeviceNonEmpty(const void* host, size_t bytes) {
  if (bytes == 0) return DeviceBuffer::Create(1, MemoryKind::kDevice);
  return ToDevice(host, bytes);
}

// Runs the CUDA kernel on device copies of `host` (a problem's host params) and leaves the
// result in `out`, which has the layout and contents of AttnProblem::NewOut() beforehand.
// With `milliseconds`, times the last `repeats` - 1 runs (the first warms up) and stores
// their mean there.
inline absl::Status RunOnGpu(const PagedAttentionParams& host, std::vector<uint8_t>& out,
                             const GpuIo& io = {}, float* milliseconds = nullptr, int repeats = 1) {
  const size_t q_elem = DTypeSize(host.q_dtype);
  const size_t o_elem = DTypeSize(host.out_dtype);
  const int head_size = host.cache.spec.head_size;
  const int head_size_v = host.cache.spec.head_size_v;
  const int64_t q_row = int64_t{host.num_heads} * head_size;  // elements of one token
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
    ASSIGN_OR_RETURN(q, ToDeviceNonEmpty(dense.data(), dense.size()));
    dev.q_token_stride = q_row;
    std::vector<uint8_t> dense_out(static_cast<size_t>(host.num_tokens * o_row) * o_elem,
                                   testing_util::AttnProblem::kSentinel);
    ASSIGN_OR_RETURN(o, ToDeviceNonEmpty(dense_out.data(), dense_out.size()));
    dev.o_token_stride = o_row;
  } else {
    const size_t q_bytes = static_cast<size_t>(host.num_tokens * host.q_token_stride) * q_elem;
    ASSIGN_OR_RETURN(q, ToDeviceNonEmpty(host.q, q_bytes));
    ASSIGN_OR_RETURN(o, ToDeviceNonEmpty(out.data(), out.size()));
  }
  ASSIGN_OR_RETURN(
      k, ToDeviceNonEmpty(host.cache.k, CacheBytes(host, host.cache.k_strides, head_size)));
  ASSIGN_OR_RETURN(
      v, ToDeviceNonEmpty(host.cache.v, CacheBytes(host, host.cache.v_strides, head_size_v)));
  const size_t num_seqs = static_cast<size_t>(host.num_seqs);
  ASSIGN_OR_RETURN(loc, ToDeviceNonEmpty(host.query_start_loc, (num_seqs + 1) * sizeof(int32_t)));
  ASSIGN_OR_RETURN(lens, ToDeviceNonEmpty(host.seq_lens, num_seqs * sizeof(int32_t)));
  ASSIGN_OR_RETURN(table,
                   ToDeviceNonEmpty(host.block_table,
                                    num_seqs * static_cast<size_t>(host.block_table_stride) * 4));
  if (host.alibi_slopes != nullptr) {
    ASSIGN_OR_RETURN(slopes, ToDeviceNonEmpty(host.alibi_slopes,
                                              static_cast<size_t>(host.num_heads) * sizeof(float)));
    dev.alibi_slopes = slopes.data_as<const float>();
  }
  dev.q = q.data();
  dev.out = o.data();
  dev.cache.k = k.data();
  dev.cache.v = v.data();
  dev.cache.memory = MemoryKind::kDevice;
  dev.query_start_loc = loc.data_as<const int32_t>();
  dev.seq_lens = lens.data_as<const int32_t>();
  dev.block_table = table.data_as<const int32_t>();
  dev.host.query_start_loc = host.query_start_loc;
  dev.host.seq_lens = host.seq_lens;
  dev.host.block_table = host.block_table;
  dev.host.alibi_slopes = host.alibi_slopes;

  ASSIGN_OR_RETURN(const internal::PagedKernelParams kernel_params,
                   internal::MakePagedKernelParams(dev));
  if (io.variant == internal::PrefillVariant::kFast &&
      !internal::PrefillFastVariantApplies(kernel_params, host.q_dtype, host.cache.spec.dtype)) {
    return absl::UnimplementedError("the fast variant does not apply");
  }
  const bool wgmma = DeviceRunsWgmma();
  if (io.variant == internal::PrefillVariant::kWgmma) {
    if (!wgmma) return absl::UnimplementedError("this device does not run the wgmma kernel");
    if (!internal::PrefillWgmmaApplies(kernel_params, host.q_dtype, host.out_dtype,
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
    RETURN_IF_ERROR(internal::LaunchPrefillAttention(kernel_params, host.q_dtype, host.out_dtype,
                                                     host.cache.spec.dtype, launch_options,
                                                     nullptr));
  }
  if (start != nullptr) {
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    cudaEventElapsedTime(milliseconds, start, stop);
    *milliseconds /= static_cast<float>(std::max(1, repeats - 1));
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  RETURN_IF_ERROR(CudaErrorToStatus(cudaDeviceSynchronize(), "prefill attention kernel"));
  if (io.dense) {
    std::vector<uint8_t> dense_out(static_cast<size_t>(host.num_tokens * o_row) * o_elem);
    RETURN_IF_ERROR(ToHost(o.data(), dense_out.size(), dense_out.data()));
    for (int64_t t = 0; t < host.num_tokens; ++t) {
      std::memcpy(out.data() + t * host.o_token_stride * o_elem,
                  dense_out.data() + t * o_row * o_elem, static_cast<size_t>(o_row) * o_elem);
    }
    return absl::OkStatus();
  }
  return ToHost(o.data(), out.size(), out.data());
}

// Absolute + relative tolerance for outputs in [-1, 1]: the flash kernel rounds P to the
// 16-bit type before P V, and both sides round the output once.
inline float AbsTolerance(DType dtype) { return dtype == DType::kFloat16 ? 4e-3f : 1.2e-2f; }

// Whether the fast variant must run `c` (PrefillFastVariantApplies): the cache in q's
// dtype, equal head sizes of 64 or 128, and a layout whose rows are 16-byte aligned.
inline bool FastVariantExpected(const testing_util::AttnCase& c) {
  return c.cache_dtype == c.q_dtype && c.head_size == c.head_size_v &&
         (c.head_size == 64 || c.head_size == 128) && c.layout != testing_util::TestLayout::kPadded;
}

// Whether the wgmma kernel must run `c` on a device that runs it (PrefillWgmmaApplies):
// the cache in q's dtype or fp8, equal head sizes of 64, 128 or (16-bit caches) 256,
// dense (16-byte aligned) activations and cache rows, and a block size TMA boxes take (a
// power of two in [16, 256]).
inline bool WgmmaExpected(const testing_util::AttnCase& c, const GpuIo& io) {
  const bool fp8 = IsFp8(c.cache_dtype);
  return (c.cache_dtype == c.q_dtype || fp8) && c.head_size == c.head_size_v &&
         (c.head_size == 64 || c.head_size == 128 || (c.head_size == 256 && !fp8)) &&
         c.layout != testing_util::TestLayout::kPadded && io.dense && TmaTakesBlocks(c.block_size);
}

// Runs the GPU kernel on `pb` as `io` says and compares every output element with
// `ref_out` (the reference's output on `pb`); checks that nothing outside the batch's rows
// was written and that no NaN appeared. A variant that does not apply passes if it need not
// (FastVariantExpected, WgmmaExpected).
inline void ExpectVariantMatchesReference(testing_util::AttnProblem& pb,
                                          const std::vector<uint8_t>& ref_out, const GpuIo& io) {
  const testing_util::AttnCase& c = pb.config();
  std::vector<uint8_t> out = pb.NewOut();
  const absl::Status st = RunOnGpu(pb.params(out), out, io);
  if (io.variant == internal::PrefillVariant::kFast && absl::IsUnimplemented(st)) {
    EXPECT_FALSE(FastVariantExpected(c)) << "the fast variant should apply: " << st;
    return;
  }
  if (io.variant == internal::PrefillVariant::kWgmma && absl::IsUnimplemented(st)) {
    EXPECT_FALSE(DeviceRunsWgmma() && WgmmaExpected(c, io))
        << "the wgmma kernel should apply: " << st;
    return;
  }
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(pb.CountStrayWrites(out), 0) << "wrote outside the batch's rows";
  // Absolute tolerance by dtype, plus 1% relative.
  ExpectQueryRowsClose(pb, ref_out, out, AbsTolerance(c.out_dtype), 1e-2);
}

// Runs the reference once and the GPU kernel on `pb` in every variant (the fast one where
// it applies, failing if it does not where FastVariantExpected says it must; the wgmma
// kernel likewise, in every schedule and clustering) and compares every output element;
// checks that nothing outside the batch's rows was written and that no NaN appeared.
// The wgmma kernel on `pb` in every clustering and schedule, with io's grid order and grid,
// against the reference output `ref_out`.
inline void ExpectWgmmaMatchesReference(testing_util::AttnProblem& pb,
                                        const std::vector<uint8_t>& ref_out, const GpuIo& io) {
  GpuIo variant_io = io;
  variant_io.variant = internal::PrefillVariant::kWgmma;
  for (internal::PrefillWgmmaCluster cluster : kClusters) {  // every schedule and clustering
    for (internal::PrefillWgmmaSchedule schedule : kSchedules) {
      SCOPED_TRACE(absl::StrCat("wgmma variant, ", ClusterName(cluster), ", ",
                                ScheduleName(schedule), " schedule"));
      variant_io.schedule = schedule;
      variant_io.cluster = cluster;
      ExpectVariantMatchesReference(pb, ref_out, variant_io);
    }
  }
}

// Every variant (AllVariants) on `pb` against the reference output `ref_out`.
inline void ExpectAllVariantsMatchReference(testing_util::AttnProblem& pb,
                                            const std::vector<uint8_t>& ref_out,
                                            const GpuIo& io) {
  for (internal::PrefillVariant variant : AllVariants()) {
    if (variant == internal::PrefillVariant::kWgmma) {
      ExpectWgmmaMatchesReference(pb, ref_out, io);
      continue;
    }
    GpuIo variant_io = io;
    variant_io.variant = variant;
    SCOPED_TRACE(absl::StrCat(VariantName(variant), " variant"));
    ExpectVariantMatchesReference(pb, ref_out, variant_io);
  }
}

inline void ExpectGpuMatchesReference(testing_util::AttnProblem& pb, const GpuIo& io = {}) {
  std::vector<uint8_t> ref_out = pb.NewOut();
  const absl::Status ref_status = RunAttentionReference(pb.params(ref_out));
  ASSERT_TRUE(ref_status.ok()) << ref_status;
  ExpectAllVariantsMatchReference(pb, ref_out, io);
}

}  // namespace gpu_test
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_GPU_PREFILL_GPU_TEST_UTIL_H_
