// KvCache: owned (zero-filled host, pinned or device buffers in NHD or HND order) or borrowed (an engine's
// tensors, checked against the spec at run time) K and V buffers of one layer, plus fp8
// scales.
#include "kvstream/cache/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

std::vector<int64_t> ToVector(const CacheStrides& s) { return {s.block, s.token, s.head, s.dim}; }

CacheStrides FromVector(const std::vector<int64_t>& s) {
  CacheStrides c;
  c.block = s[0];
  c.token = s[1];
  c.head = s[2];
  c.dim = s[3];
  return c;
}

int NumScales(const KvCacheSpec& spec) {
  switch (spec.quant_mode) {
    case KvQuantMode::kPerTensor: return 1;
    case KvQuantMode::kPerHead: return spec.num_kv_heads;
    case KvQuantMode::kNone: return 0;
  }
  return 0;
}

// Checks one borrowed cache tensor against the logical shape the spec implies. `name` is
// "K" or "V"; every error names the tensor and what differs.
absl::Status CheckBorrowed(const KvCacheSpec& spec, const TensorView& t, const char* name,
                           int64_t head_size) {
  const std::string expected =
      absl::StrCat("[num_blocks, ", spec.block_size, ", ", spec.num_kv_heads, ", ", head_size, "]");
  if (t.data() == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("borrowed ", name, " cache has null data"));
  }
  if (t.dim() != 4) {
    return absl::InvalidArgumentError(absl::StrCat("borrowed ", name, " cache must be 4-D ",
                                                   expected, ", got ", t.dim(), "-D ",
                                                   t.DebugString()));
  }
  if (static_cast<int>(t.strides().size()) != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("borrowed ", name, " cache has ", t.strides().size(), " strides for 4 dims"));
  }
  if (t.dtype() != spec.dtype) {
    return absl::InvalidArgumentError(absl::StrCat("borrowed ", name, " cache has dtype ",
                                                   DTypeName(t.dtype()), ", the spec says ",
                                                   DTypeName(spec.dtype)));
  }
  static const char* const kDimNames[] = {"num_blocks", "block_size", "num_kv_heads",
                                          "head_size"};
  const int64_t want[] = {-1, spec.block_size, spec.num_kv_heads, head_size};
  if (t.size(0) <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("borrowed ", name, " cache ",
                                                   t.DebugString(), " has no blocks"));
  }
  for (int d = 1; d < 4; ++d) {
    if (t.size(d) != want[d]) {
      return absl::InvalidArgumentError(
          absl::StrCat("borrowed ", name, " cache has shape ", t.DebugString(), ", expected ",
                       expected, ": dimension ", d, " (", kDimNames[d], ") is ", t.size(d),
                       ", not ", want[d]));
    }
  }
  if (t.stride(3) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("borrowed ", name, " cache needs a contiguous last dimension (stride 1), "
                     "got strides [", absl::StrJoin(t.strides(), ", "), "]"));
  }
  for (int d = 0; d < 4; ++d) {
    if (t.stride(d) < 0) {
      return absl::InvalidArgumentError(absl::StrCat("borrowed ", name,
                                                     " cache has a negative stride: [",
                                                     absl::StrJoin(t.strides(), ", "), "]"));
    }
  }
  // Two cells sharing memory would make one slot's update overwrite another's. Dense,
  // permuted and padded layouts all pass: ordered by stride, each dimension must step over
  // the whole extent of the ones inside it.
  std::vector<int> order;
  for (int d = 0; d < 4; ++d) {
    if (t.size(d) > 1) order.push_back(d);
  }
  std::sort(order.begin(), order.end(), [&t](int a, int b) { return t.stride(a) < t.stride(b); });
  int64_t extent = 1;
  for (int d : order) {
    if (t.stride(d) < extent) {
      return absl::InvalidArgumentError(
          absl::StrCat("borrowed ", name, " cache strides [", absl::StrJoin(t.strides(), ", "),
                       "] make cells of shape ", t.DebugString(), " overlap"));
    }
    if (__builtin_mul_overflow(t.stride(d), t.size(d), &extent)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "borrowed ", name, " cache strides [", absl::StrJoin(t.strides(), ", "), "] overflow"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

KvCache::~KvCache() = default;

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const Options& options) {
  RETURN_IF_ERROR(options.spec.Validate());
  if (options.num_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvCache needs num_blocks > 0, got ", options.num_blocks));
  }
  if (options.memory != MemoryKind::kHost && !BuiltWithCuda()) {
    return absl::UnimplementedError(
        absl::StrCat("KvCache::Create: ", MemoryKindName(options.memory),
                     " memory is not available in this build; device and pinned memory need "
                     "a build with CUDA (the CUDA backend); use host memory, or Borrow() "
                     "existing buffers"));
  }
  const KvCacheSpec& spec = options.spec;
  const int64_t nb = options.num_blocks;
  const int64_t bs = spec.block_size;
  const int64_t heads = spec.num_kv_heads;
  auto physical_shape = [&](int64_t head_size) -> std::vector<int64_t> {
    if (options.layout == KvLayout::kHND) return {nb, heads, bs, head_size};
    return {nb, bs, heads, head_size};
  };
  // Refuse sizes whose byte count does not fit before asking the allocator.
  int64_t tensor_bytes[2] = {0, 0};  // K, V
  for (int which = 0; which < 2; ++which) {
    const int64_t head_size = which == 0 ? spec.head_size : spec.head_size_v;
    int64_t bytes = static_cast<int64_t>(DTypeSize(spec.dtype));
    for (int64_t d : physical_shape(head_size)) {
      if (__builtin_mul_overflow(bytes, d, &bytes)) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "KvCache::Create: ", nb, " blocks of ", spec.DebugString(), " overflow 64 bits"));
      }
    }
    tensor_bytes[which] = bytes;
  }

  std::unique_ptr<KvCache> cache(new KvCache());
  cache->spec_ = spec;
  cache->num_blocks_ = nb;
  cache->owned_ = true;
  void* k_data = nullptr;
  void* v_data = nullptr;
  if (options.memory == MemoryKind::kHost) {
    cache->k_storage_ = Tensor::Zeros(physical_shape(spec.head_size), spec.dtype);
    cache->v_storage_ = Tensor::Zeros(physical_shape(spec.head_size_v), spec.dtype);
    if (cache->k_storage_.data() == nullptr || cache->v_storage_.data() == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("KvCache::Create: cannot allocate ", nb, " blocks of ",
                       spec.BytesPerBlock(), " bytes (", spec.DebugString(), ")"));
    }
    k_data = cache->k_storage_.data();
    v_data = cache->v_storage_.data();
  } else {
    for (int which = 0; which < 2; ++which) {
      absl::StatusOr<DeviceBuffer> buffer = DeviceBuffer::CreateZeroed(
          static_cast<size_t>(tensor_bytes[which]), options.memory);
      if (!buffer.ok()) {
        return absl::Status(
            buffer.status().code(),
            absl::StrCat("KvCache::Create: ", which == 0 ? "K" : "V", " cache of ", nb,
                         " blocks (", spec.DebugString(), ") in ",
                         MemoryKindName(options.memory), " memory: ", buffer.status().message()));
      }
      (which == 0 ? cache->k_device_ : cache->v_device_) = std::move(buffer).value();
    }
    k_data = cache->k_device_.data();
    v_data = cache->v_device_.data();
  }
  cache->k_ = TensorView(k_data, spec.dtype, {nb, bs, heads, spec.head_size},
                         ToVector(MakeCacheStrides(spec, options.layout, /*is_value=*/false)),
                         options.memory);
  cache->v_ = TensorView(v_data, spec.dtype, {nb, bs, heads, spec.head_size_v},
                         ToVector(MakeCacheStrides(spec, options.layout, /*is_value=*/true)),
                         options.memory);
  cache->k_scale_.assign(NumScales(spec), 1.0f);
  cache->v_scale_.assign(NumScales(spec), 1.0f);
  return cache;
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Borrow(const KvCacheSpec& spec, TensorView k,
                                                         TensorView v) {
  RETURN_IF_ERROR(spec.Validate());
  RETURN_IF_ERROR(CheckBorrowed(spec, k, "K", spec.head_size));
  RETURN_IF_ERROR(CheckBorrowed(spec, v, "V", spec.head_size_v));
  if (k.size(0) != v.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat("borrowed K cache has ", k.size(0),
                                                   " blocks but V has ", v.size(0)));
  }
  if (k.memory() != v.memory()) {
    return absl::InvalidArgumentError(absl::StrCat("borrowed K cache is in ",
                                                   MemoryKindName(k.memory()),
                                                   " memory but V is in ",
                                                   MemoryKindName(v.memory())));
  }
  std::unique_ptr<KvCache> cache(new KvCache());
  cache->spec_ = spec;
  cache->num_blocks_ = k.size(0);
  cache->owned_ = false;
  cache->k_ = std::move(k);
  cache->v_ = std::move(v);
  cache->k_scale_.assign(NumScales(spec), 1.0f);
  cache->v_scale_.assign(NumScales(spec), 1.0f);
  return cache;
}

std::optional<KvLayout> KvCache::layout() const {
  const CacheStrides ks = FromVector(k_.strides());
  const CacheStrides vs = FromVector(v_.strides());
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
    if (ks == MakeCacheStrides(spec_, layout, false) && vs == MakeCacheStrides(spec_, layout, true)) {
      return layout;
    }
  }
  return std::nullopt;
}

KvCacheView KvCache::view() const {
  KvCacheView view;
  view.k = k_.data();
  view.v = v_.data();
  view.k_strides = FromVector(k_.strides());
  view.v_strides = FromVector(v_.strides());
  view.num_blocks = num_blocks_;
  view.spec = spec_;
  if (!k_scale_.empty()) {
    view.k_scale = k_scale_.data();
    view.v_scale = v_scale_.data();
    view.num_scales = static_cast<int>(k_scale_.size());
  }
  view.memory = k_.memory();
  return view;
}

absl::Status KvCache::SetScales(absl::Span<const float> k_scale, absl::Span<const float> v_scale) {
  if (!IsFp8(spec_.dtype)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SetScales: the cache is ", DTypeName(spec_.dtype), "; only fp8 caches have scales"));
  }
  const size_t want = static_cast<size_t>(NumScales(spec_));
  for (const auto& [name, scales] : {std::make_pair("k", k_scale), std::make_pair("v", v_scale)}) {
    if (scales.size() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SetScales: ", KvQuantModeName(spec_.quant_mode), " quantisation with ",
          spec_.num_kv_heads, " KV heads needs ", want, " ", name, " scale(s), got ",
          scales.size()));
    }
    for (size_t i = 0; i < scales.size(); ++i) {
      if (!std::isfinite(scales[i]) || !(scales[i] > 0.0f)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "SetScales: ", name, " scale ", i, " is ", scales[i], "; scales must be finite and > 0"));
      }
    }
  }
  k_scale_.assign(k_scale.begin(), k_scale.end());
  v_scale_.assign(v_scale.begin(), v_scale.end());
  return absl::OkStatus();
}

}  // namespace kvstream
