// Attention: the attention layer with vLLM's constructor surface, running over kvstream's
// paged KV cache, wrapped by the TransferHook (transfer_hook.h).
//
//   AttentionOptions o;
//   o.num_heads = 32; o.head_size = 128; o.scale = 1 / std::sqrt(128.0f);
//   o.num_kv_heads = 8; o.prefix = "model.layers.0.self_attn.attn";
//   ASSIGN_OR_RETURN(std::unique_ptr<Attention> attn, Attention::Create(o, &registry));
//   ... allocate a KvCache with attn->kv_cache_spec(), registry.BindKvCache(...) ...
//   RETURN_IF_ERROR(attn->Forward(query, key, value, output));
//
// Cache dtype: "auto" means the model dtype, unless the quant config carries a
// kv_cache_scheme, which turns "auto" into fp8 (e4m3); an explicit choice always wins. fp8
// caches are scaled per tensor, or per KV head when the scheme's strategy is "attn_head".
#ifndef KVSTREAM_ATTENTION_ATTENTION_H_
#define KVSTREAM_ATTENTION_ATTENTION_H_

#include <memory>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/layer_registry.h"
#include "kvstream/cache/kv_cache_spec.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/tensor.h"

namespace kvstream {

// decoder: causal self-attention with a KV cache. encoder, encoder_only: bidirectional
// self-attention. encoder_decoder: bidirectional cross-attention (queries from the
// decoder, keys and values from the encoder, written once, then read with key absent).
enum class AttentionType { kDecoder, kEncoder, kEncoderOnly, kEncoderDecoder };
absl::StatusOr<AttentionType> ParseAttentionType(absl::string_view name);
absl::string_view AttentionTypeName(AttentionType type);

// The part of a checkpoint's quantization config that concerns the KV cache (as
// llm-compressor writes it).
struct KvCacheScheme {
  std::string type = "float";
  int num_bits = 8;
  std::string strategy = "tensor";  // "tensor" or "attn_head"
  bool dynamic = false;
  bool symmetric = true;
};
struct QuantConfig {
  std::optional<KvCacheScheme> kv_cache_scheme;
};

struct AttentionOptions {
  // vLLM's Attention(...) arguments.
  int num_heads = 0;
  int head_size = 0;
  float scale = 0;                    // required, > 0
  std::optional<int> num_kv_heads;    // default num_heads
  std::vector<float> alibi_slopes;    // empty or num_heads entries
  std::optional<int> sliding_window;  // > 0 when set
  std::string kv_cache_dtype = "auto";
  std::optional<float> logits_soft_cap;  // > 0 when set
  AttentionType attn_type = AttentionType::kDecoder;
  std::optional<std::string> kv_sharing_target_layer_name;
  std::optional<QuantConfig> quant_config;
  std::string prefix;  // the layer name, e.g. "model.layers.3.self_attn.attn"
  // What vLLM takes from its model and cache configs.
  std::optional<int> head_size_v;  // default head_size
  DType dtype = DType::kBFloat16;  // model (activation) dtype; what "auto" resolves to
  int block_size = 16;
  std::string backend = "cpu";     // see AttentionBackendNames()
  // Every output row independent of the rest of the batch (CreateAttentionBackend).
  bool batch_invariant = false;
};

class Attention {
 public:
  // Validates `options`, resolves the cache dtype, creates the backend and registers the
  // layer in `registry` under options.prefix. InvalidArgument naming the bad option;
  // AlreadyExists for a duplicate name; for a KV-sharing layer, NotFound when the target is
  // not registered (earlier) and InvalidArgument when its attention type or KV shape
  // differs. `registry` must outlive the layer.
  static absl::StatusOr<std::unique_ptr<Attention>> Create(const AttentionOptions& options,
                                                           LayerRegistry* registry);
  ~Attention();
  Attention(const Attention&) = delete;
  Attention& operator=(const Attention&) = delete;

  // One forward pass of this layer in the registry's current forward context.
  //   query:  [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size]
  //   key:    [num_kv_tokens, num_kv_heads * head_size] (or 3-D); empty view = absent
  //   value:  [num_kv_tokens, num_kv_heads * head_size_v] (or 3-D); absent with key
  //   output: [num_tokens, num_heads * head_size_v] (or 3-D), written
  // Real step: cache update (unless the layer shares KV, the key is absent, or the update is
  // bypassed; metadata.slot_mapping then has num_kv_tokens entries), then the hook's
  // BeforeAttention, the backend, the hook's AfterAttention. Dummy step: output zeroed,
  // nothing else. A layer whose cache is in device memory takes device tensors and reads
  // the context's device metadata (FailedPrecondition without it); its backend enqueues
  // work on its stream and may return before the output is written. Errors name the layer and the tensor at fault; on error the output is
  // unspecified, and a failed cache-update validation leaves the cache unchanged.
  absl::Status Forward(const TensorView& query, const TensorView& key, const TensorView& value,
                       const TensorView& output);
  // As above, allocating the output ([num_tokens, num_heads * head_size_v], query's dtype).
  absl::StatusOr<Tensor> Forward(const TensorView& query, const TensorView& key,
                                 const TensorView& value);

  // The cache this layer needs (vLLM's get_kv_cache_spec).
  const KvCacheSpec& kv_cache_spec() const { return spec_; }
  const std::string& layer_name() const { return options_.prefix; }
  const AttentionOptions& options() const { return options_; }
  int num_kv_heads() const { return spec_.num_kv_heads; }
  int head_size_v() const { return spec_.head_size_v; }
  // The resolved cache dtype (after "auto" and the quant config).
  KvCacheDType kv_cache_dtype() const { return kv_cache_dtype_; }
  bool shares_kv() const { return options_.kv_sharing_target_layer_name.has_value(); }
  // The layer whose cache this layer reads: itself, or the end of its KV-sharing chain.
  const std::string& kv_cache_owner() const { return kv_cache_owner_; }
  // Set by models that write the cache themselves before calling Forward with the key.
  void set_kv_cache_update_bypass(bool bypass) { kv_cache_update_bypass_ = bypass; }
  bool kv_cache_update_bypass() const { return kv_cache_update_bypass_; }
  AttentionBackend& backend() { return *backend_; }

 private:
  Attention() = default;

  AttentionOptions options_;
  KvCacheSpec spec_;
  KvCacheDType kv_cache_dtype_ = KvCacheDType::kAuto;
  std::string kv_cache_owner_;
  bool kv_cache_update_bypass_ = false;
  std::unique_ptr<AttentionBackend> backend_;
  LayerRegistry* registry_ = nullptr;
  // The ALiBi slopes in device memory, uploaded at the first step over a device cache.
  DeviceBuffer alibi_device_;
};

}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_ATTENTION_H_
