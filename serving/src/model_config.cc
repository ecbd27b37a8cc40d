// ToyModelConfig's helpers and the shape presets (model_config.h).
#include "kvstream/serving/model_config.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvstream {

std::string ToyModelConfig::LayerName(int layer) const {
  return absl::StrCat("model.layers.", layer, ".self_attn.attn");
}

int64_t ToyModelConfig::ParameterCount() const {
  const int64_t hidden = hidden_size();
  const int64_t kv = static_cast<int64_t>(num_kv_heads) * head_size;
  const int64_t inter = intermediate_size;
  const int64_t per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter +
                            2 * hidden;
  return 2 * static_cast<int64_t>(vocab_size) * hidden + num_layers * per_layer + hidden;
}

std::vector<std::string> ModelPresetNames() { return {"toy", "llama3-8b"}; }

absl::Status ApplyModelPreset(absl::string_view name, ToyModelConfig& c) {
  if (name == "toy") {
    const ToyModelConfig d;
    c.num_layers = d.num_layers;
    c.num_heads = d.num_heads;
    c.num_kv_heads = d.num_kv_heads;
    c.head_size = d.head_size;
    c.intermediate_size = d.intermediate_size;
    c.vocab_size = d.vocab_size;
    c.rope_theta = d.rope_theta;
    return absl::OkStatus();
  }
  if (name == "llama3-8b") {
    c.num_layers = 32;
    c.num_heads = 32;
    c.num_kv_heads = 8;
    c.head_size = 128;
    c.intermediate_size = 14336;
    c.vocab_size = 128256;
    c.rope_theta = 500000;
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("unknown model preset '", name, "' (presets: ",
                                          absl::StrJoin(ModelPresetNames(), ", "), ")"));
}

}  // namespace kvstream
