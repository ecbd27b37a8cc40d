// CudaModel: the synthetic decoder-only model (model_config.h; the CPU one is
// launch/toy_model.h) on one GPU. The same structure and weights (drawn from the seed on the
// GPU with the CPU model's generator, then rounded to bf16): embedding, per layer RMSNorm ->
// fused QKV projection -> rotary embedding -> kvstream Attention over device caches (the
// `cuda` backend) -> output projection (residual) -> RMSNorm -> SwiGLU MLP (residual), then
// a final RMSNorm and the LM head. Activations bf16, matrix products through cuBLAS with
// fp32 accumulation, logits fp32.
//
// Bit-identical outputs between a colocated run and a disaggregated one (prefill on one
// worker, decode on another, both on GPUs of one kind) rest on the same rule as the CPU
// model's: every matrix product runs segment by segment (toy_model.h explains segments), and
// everything else is computed per row in an order that does not depend on the batch
// (serving/src/cuda/model_ops.h; attention in the CUDA backend's batch-invariant mode, so a
// step's one-row sequences must come first in its batch).
//
// Ordering: all of the model's work runs on its own stream; each layer's attention runs on
// the attention backend's stream, ordered after the model's work by an event and the
// model's next work after it by another. Forward returns once the logits are on the host.
//
// Thread safety: thread-compatible (one step at a time).
#ifndef KVSTREAM_SERVING_CUDA_MODEL_H_
#define KVSTREAM_SERVING_CUDA_MODEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvstream/attention/layer_registry.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/connector/layer_routing.h"
#include "kvstream/serving/model_config.h"

namespace kvstream {

class CudaModel {
 public:
  // Device memory for a cache (e.g. the connector's AllocateCacheMemory with device memory,
  // which a cuda_ipc peer writes into); null: the caches allocate their own.
  using Allocator = std::function<absl::StatusOr<std::shared_ptr<void>>(size_t bytes)>;

  // Builds the weights of `layers` (default: all) on the calling thread's current device,
  // their attention layers (registered in `registry`, backend "cuda", bf16) and each layer's
  // device cache of `num_blocks` blocks in config.layout (kv_cache_dtype as configured),
  // bound in the registry. The embedding comes with layer 0, the final norm and LM head
  // with the last layer. FailedPrecondition without a usable GPU; InvalidArgument for bad
  // shapes or a range outside the model; ResourceExhausted when the GPU's memory does not
  // hold it.
  static absl::StatusOr<std::unique_ptr<CudaModel>> Create(
      const ToyModelConfig& config, int64_t num_blocks, LayerRegistry* registry,
      const Allocator& allocate = nullptr, std::optional<LayerRange> layers = std::nullopt);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  // One step of a model with every layer, in the registry's current forward context (host
  // metadata describing `tokens` at `positions`; the model uploads its device copy):
  // embedding, every layer, and the logits ([logit_rows.size(), vocab], fp32, on the host)
  // of the given rows. `segments` are row counts in row order summing to the rows. Without
  // logit rows (a prefill worker's pass: its KV is what it is for) the last layer stops
  // after its attention, whose output nothing would read.
  // InvalidArgument for a token outside the vocabulary, mismatched sizes or a bad segment
  // or row; FailedPrecondition for a model without every layer or without a forward
  // context; DeadlineExceeded when the GPU's work has not finished within `timeout`.
  absl::StatusOr<std::vector<float>> Forward(absl::Span<const int32_t> tokens,
                                             absl::Span<const int32_t> positions,
                                             absl::Span<const int32_t> segments,
                                             absl::Span<const int64_t> logit_rows,
                                             absl::Duration timeout = absl::Seconds(60));

  const ToyModelConfig& config() const;
  const LayerRange& layers() const;
  // The cache of `layer` (a model layer index), or null when this model lacks the layer.
  KvCache* cache(int layer) const;

  struct State;

 private:
  explicit CudaModel(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace kvstream

#endif  // KVSTREAM_SERVING_CUDA_MODEL_H_
