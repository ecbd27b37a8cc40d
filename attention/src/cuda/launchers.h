// The CUDA attention kernels' launchers: one per kernel family, each taking the flattened
// params (kernel_params.h), enqueuing on `stream` without waiting, and returning the launch
// error as a Status. Callers validate first (MakePagedKernelParams); launchers only check
// the limits of their kernel (head sizes, dtypes) and name what they do not support.
#ifndef KVSTREAM_ATTENTION_CUDA_LAUNCHERS_H_
#define KVSTREAM_ATTENTION_CUDA_LAUNCHERS_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cuda/kernel_params.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/dtype.h"

namespace kvstream {
namespace internal {

// Varlen prefill / chunked prefill (and any query length, decode included) over the paged
// cache: flash attention on tensor cores. q and out dtypes: float16 or bfloat16 (q_dtype ==
// out_dtype); cache: the same 16-bit dtype as q, or fp8 e4m3 / e5m2.
// The same with the default PrefillLaunchOptions (kAuto).
absl::Status LaunchPrefillAttention(const PagedKernelParams& params, DType q_dtype,
                                    DType out_dtype, DType cache_dtype, cudaStream_t stream);

// Which prefill kernel runs. kAuto: the wgmma kernel where PrefillLaunchOptions::wgmma
// and PrefillWgmmaApplies allow it, else the fast variant of prefill_attention.cuh where
// it applies (1.85x the baseline's TFLOP/s on the H200, docs/benchmarks.md), else the
// baseline.
enum class PrefillVariant {
  kAuto,
  kBaseline,  // every supported call
  kFast,      // compile-time masks and steps; 16-bit cache only, see PrefillFastVariantApplies
  kWgmma,     // the Hopper kernel (prefill_wgmma.cuh), see PrefillWgmmaApplies
};
// How the wgmma kernel's consumers order products and softmax (prefill_wgmma.cuh); for
// its benchmarks. kDefault: the one measured fastest for the call's block size
// (prefill_wgmma.cu, docs/benchmarks.md).
enum class PrefillWgmmaSchedule { kDefault, kSerial, kOverlap, kPingPong };
// How the wgmma kernel's CTAs load K and V (prefill_wgmma.cuh): each its own tiles
// (kSingle), or in clusters of two CTAs with adjacent row tiles of one KV head that share
// them, each loading half and multicasting it to both (kPair). kDefault: kPair for 16-bit
// caches of head size 64 or 128 in pages of fewer than 64 keys, else kSingle
// (prefill_wgmma.cu says why).
enum class PrefillWgmmaCluster { kDefault, kSingle, kPair };
// The order of the wgmma kernel's grid, row tiles of a sequence from the last: KV heads
// inner (the CTAs of every KV head of a row tile together, as the mma.sync kernel) or outer
// (every row tile of one KV head first, so that the CTAs resident together read one head's
// K and V: 16 MiB at 32k tokens of d128 bf16, where all 8 heads' 128 MiB exceed an
// H100's or H200's 50 MiB L2). kDefault: kHeadsOuter (prefill_wgmma.cu says why).
enum class PrefillWgmmaOrder { kDefault, kHeadsInner, kHeadsOuter };
// How the wgmma kernel's CTAs take their units (prefill_wgmma_units.cuh): one CTA (pair)
// per unit, started by the hardware as others end (kPerUnit), or as many CTAs as the device
// holds at once, each taking unit after unit and loading the next unit's keys while it
// finishes the last (kPersistent). kDefault: kPerUnit (prefill_wgmma.cu says why).
enum class PrefillWgmmaGrid { kDefault, kPerUnit, kPersistent };
struct PrefillLaunchOptions {
  PrefillVariant variant = PrefillVariant::kAuto;
  PrefillWgmmaSchedule wgmma_schedule = PrefillWgmmaSchedule::kDefault;
  PrefillWgmmaCluster wgmma_cluster = PrefillWgmmaCluster::kDefault;
  PrefillWgmmaOrder wgmma_order = PrefillWgmmaOrder::kDefault;
  PrefillWgmmaGrid wgmma_grid = PrefillWgmmaGrid::kDefault;
  // Persistent grids: at most this many CTAs (pairs count as one); 0: as many as the
  // device holds at once. For tests that make every CTA walk many units.
  int wgmma_max_ctas = 0;
  // Whether the device the stream runs on has compute capability 9.0 exactly and this
  // build holds sm_90a code (KVSTREAM_HAVE_SM90A): only then may the wgmma kernel run.
  bool wgmma = false;
};

// Whether the fast variant runs this call: q dtype float16 / bfloat16, the cache of q's
// dtype with 16-byte aligned rows and strides, head_size == head_size_v, 64 or 128.
bool PrefillFastVariantApplies(const PagedKernelParams& params, DType q_dtype,
                               DType cache_dtype);

// Whether the wgmma kernel takes this call on a device where it may run: q and out of one
// 16-bit dtype, the cache of that dtype or fp8 e4m3 / e5m2, head_size == head_size_v, 64,
// 128 or (16-bit caches) 256, every q, out and cache row 16-byte aligned, strides within a
// tensor map's range, a block size that is a power of two in [16, 256] (TMA boxes of whole
// pages). When it does not and `why` is not null, *why says what it lacks.
bool PrefillWgmmaApplies(const PagedKernelParams& params, DType q_dtype, DType out_dtype,
                         DType cache_dtype, std::string* why = nullptr);

// Whether this build holds the wgmma kernel's sm_90a code (compiled for 90a).
bool PrefillWgmmaCompiled();

// Enqueues the wgmma kernel. REQUIRES: PrefillWgmmaApplies; PrefillLaunchOptions::wgmma
// would be true for the stream's device; params with rows to compute (num_seqs and
// max_query_len > 0, the limits LaunchPrefillAttention checks).
// Of `options`, only the wgmma_* fields count.
absl::Status LaunchPrefillWgmma(const PagedKernelParams& params, DType q_dtype, DType cache_dtype,
                                const PrefillLaunchOptions& options, cudaStream_t stream);

// As above with a choice of variant. InvalidArgument, in addition, for kFast where
// PrefillFastVariantApplies is false, and for kWgmma where PrefillWgmmaApplies is false or
// launch_options.wgmma is.
absl::Status LaunchPrefillAttention(const PagedKernelParams& params, DType q_dtype,
                                    DType out_dtype, DType cache_dtype,
                                    const PrefillLaunchOptions& launch_options,
                                    cudaStream_t stream);

// Decode (max_query_len <= 1: every sequence has one query token, or none) over the paged
// cache: split-KV flash decoding, bandwidth-bound. Three kernels:
//  - CUDA cores (decode_attention.cuh): q and out dtypes float32, float16 or bfloat16
//    (independently); cache float32, float16, bfloat16, fp8 e4m3 or e5m2; head sizes up to
//    512 (256 for float32 caches), any block size, any strides with a unit dim stride.
//  - tensor cores (decode_tc_attention.cuh): q dtype == out dtype, float16 or bfloat16;
//    cache of q's dtype or fp8 e4m3 / e5m2; head sizes up to 256, multiples of 8 (16 for
//    fp8), every cache row 16-byte aligned (base pointers and strides); any block size.
//  - tensor cores fed by TMA (decode_tma_attention.cuh; compute capability 9.0 and newer):
//    as the tensor-core kernel, but a cache of q's dtype only, head sizes 128/128, block
//    size 16, num_kv_heads a multiple of 4, up to 8 query heads per KV head.
// All take the sliding window, ALiBi, soft cap and NHD / HND strides; the first two any
// group size. kAuto is the TMA kernel where it applies (on the H200 1.5-2% faster than the
// cp.async tensor-core kernel at the shapes, docs/benchmarks.md), else the
// tensor-core kernel where it applies (about twice the bandwidth of the CUDA-core one),
// else the CUDA-core kernel.
enum class DecodeKernel {
  kAuto,            // TMA, else tensor cores, else CUDA cores: the first that applies
  kCudaCores,
  kTensorCores,     // the cp.async tensor-core kernel; InvalidArgument where it does not apply
  kTensorCoresTma,  // InvalidArgument where it does not apply or options.tma is false
};

// How the cp.async tensor-core kernel stages an fp8 cache. kInRegisters is the faster
// (on the H100 at 64 x 4096 and 16 x 32768 keys, docs/benchmarks.md: 0.94 (bf16 queries) /
// 0.95 (fp16) of the fp8 cache's streaming read, against 0.82 / 0.88 for kShared) but
// exists only for fp8 e4m3 / e5m2 caches at padded head size 128 with up to 8 query heads
// per KV head; kShared takes every fp8 case. kAuto: kInRegisters where it exists, else
// kShared.
enum class DecodeFp8Staging {
  kAuto,
  kShared,       // a ring of raw half tiles; K and V each converted into a 16-bit tile
  kInRegisters,  // K's and V's mma fragments converted from the raw tiles in registers (V's
                 // transposed by movmatrix): no 16-bit tile
};
// "auto", "shared", "in_registers" (an identifier: tests name cases by it); "unknown" for
// values outside the enum.
const char* DecodeFp8StagingName(DecodeFp8Staging staging);

struct DecodeLaunchOptions {
  // SMs of the device the stream runs on; decides how finely keys are split.
  int num_sms = 132;
  // Whether that device has compute capability 9.0 or newer: the merge kernel then launches
  // as a programmatic dependent of the split kernel (its launch and first CTAs overlap the
  // split kernel's last ones). Must be false on older devices.
  bool dependent_merge = false;
  // Whether that device has the Tensor Memory Accelerator (compute capability 9.0 or
  // newer): only then may the TMA kernel run. Must be false on older devices.
  bool tma = false;
  // > 0: split every sequence's keys into exactly this many parts (at most 256) instead
  // of choosing from num_sms; for tests of the split and merge paths.
  int num_splits = 0;
  // Device memory for the partial results of a launch that splits the keys: called once
  // by such a launch, after it is planned, with the bytes it needs (> 0); returns memory
  // of at least that size, 16-byte aligned, that stays allocated until the kernels have
  // run (stream order), or an error, which the launch returns. Unset: such launches fail
  // with InvalidArgument. Launches that do not split never call it.
  std::function<absl::StatusOr<void*>(size_t bytes)> workspace;
  // Arrival counters for a TMA launch that splits the keys into 2 to 4 parts
  // (kDecodeTmaInKernelMergeSplits): called once by such a launch with the number of
  // 32-bit counters it needs (num_seqs * num_kv_heads); returns device memory of at least
  // that many, 4-byte aligned, every one zero, that no other work uses while the launch
  // runs, or an error, which the launch returns. The launch's kernel leaves every counter
  // zero when it completes, so memory zeroed once serves every later launch in stream
  // order. With counters the last split of each (sequence, KV head) to finish merges the
  // splits' results in the split kernel itself, to the same bits as the merge kernel, and
  // no merge kernel runs (docs/benchmarks.md: the merge kernel's launch and reads after
  // the split kernel cost about 1% of a 16 x 32768 decode on the H200). Unset: the merge
  // kernel runs.
  // ZeroedArrivalCounters (below) is such a provider's body.
  std::function<absl::StatusOr<uint32_t*>(size_t count)> arrival_counters;
  // Which kernel runs.
  DecodeKernel kernel = DecodeKernel::kAuto;
  // fp8 caches on the tensor-core kernel: how they are staged. kAuto and kShared take every
  // launch (the other kernels and 16-bit caches ignore them); kInRegisters only an fp8 cache
  // on the tensor-core kernel at a shape where it exists (else InvalidArgument).
  DecodeFp8Staging fp8_staging = DecodeFp8Staging::kAuto;
};

// Whether the tensor-core decode kernel takes this problem (see above); when it does not
// and `why` is not null, *why says what it lacks.
bool DecodeTensorCoresApply(const PagedKernelParams& params, DType q_dtype, DType out_dtype,
                            DType cache_dtype, std::string* why = nullptr);

// Whether the TMA decode kernel takes this problem on a device that has TMA (see above);
// when it does not and `why` is not null, *why says what it lacks.
bool DecodeTmaApplies(const PagedKernelParams& params, DType q_dtype, DType out_dtype,
                      DType cache_dtype, std::string* why = nullptr);

// Lets `kernel` (a __global__ function) launch with `bytes` of dynamic shared memory on
// the calling thread's current device, and with `max_carveout` all of the unified L1 as
// shared memory. The attributes change only when a launch needs more than any launch
// before it on that device: a change can wait for the device to go idle, which must never
// happen per launch (it would serialise the caller's streams). `what` names the caller in
// errors. Thread-safe.
absl::Status AllowDynamicSharedMemory(const void* kernel, int bytes, bool max_carveout,
                                      absl::string_view what);

// The body of an arrival-counter provider (DecodeLaunchOptions::arrival_counters) that
// keeps its counters in `counters`: returns them when it holds at least `count`; else
// replaces it with `allocate_count` (>= count) counters zeroed in stream order on `stream`,
// the old buffer freed in stream order, and keeps the new one only once its zeroing is
// enqueued, so that an error never leaves counters that are not zero for a later launch.
absl::StatusOr<uint32_t*> ZeroedArrivalCounters(DeviceBuffer& counters, size_t count,
                                                size_t allocate_count, cudaStream_t stream);

// Plans the launch once (kernel, split count, workspace), takes the workspace from
// options.workspace when the keys are split, and enqueues the decode kernels on `stream`;
// returns without waiting. InvalidArgument for what the decode kernels do not support
// (max_query_len > 1, head sizes too large, num_splits out of range, dtypes) or a missing
// or misaligned workspace; the provider's error; the CUDA launch error otherwise.
absl::Status LaunchDecodeAttention(const PagedKernelParams& params, DType q_dtype,
                                   DType out_dtype, DType cache_dtype,
                                   const DecodeLaunchOptions& options, cudaStream_t stream);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_LAUNCHERS_H_
