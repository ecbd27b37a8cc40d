// The Hopper prefill kernel's launcher (prefill_wgmma.cuh): which calls it takes
// (PrefillWgmmaApplies), the K and V caches' tensor maps (tensor_map.h: one box per page and
// 64-column half) and the launch, with the grid of prefill_attention.cu.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cuda/kernel_params.h"
#include "cuda/launchers.h"
#include "cuda/mma_ptx.cuh"
#include "cuda/prefill_config.cuh"
#include "cuda/prefill_wgmma.cuh"
#include "cuda/tensor_map.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/dtype.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

namespace pw = prefill_wgmma;
constexpr char kWhat[] = "cuda prefill attention (wgmma)";
// PrefillWgmmaSchedule::kDefault (docs/benchmarks.md, "The softmax and the products'
// descriptors"): overlap for single CTAs, ping-pong for pairs.
int DefaultSchedule(bool pair) {
  return pair ? pw::kPrefillWgmmaPingPong : pw::kPrefillWgmmaOverlap;
}

absl::StatusOr<CUtensorMap> EncodeMap(const PagedKernelParams& p, const void* cache,
                                      int64_t block_stride, int64_t token_stride,
                                      int64_t head_stride, DType dtype, int box_tokens) {
  CacheMapShape shape{};
  shape.raw_fp8_rows = IsFp8(dtype);
  shape.row_bytes = p.head_size;
  shape.block_size = p.block_size;
  shape.halves = p.head_size / 64;
  shape.num_kv_heads = p.num_kv_heads;
  shape.num_blocks = p.num_blocks;
  shape.block_stride = block_stride;
  shape.token_stride = token_stride;
  shape.head_stride = head_stride;
  shape.box_tokens = static_cast<uint32_t>(box_tokens);
  shape.box_halves = 1;
  shape.box_heads = 1;
  return EncodeCacheTensorMap(cache, dtype, shape, kWhat);
}

// How many CTAs (pairs: clusters) of `kernel` `device` (the current one) holds at once.
absl::StatusOr<int> QueryResidentUnits(const void* kernel, cudaLaunchConfig_t config, bool pair,
                                       int device) {
  if (pair) {
    int clusters = 0;
    RETURN_IF_ERROR(CudaErrorToStatus(
        static_cast<int>(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config)),
        absl::StrCat(kWhat, ": resident clusters")));
    return clusters;
  }
  int sms = 0;
  int per_sm = 0;
  RETURN_IF_ERROR(CudaErrorToStatus(
      static_cast<int>(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)),
      absl::StrCat(kWhat, ": SM count")));
  RETURN_IF_ERROR(CudaErrorToStatus(
      static_cast<int>(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &per_sm, kernel, static_cast<int>(config.blockDim.x), config.dynamicSmemBytes)),
      absl::StrCat(kWhat, ": resident CTAs")));
  return sms * per_sm;
}

// QueryResidentUnits, asked once per (device, kernel): the answer depends only on the
// kernel, its fixed launch shape (threads, shared memory, cluster) and the device, and the
// occupancy queries are not free on a launch path. Thread-safe.
absl::StatusOr<int> ResidentUnits(const void* kernel, const cudaLaunchConfig_t& config, bool pair) {
  static std::mutex mu;
  static auto* known = new std::map<std::pair<int, const void*>, int>();
  int device = 0;
  RETURN_IF_ERROR(CudaErrorToStatus(static_cast<int>(cudaGetDevice(&device)),
                                    absl::StrCat(kWhat, ": current device")));
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = known->find({device, kernel});
    if (it != known->end()) return it->second;
  }
  ASSIGN_OR_RETURN(const int units, QueryResidentUnits(kernel, config, pair, device));
  std::lock_guard<std::mutex> lock(mu);
  known->emplace(std::make_pair(device, kernel), units);
  return units;
}

// Pairs: clusters of two CTAs along x over an even number of row tiles per KV head.
// Persistent (a.persistent): min(units, what the device holds, max_ctas if > 0) CTAs
// (pairs) along x; else one per unit.
template <int D, typename T, bool kFp8, bool kPair>
absl::Status LaunchTyped(const PagedKernelParams& p, const CUtensorMap& k_map,
                         const CUtensorMap& v_map, const pw::PrefillWgmmaArgs& args, int max_ctas,
                         cudaStream_t stream) {
  using Traits = pw::PrefillWgmmaTraits<D, kFp8, kPair>;
  auto* kernel = &pw::PrefillWgmmaKernel<D, T, kFp8, kPair>;
  RETURN_IF_ERROR(AllowDynamicSharedMemory(reinterpret_cast<const void*>(kernel),
                                           Traits::kSmemBytes, /*max_carveout=*/true,
                                           absl::StrCat(kWhat, " head dim ", D)));
  constexpr int kCtas = kPair ? 2 : 1;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCtas;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(p.num_kv_heads * args.num_m_tiles),
                        static_cast<unsigned>(p.num_seqs));
  config.blockDim = dim3(Traits::kThreads);
  config.dynamicSmemBytes = Traits::kSmemBytes;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = kPair ? 1 : 0;
  if (args.persistent != 0) {
    ASSIGN_OR_RETURN(int resident,
                     ResidentUnits(reinterpret_cast<const void*>(kernel), config, kPair));
    if (resident < 1) {
      return absl::ResourceExhaustedError(
          absl::StrCat(kWhat, ": not one CTA", kPair ? " pair" : "", " fits on the device"));
    }
    if (max_ctas > 0 && max_ctas < resident) resident = max_ctas;
    const int64_t units =
        static_cast<int64_t>(p.num_kv_heads) * (args.num_m_tiles / kCtas) * p.num_seqs;
    config.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(units, resident) * kCtas), 1);
  }
  return CudaErrorToStatus(
      static_cast<int>(cudaLaunchKernelEx(&config, kernel, p, k_map, v_map, args)),
      absl::StrCat(kWhat, " launch (head dim ", D, kPair ? ", CTA pairs)" : ")"));
}

// Whether TMA boxes of whole pages serve this block size.
bool TmaTakesBlocks(int block_size) {
  return ptx::Log2IfPowerOfTwo(block_size) >= 4 && block_size <= 256;
}

// The instantiation of one call: head size 64, 128 or 256 (fp8: 64 or 128) and the query type.
template <bool kFp8, bool kPair>
absl::Status LaunchForHeadSize(const PagedKernelParams& p, bool bf16, const CUtensorMap& k_map,
                               const CUtensorMap& v_map, const pw::PrefillWgmmaArgs& args,
                               int max_ctas, cudaStream_t stream) {
  if (p.head_size == 64) {
    return bf16 ? LaunchTyped<64, __nv_bfloat16, kFp8, kPair>(p, k_map, v_map, args, max_ctas,
                                                              stream)
                : LaunchTyped<64, __half, kFp8, kPair>(p, k_map, v_map, args, max_ctas, stream);
  }
  if constexpr (!kFp8) {
    if (p.head_size == 256) {
      return bf16 ? LaunchTyped<256, __nv_bfloat16, false, kPair>(p, k_map, v_map, args, max_ctas,
                                                                  stream)
                  : LaunchTyped<256, __half, false, kPair>(p, k_map, v_map, args, max_ctas, stream);
    }
  }
  return bf16
             ? LaunchTyped<128, __nv_bfloat16, kFp8, kPair>(p, k_map, v_map, args, max_ctas, stream)
             : LaunchTyped<128, __half, kFp8, kPair>(p, k_map, v_map, args, max_ctas, stream);
}

}  // namespace

bool PrefillWgmmaApplies(const PagedKernelParams& p, DType q_dtype, DType out_dtype,
                         DType cache_dtype, std::string* why) {
  auto no = [&](std::string reason) {
    if (why != nullptr) *why = std::move(reason);
    return false;
  };
  if (q_dtype != DType::kFloat16 && q_dtype != DType::kBFloat16) return no("q is not 16-bit");
  if (out_dtype != q_dtype) return no("out dtype differs from q's");
  const bool fp8 = IsFp8(cache_dtype);
  if (cache_dtype != q_dtype && !fp8) return no("the cache dtype is neither q's nor fp8");
  if (p.head_size != p.head_size_v ||
      (p.head_size != 64 && p.head_size != 128 && (p.head_size != 256 || fp8))) {
    return no(absl::StrCat("head sizes ", p.head_size, "/", p.head_size_v, " are not 64/64, ",
                           "128/128 or (a 16-bit cache) 256/256"));
  }
  if (!TmaTakesBlocks(p.block_size)) {
    return no(absl::StrCat("block size ", p.block_size,
                           " is not a power of two in [16, 256] (TMA loads)"));
  }
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) return no("bad head counts");
  if (p.num_blocks < 1 || p.num_blocks >= INT32_MAX) return no("block count out of range");
  constexpr int64_t kMaxStride = int64_t{1} << 39;  // tensor-map strides < 2^40 bytes
  for (int64_t s : {p.k_block_stride, p.k_token_stride, p.k_head_stride, p.v_block_stride,
                    p.v_token_stride, p.v_head_stride}) {
    if (s <= 0 || s >= kMaxStride) return no("a cache stride is out of a tensor map's range");
  }
  const cuda::PrefillOptions options = cuda::ChoosePrefillOptions(p, cache_dtype);
  if (options.load_mode != (fp8 ? cuda::kPrefillAsyncFp8 : cuda::kPrefillAsync16)) {
    return no("cache rows are not 16-byte aligned");
  }
  if (!options.q_vectorized || !options.o_vectorized) {
    return no("q or out rows are not 16-byte aligned");
  }
  return true;
}

bool PrefillWgmmaCompiled() {
#if defined(KVSTREAM_HAVE_SM90A)
  return true;
#else
  return false;
#endif
}

absl::Status LaunchPrefillWgmma(const PagedKernelParams& p, DType q_dtype, DType cache_dtype,
                                const PrefillLaunchOptions& options, cudaStream_t stream) {
  const PrefillWgmmaSchedule schedule = options.wgmma_schedule;
  const PrefillWgmmaCluster cluster = options.wgmma_cluster;
  const PrefillWgmmaOrder order = options.wgmma_order;
  const int block_n = p.head_size == 256 ? pw::PrefillWgmmaTraits<256>::kBlockN
                                         : pw::PrefillWgmmaTraits<128>::kBlockN;
  pw::PrefillWgmmaArgs args{};
  switch (schedule) {
    case PrefillWgmmaSchedule::kSerial: args.schedule = pw::kPrefillWgmmaSerial; break;
    case PrefillWgmmaSchedule::kOverlap: args.schedule = pw::kPrefillWgmmaOverlap; break;
    case PrefillWgmmaSchedule::kPingPong: args.schedule = pw::kPrefillWgmmaPingPong; break;
    default: args.schedule = -1; break;
  }
  args.box_tokens = p.block_size < block_n ? p.block_size : block_n;
  // kDefault (BM_Prefill on the H100, docs/benchmarks.md): pairs where their three-stage
  // ring fits (16-bit caches, head sizes 64 and 128) over pages of fewer than 64 keys,
  // whose many small boxes they halve per producer (block size 16: 7-10% faster from 8k
  // tokens up, 2-3% at 4k);
  // single CTAs elsewhere (block size 64: pairs 0-5% slower; fp8 and two-stage pairs
  // slower still).
  const bool fp8 = IsFp8(cache_dtype);
  const bool pair = cluster == PrefillWgmmaCluster::kPair ||
                    (cluster == PrefillWgmmaCluster::kDefault && !fp8 && p.head_size <= 128 &&
                     p.block_size < 64);
  // Pairs take row tiles two by two (a CTA past the rows of its sequence exits, or, beside
  // one with rows, only loads).
  const int m_tiles = cuda::ChoosePrefillOptions(p, cache_dtype).num_m_tiles;
  args.num_m_tiles = pair ? m_tiles + (m_tiles & 1) : m_tiles;
  if (static_cast<int64_t>(args.num_m_tiles) * p.num_kv_heads * p.num_seqs > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": ", args.num_m_tiles, " row tiles x ",
                                                   p.num_kv_heads, " KV heads x ", p.num_seqs,
                                                   " sequences do not fit a grid"));
  }
  args.e4m3 = cache_dtype == DType::kFloat8E4M3;
  // kDefault: KV heads outer (against inner: -1.8% to +2.0% up to 16k tokens, +1.4% to
  // +2.3% at 32k) and a CTA per unit (persistent CTAs gain up to 5% at 4k-8k tokens with
  // the heads inner, but with the heads outer each round walks one head's units from long
  // to short, which their fixed order cannot balance: 0.6x).
  args.heads_outer = order != PrefillWgmmaOrder::kHeadsInner ? 1 : 0;
  args.persistent = options.wgmma_grid == PrefillWgmmaGrid::kPersistent ? 1 : 0;
  if (args.schedule < 0) args.schedule = DefaultSchedule(pair);
  args.block_shift = ptx::Log2IfPowerOfTwo(p.block_size);
  ASSIGN_OR_RETURN(const CUtensorMap k_map,
                   EncodeMap(p, p.k_cache, p.k_block_stride, p.k_token_stride, p.k_head_stride,
                             cache_dtype, args.box_tokens));
  ASSIGN_OR_RETURN(const CUtensorMap v_map,
                   EncodeMap(p, p.v_cache, p.v_block_stride, p.v_token_stride, p.v_head_stride,
                             cache_dtype, args.box_tokens));
  const bool bf16 = q_dtype == DType::kBFloat16;
  const int max_ctas = options.wgmma_max_ctas;
  if (fp8) {
    return pair ? LaunchForHeadSize<true, true>(p, bf16, k_map, v_map, args, max_ctas, stream)
                : LaunchForHeadSize<true, false>(p, bf16, k_map, v_map, args, max_ctas, stream);
  }
  return pair ? LaunchForHeadSize<false, true>(p, bf16, k_map, v_map, args, max_ctas, stream)
              : LaunchForHeadSize<false, false>(p, bf16, k_map, v_map, args, max_ctas, stream);
}

}  // namespace internal
}  // namespace kvstream
