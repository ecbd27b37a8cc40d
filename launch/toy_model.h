// A small synthetic decoder-only model for kvstream's workers and demo: embedding, per layer
// RMSNorm -> QKV projection -> rotary embedding of q and k -> kvstream Attention -> output
// projection (residual) -> RMSNorm -> MLP (residual), then a final RMSNorm and
// tied-embedding logits. Weights are
// deterministic random numbers from a seed, so two processes build the same model.
//
// Every product is a plain row-by-row loop in float: a row's result never depends on which
// other rows share the batch, so a prompt prefilled on one worker and continued on another
// gives bit-identical outputs to a colocated run (what the workers check).
#ifndef KVSTREAM_LAUNCH_TOY_MODEL_H_
#define KVSTREAM_LAUNCH_TOY_MODEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvstream/attention/attention.h"
#include "kvstream/attention/layer_registry.h"
#include "kvstream/cache/kv_cache.h"

namespace kvstream {

struct ToyModelConfig {
  int vocab_size = 512;
  int num_layers = 4;
  int num_heads = 8;
  int num_kv_heads = 2;
  int head_size = 32;
  int intermediate_size = 512;
  int block_size = 16;
  std::string kv_cache_dtype = "auto";
  std::string layout = "NHD";
  std::string backend = "cpu";
  uint32_t seed = 1;

  int hidden_size() const { return num_heads * head_size; }
  std::string LayerName(int layer) const;
};

class ToyModel {
 public:
  // Builds the weights and the attention layers (registered in `registry`), and allocates
  // each layer's cache of `num_blocks` blocks, bound in the registry.
  // `allocate`, when given, provides each layer's cache memory (e.g. the connector's
  // AllocateCacheMemory, which peers write fastest); otherwise the caches own host memory.
  using Allocator = std::function<absl::StatusOr<std::shared_ptr<void>>(size_t bytes)>;
  static absl::StatusOr<std::unique_ptr<ToyModel>> Create(const ToyModelConfig& config,
                                                          int64_t num_blocks,
                                                          LayerRegistry* registry,
                                                          const Allocator& allocate = nullptr);

  // Runs the model on one row per token (`tokens`, [num_rows], at `positions` in their
  // sequences) in the registry's forward context, whose metadata must describe the same
  // rows. Returns the logits of the rows in `logit_rows` ([logit_rows.size(), vocab_size]).
  absl::StatusOr<std::vector<float>> Forward(absl::Span<const int32_t> tokens,
                                             absl::Span<const int32_t> positions,
                                             absl::Span<const int64_t> logit_rows);

  const ToyModelConfig& config() const { return config_; }
  const std::vector<std::unique_ptr<KvCache>>& caches() const { return caches_; }

 private:
  ToyModel() = default;

  ToyModelConfig config_;
  LayerRegistry* registry_ = nullptr;
  std::vector<std::unique_ptr<Attention>> layers_;
  std::vector<std::shared_ptr<void>> cache_memory_;  // declared first: outlives caches_
  std::vector<std::unique_ptr<KvCache>> caches_;
  std::vector<float> embedding_;  // [vocab, hidden]
  struct LayerWeights {
    std::vector<float> wq, wk, wv, wo;  // [in, out] row-major
    std::vector<float> w_up, w_down;
  };
  std::vector<LayerWeights> weights_;
};

// Index of the largest logit (the first on ties).
int32_t Argmax(absl::Span<const float> logits);

}  // namespace kvstream

#endif  // KVSTREAM_LAUNCH_TOY_MODEL_H_
