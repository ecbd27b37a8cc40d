// The Attention layer: option checks, cache dtype resolution, KV sharing, and the forward
// pass (cache update, transfer hook, backend).
#include "kvstream/attention/attention.h"

#include <cmath>
#include <cstring>
#include <utility>

#if defined(KVSTREAM_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "kvstream/attention/cuda_attention.h"
#include "kvstream/cache/cache_update.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

absl::Status OptionError(const AttentionOptions& o, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("attention layer '", o.prefix, "': ", what));
}

absl::Status CheckOptions(const AttentionOptions& o) {
  if (o.prefix.empty()) {
    return absl::InvalidArgumentError("attention layer: prefix (the layer name) is empty");
  }
  if (o.num_heads <= 0) return OptionError(o, absl::StrCat("num_heads ", o.num_heads, " must be positive"));
  if (o.head_size <= 0) return OptionError(o, absl::StrCat("head_size ", o.head_size, " must be positive"));
  if (o.head_size_v && *o.head_size_v <= 0) {
    return OptionError(o, absl::StrCat("head_size_v ", *o.head_size_v, " must be positive"));
  }
  if (!(o.scale > 0) || !std::isfinite(o.scale)) {
    return OptionError(o, absl::StrCat("scale ", o.scale, " must be positive and finite"));
  }
  const int kv_heads = o.num_kv_heads.value_or(o.num_heads);
  if (kv_heads <= 0 || o.num_heads % kv_heads != 0) {
    return OptionError(o, absl::StrCat("num_heads ", o.num_heads,
                                       " must be a positive multiple of num_kv_heads ", kv_heads));
  }
  if (!o.alibi_slopes.empty() && static_cast<int>(o.alibi_slopes.size()) != o.num_heads) {
    return OptionError(o, absl::StrCat("alibi_slopes has ", o.alibi_slopes.size(),
                                       " entries, expected num_heads = ", o.num_heads));
  }
  for (float s : o.alibi_slopes) {
    if (!std::isfinite(s)) return OptionError(o, "alibi_slopes must be finite");
  }
  if (o.sliding_window && *o.sliding_window <= 0) {
    return OptionError(o, absl::StrCat("sliding_window ", *o.sliding_window, " must be positive"));
  }
  if (o.logits_soft_cap && (!(*o.logits_soft_cap > 0) || !std::isfinite(*o.logits_soft_cap))) {
    return OptionError(o, absl::StrCat("logits_soft_cap ", *o.logits_soft_cap,
                                       " must be positive and finite"));
  }
  if (o.block_size <= 0) {
    return OptionError(o, absl::StrCat("block_size ", o.block_size, " must be positive"));
  }
  if (o.dtype != DType::kFloat32 && o.dtype != DType::kFloat16 && o.dtype != DType::kBFloat16) {
    return OptionError(o, absl::StrCat("model dtype ", DTypeName(o.dtype),
                                       " is not float32, float16 or bfloat16"));
  }
  if (o.quant_config && o.quant_config->kv_cache_scheme) {
    const KvCacheScheme& s = *o.quant_config->kv_cache_scheme;
    if (s.strategy != "tensor" && s.strategy != "attn_head") {
      return OptionError(o, absl::StrCat("kv_cache_scheme strategy '", s.strategy,
                                         "' is not 'tensor' or 'attn_head'"));
    }
    if (s.type != "float" || s.num_bits != 8) {
      return OptionError(o, absl::StrCat("kv_cache_scheme ", s.type, s.num_bits,
                                         " is not supported (only float8)"));
    }
  }
  return absl::OkStatus();
}

// [rows, a*b] or [rows, a, b] -> [rows, a, b].
absl::StatusOr<TensorView> View3d(const TensorView& t, int64_t a, int64_t b,
                                  absl::string_view what, absl::string_view layer) {
  if (t.dim() != 2 && t.dim() != 3) {
    return absl::InvalidArgumentError(absl::StrCat("attention layer '", layer, "': ", what, " ",
                                                   t.DebugString(), " must be 2-D or 3-D"));
  }
  auto v = t.Reshape({t.size(0), a, b});
  if (!v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("attention layer '", layer, "': ", what, " ",
                                                   t.DebugString(), " cannot be viewed as [",
                                                   t.size(0), ", ", a, ", ", b, "]"));
  }
  if (v->stride(2) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("attention layer '", layer, "': ", what,
                                                   " must be contiguous in its last dimension"));
  }
  return v;
}

absl::Status ZeroRows(const TensorView& out3) {
  const size_t row_bytes = static_cast<size_t>(out3.size(2)) * DTypeSize(out3.dtype());
  char* base = static_cast<char*>(out3.data());
  const size_t es = DTypeSize(out3.dtype());
  if (out3.memory() == MemoryKind::kDevice) {
#if defined(KVSTREAM_HAVE_CUDA)
    // Rows of heads: one 2-D memset per token (pitch = head stride).
    for (int64_t t = 0; t < out3.size(0); ++t) {
      RETURN_IF_ERROR(CudaErrorToStatus(
          cudaMemset2D(base + t * out3.stride(0) * es, static_cast<size_t>(out3.stride(1)) * es,
                       0, row_bytes, static_cast<size_t>(out3.size(1))),
          "cudaMemset2D (attention output of a dummy step)"));
    }
    return absl::OkStatus();
#else
    return absl::FailedPreconditionError("device output in a build without CUDA");
#endif
  }
  for (int64_t t = 0; t < out3.size(0); ++t) {
    for (int64_t h = 0; h < out3.size(1); ++h) {
      std::memset(base + (t * out3.stride(0) + h * out3.stride(1)) * es, 0, row_bytes);
    }
  }
  return absl::OkStatus();
}

// The slopes copied to device memory (once; the buffer lives with the layer).
absl::Status UploadSlopes(const std::vector<float>& slopes, DeviceBuffer& buffer) {
  if (slopes.empty() || !buffer.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(DeviceBuffer fresh,
                   DeviceBuffer::Create(slopes.size() * sizeof(float), MemoryKind::kDevice));
#if defined(KVSTREAM_HAVE_CUDA)
  RETURN_IF_ERROR(CudaErrorToStatus(cudaMemcpy(fresh.data(), slopes.data(),
                                               slopes.size() * sizeof(float),
                                               cudaMemcpyHostToDevice),
                                    "cudaMemcpy (ALiBi slopes to the device)"));
#endif
  buffer = std::move(fresh);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AttentionType> ParseAttentionType(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(std::string(name));
  if (n == "decoder") return AttentionType::kDecoder;
  if (n == "encoder") return AttentionType::kEncoder;
  if (n == "encoder_only") return AttentionType::kEncoderOnly;
  if (n == "encoder_decoder") return AttentionType::kEncoderDecoder;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown attention type '", name,
      "' (expected decoder, encoder, encoder_only or encoder_decoder)"));
}

absl::string_view AttentionTypeName(AttentionType type) {
  switch (type) {
    case AttentionType::kDecoder: return "decoder";
    case AttentionType::kEncoder: return "encoder";
    case AttentionType::kEncoderOnly: return "encoder_only";
    case AttentionType::kEncoderDecoder: return "encoder_decoder";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<Attention>> Attention::Create(const AttentionOptions& options,
                                                             LayerRegistry* registry) {
  if (registry == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention layer '", options.prefix, "': null layer registry"));
  }
  RETURN_IF_ERROR(CheckOptions(options));

  // Cache dtype: a checkpoint's kv_cache_scheme turns "auto" into fp8, never an explicit
  // choice; per-head scales when the scheme says so.
  auto parsed = ParseKvCacheDType(options.kv_cache_dtype);
  if (!parsed.ok()) return OptionError(options, parsed.status().message());
  KvCacheDType cache_dtype = *parsed;
  const KvCacheScheme* scheme = options.quant_config && options.quant_config->kv_cache_scheme
                                    ? &*options.quant_config->kv_cache_scheme
                                    : nullptr;
  if (scheme != nullptr && cache_dtype == KvCacheDType::kAuto) cache_dtype = KvCacheDType::kFp8E4M3;
  const bool per_head = scheme != nullptr && scheme->strategy == "attn_head";

  std::unique_ptr<Attention> layer(new Attention());
  layer->options_ = options;
  layer->kv_cache_dtype_ = cache_dtype;
  KvCacheSpec& spec = layer->spec_;
  spec.block_size = options.block_size;
  spec.num_kv_heads = options.num_kv_heads.value_or(options.num_heads);
  spec.head_size = options.head_size;
  spec.head_size_v = options.head_size_v.value_or(options.head_size);
  spec.dtype = ResolveKvCacheDType(cache_dtype, options.dtype);
  spec.quant_mode = IsFp8(spec.dtype)
                        ? (per_head ? KvQuantMode::kPerHead : KvQuantMode::kPerTensor)
                        : KvQuantMode::kNone;
  RETURN_IF_ERROR(spec.Validate());
  layer->kv_cache_owner_ = options.prefix;

  if (options.kv_sharing_target_layer_name) {
    const std::string& target_name = *options.kv_sharing_target_layer_name;
    if (target_name == options.prefix) {
      return OptionError(options, "kv_sharing_target_layer_name names the layer itself");
    }
    auto target = registry->Get(target_name);
    if (!target.ok()) {
      return absl::NotFoundError(absl::StrCat(
          "attention layer '", options.prefix, "': KV-sharing target '", target_name,
          "' is not registered (it must be created before the layers that share it)"));
    }
    const Attention& t = **target;
    if (t.options().attn_type != options.attn_type) {
      return OptionError(options, absl::StrCat("KV-sharing target '", target_name, "' is ",
                                               AttentionTypeName(t.options().attn_type),
                                               " attention, this layer is ",
                                               AttentionTypeName(options.attn_type)));
    }
    if (t.kv_cache_spec() != spec) {
      return OptionError(options, absl::StrCat("KV-sharing target '", target_name,
                                               "' has KV cache ", t.kv_cache_spec().DebugString(),
                                               ", this layer needs ", spec.DebugString()));
    }
    layer->kv_cache_owner_ = t.kv_cache_owner();
  }

  ASSIGN_OR_RETURN(layer->backend_, CreateAttentionBackend(options.backend, options.batch_invariant));
  RETURN_IF_ERROR(registry->Register(options.prefix, layer.get()));
  layer->registry_ = registry;
  return layer;
}

Attention::~Attention() {
  if (registry_ != nullptr) registry_->Unregister(options_.prefix);
}

absl::StatusOr<Tensor> Attention::Forward(const TensorView& query, const TensorView& key,
                                          const TensorView& value) {
  if (query.dim() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention layer '", layer_name(), "': query has no dimensions"));
  }
  Tensor out = Tensor::Zeros({query.size(0), static_cast<int64_t>(options_.num_heads) * head_size_v()},
                             query.dtype());
  RETURN_IF_ERROR(Forward(query, key, value, out.view()));
  return out;
}

absl::Status Attention::Forward(const TensorView& query, const TensorView& key,
                                const TensorView& value, const TensorView& output) {
  const std::string& name = layer_name();
  const int h = options_.num_heads, kvh = spec_.num_kv_heads;
  const int d = spec_.head_size, dv = spec_.head_size_v;
  ASSIGN_OR_RETURN(TensorView q, View3d(query, h, d, "query", name));
  ASSIGN_OR_RETURN(TensorView out, View3d(output, h, dv, "output", name));
  if (out.size(0) != q.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat("attention layer '", name, "': output has ",
                                                   out.size(0), " rows, query has ", q.size(0)));
  }
  for (const TensorView* t : {&q, &out}) {
    if (!backend_->SupportsMemory(t->memory())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attention layer '", name, "': backend ", backend_->name(), " cannot use ",
          MemoryKindName(t->memory()), " memory"));
    }
  }

  const ForwardContext& context = registry_->forward_context();
  if (!context.is_real()) {
    // Profiling or dummy run: no cache, no transfer, a defined output.
    return ZeroRows(out);
  }
  const AttentionMetadata& md = *context.metadata;
  ASSIGN_OR_RETURN(KvCache * cache, registry_->KvCacheFor(name));
  // A device cache: kernels read the uploaded copy of the metadata, validation the host one.
  const bool on_device = cache->view().memory == MemoryKind::kDevice;
  const DeviceAttentionMetadata* dmd = context.device;
  if (on_device) {
    if (dmd == nullptr || dmd->query_start_loc == nullptr || dmd->seq_lens == nullptr ||
        dmd->block_table == nullptr || dmd->slot_mapping == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "attention layer '", name, "': its cache is in device memory, so the forward "
          "context needs the metadata's device copy (ForwardContext::device, every array)"));
    }
    absl::Status st = UploadSlopes(options_.alibi_slopes, alibi_device_);
    if (!st.ok()) {
      return absl::Status(st.code(), absl::StrCat("attention layer '", name, "': ",
                                                  st.message()));
    }
  }
  RETURN_IF_ERROR(md.Validate(spec_.block_size, cache->num_blocks()));
  if (md.num_actual_tokens > q.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention layer '", name, "': metadata has ", md.num_actual_tokens,
        " query tokens but the query has ", q.size(0), " rows"));
  }

  if (key.empty() != value.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("attention layer '", name, "': ",
                                                   key.empty() ? "value" : "key",
                                                   " given without the other"));
  }
  if (!key.empty() && !shares_kv() && !kv_cache_update_bypass_) {
    ASSIGN_OR_RETURN(TensorView k, View3d(key, kvh, d, "key", name));
    ASSIGN_OR_RETURN(TensorView v, View3d(value, kvh, dv, "value", name));
    if (k.size(0) != v.size(0) || static_cast<size_t>(k.size(0)) != md.slot_mapping.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attention layer '", name, "': key has ", k.size(0), " rows, value ", v.size(0),
          ", slot_mapping ", md.slot_mapping.size(), "; they must agree"));
    }
    if (k.dtype() != v.dtype()) {
      return absl::InvalidArgumentError(absl::StrCat("attention layer '", name, "': key is ",
                                                     DTypeName(k.dtype()), ", value is ",
                                                     DTypeName(v.dtype())));
    }
    CacheUpdateParams update;
    update.key = k.data();
    update.value = v.data();
    update.key_token_stride = k.stride(0);
    update.key_head_stride = k.stride(1);
    update.value_token_stride = v.stride(0);
    update.value_head_stride = v.stride(1);
    update.input_dtype = k.dtype();
    update.slot_mapping = on_device ? dmd->slot_mapping : md.slot_mapping.data();
    update.host_slot_mapping = md.slot_mapping.data();
    update.num_tokens = k.size(0);
    update.cache = cache->view();
    RETURN_IF_ERROR(backend_->UpdateCache(update));
  }

  TransferHook* hook = registry_->transfer_hook();
  // The hook orders its device work after this stream's (the cache update just enqueued).
  CudaAttentionBackend* cuda_backend = on_device ? AsCudaAttentionBackend(backend_.get()) : nullptr;
  void* const stream = cuda_backend != nullptr ? cuda_backend->stream() : nullptr;
  if (hook != nullptr) {
    absl::Status s = hook->BeforeAttention(name, stream);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("layer '", name, "' waiting for its KV: ",
                                                 s.message()));
    }
  }

  PagedAttentionParams p;
  p.q = q.data();
  p.q_dtype = q.dtype();
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.out = out.data();
  p.out_dtype = out.dtype();
  p.o_token_stride = out.stride(0);
  p.o_head_stride = out.stride(1);
  p.num_tokens = q.size(0);
  p.cache = cache->view();
  p.query_start_loc = on_device ? dmd->query_start_loc : md.query_start_loc.data();
  p.seq_lens = on_device ? dmd->seq_lens : md.seq_lens.data();
  p.block_table = on_device ? dmd->block_table : md.block_table.data();
  p.host.query_start_loc = md.query_start_loc.data();
  p.host.seq_lens = md.seq_lens.data();
  p.host.block_table = md.block_table.data();
  p.block_table_stride = md.max_blocks_per_seq;
  p.num_seqs = md.num_seqs();
  p.max_query_len = md.max_query_len;
  p.max_seq_len = md.max_seq_len;
  p.num_heads = h;
  p.scale = options_.scale;
  p.causal = options_.attn_type == AttentionType::kDecoder;
  p.sliding_window = options_.sliding_window.value_or(0);
  p.logits_soft_cap = options_.logits_soft_cap.value_or(0.0f);
  p.alibi_slopes = options_.alibi_slopes.empty() ? nullptr : options_.alibi_slopes.data();
  p.host.alibi_slopes = p.alibi_slopes;
  if (on_device && p.alibi_slopes != nullptr) p.alibi_slopes = alibi_device_.data_as<float>();
  absl::Status s = backend_->Forward(p);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("layer '", name, "': ", s.message()));
  }

  if (hook != nullptr) {
    s = hook->AfterAttention(name, *cache, md, stream);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("layer '", name, "' saving its KV: ",
                                                 s.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvstream
