// The synthetic decoder-only model's shape and settings (ToyModelConfig), shared by its CPU
// implementation (launch/toy_model.h) and its CUDA one (serving/src/cuda/cuda_model.h), and
// the named shape presets.
#ifndef KVSTREAM_SERVING_MODEL_CONFIG_H_
#define KVSTREAM_SERVING_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvstream {

struct ToyModelConfig {
  int vocab_size = 512;
  int num_layers = 4;
  int num_heads = 8;
  int num_kv_heads = 2;
  int head_size = 32;
  int intermediate_size = 512;
  double rope_theta = 10000;
  int block_size = 16;
  std::string kv_cache_dtype = "auto";
  std::string layout = "NHD";
  std::string backend = "cpu";
  uint32_t seed = 1;
  // OpenBLAS threads (process-wide; set when a model is created). Workers that compare
  // outputs must use the same count, see above.
  int blas_threads = 1;

  int hidden_size() const { return num_heads * head_size; }
  std::string LayerName(int layer) const;
  // Parameters: embedding and LM head (vocab x hidden each), per layer the q/k/v/o
  // projections, gate/up/down and two RMSNorm weights, and the final RMSNorm weight.
  int64_t ParameterCount() const;
};

// Shape presets by name (ModelPresetNames): "toy" (the defaults above) and "llama3-8b"
// (Meta-Llama-3-8B: 32 layers, hidden 4096, 32 query and 8 KV heads of 128, MLP 14336,
// vocabulary 128256, RoPE theta 500000). Sets only the shape fields of `config` (layers,
// heads, KV heads, head size, MLP width, vocabulary, RoPE theta). NotFound listing the
// names for an unknown one.
absl::Status ApplyModelPreset(absl::string_view name, ToyModelConfig& config);
std::vector<std::string> ModelPresetNames();

}  // namespace kvstream

#endif  // KVSTREAM_SERVING_MODEL_CONFIG_H_
