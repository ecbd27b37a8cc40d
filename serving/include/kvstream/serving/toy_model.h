// A synthetic decoder-only model with Llama's structure, for kvstream's workers and demo:
// embedding, per layer RMSNorm -> fused QKV projection -> rotary embedding of q and k ->
// kvstream Attention -> output projection (residual) -> RMSNorm -> SwiGLU MLP (residual),
// then a final RMSNorm and an LM head. Weights are deterministic random numbers drawn per
// layer from the seed, so two processes (or two pipeline stages owning different layers)
// build the same weights. Shapes come from a preset (`toy`, `llama3-8b`) or flags.
//
// Matrix products run through OpenBLAS's cblas_sgemm. Its result for a row depends on the
// other rows of the call (how many there are and where the row sits among them: the kernel
// splits the sum differently for different tiles, measured with OpenBLAS 0.3.21) and on
// the BLAS thread count. So that a prompt prefilled on one worker and continued on another
// gives bit-identical outputs to a colocated run (what the workers check), every product is
// computed segment by segment, where a segment is a fixed part of one request that both
// sides compute in one piece whatever else shares the batch: the prompt but its last token,
// the last prompt token, each generated token. The prefill worker computes the KV of
// exactly the rows of the first segment in one call, as the colocated run does, and the
// decode worker the others. The thread count is a model setting (blas_threads) that both
// sides set explicitly. The rest (norms, rotary embedding, attention, activation) is
// computed per row in an order that does not depend on the batch.
#ifndef KVSTREAM_SERVING_TOY_MODEL_H_
#define KVSTREAM_SERVING_TOY_MODEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvstream/attention/attention.h"
#include "kvstream/attention/layer_registry.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/connector/layer_routing.h"
#include "kvstream/serving/model_config.h"

namespace kvstream {


class ToyModel {
 public:
  // Builds the weights and attention layers of `layers` (default: all; a pipeline stage
  // builds only its own), registered in `registry`, and allocates each layer's cache of
  // `num_blocks` blocks, bound in the registry. The embedding is built when the range
  // starts at layer 0, the final norm and LM head when it ends at the last layer.
  // `allocate`, when given, provides each layer's cache memory (e.g. the connector's
  // AllocateCacheMemory, which peers write fastest); otherwise the caches own host memory.
  // InvalidArgument for bad shapes or a range outside the model.
  using Allocator = std::function<absl::StatusOr<std::shared_ptr<void>>(size_t bytes)>;
  static absl::StatusOr<std::unique_ptr<ToyModel>> Create(
      const ToyModelConfig& config, int64_t num_blocks, LayerRegistry* registry,
      const Allocator& allocate = nullptr, std::optional<LayerRange> layers = std::nullopt);

  // The hidden states of `tokens` ([rows, hidden]). FailedPrecondition without the
  // embedding; InvalidArgument for a token outside the vocabulary.
  absl::StatusOr<std::vector<float>> Embed(absl::Span<const int32_t> tokens) const;

  // Runs this model's layers over `hidden` ([rows, hidden], updated in place) in the
  // registry's forward context, whose metadata must describe the same rows at
  // `positions`. `segments` are row counts, in row order, summing to rows: each segment's
  // products run as one BLAS call (see the top of this file).
  absl::Status RunLayers(std::vector<float>& hidden, absl::Span<const int32_t> positions,
                         absl::Span<const int32_t> segments);

  // The logits ([rows.size(), vocab]) of the given rows of `hidden`, each row on its own.
  // FailedPrecondition without the LM head; InvalidArgument for a row out of range.
  absl::StatusOr<std::vector<float>> Logits(absl::Span<const float> hidden,
                                            absl::Span<const int64_t> rows) const;

  // Embed, RunLayers and Logits, for a model with every layer.
  absl::StatusOr<std::vector<float>> Forward(absl::Span<const int32_t> tokens,
                                             absl::Span<const int32_t> positions,
                                             absl::Span<const int32_t> segments,
                                             absl::Span<const int64_t> logit_rows);

  const ToyModelConfig& config() const { return config_; }
  const LayerRange& layers() const { return range_; }
  // The cache of `layer` (a model layer index), or null when this model lacks the layer.
  KvCache* cache(int layer) const;

 private:
  ToyModel() = default;

  ToyModelConfig config_;
  LayerRange range_;
  LayerRegistry* registry_ = nullptr;
  std::vector<std::unique_ptr<Attention>> attention_;
  std::vector<std::shared_ptr<void>> cache_memory_;  // declared first: outlives caches_
  std::vector<std::unique_ptr<KvCache>> caches_;     // by layer - range_.begin
  std::vector<float> embedding_;   // [vocab, hidden]; empty unless the range starts at 0
  std::vector<float> final_norm_;  // [hidden]; with lm_head_
  std::vector<float> lm_head_;     // [hidden, vocab]; empty unless the range ends last
  struct LayerWeights {
    std::vector<float> attn_norm, mlp_norm;  // [hidden]
    std::vector<float> wqkv;                 // [hidden, hidden + 2 * kv] row-major: q | k | v
    std::vector<float> wo;                   // [hidden, hidden]
    std::vector<float> w_gate_up;            // [hidden, 2 * intermediate]: gate | up
    std::vector<float> w_down;               // [intermediate, hidden]
  };
  std::vector<LayerWeights> weights_;  // by layer - range_.begin
};

// Index of the largest logit (the first on ties).
int32_t Argmax(absl::Span<const float> logits);

}  // namespace kvstream

#endif  // KVSTREAM_SERVING_TOY_MODEL_H_
