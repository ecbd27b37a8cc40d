// CudaModel (cuda_model.h): weights and scratch in device memory, the step enqueued on the
// model's stream, attention on each layer's backend stream between two events.
#include "kvstream/serving/cuda_model.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cuda/cublas_gemm.h"
#include "cuda/model_ops.h"
#include "kvstream/attention/attention.h"
#include "kvstream/attention/cuda_attention.h"
#include "kvstream/attention/metadata.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/common/tensor.h"
#include "layer_cache.h"
#include "random_weights.h"

namespace kvstream {
namespace {

constexpr float kRmsEps = 1e-6f;  // as the CPU model's

absl::Status Cuda(cudaError_t e, const char* what) {
  return CudaErrorToStatus(static_cast<int>(e), what);
}

uint16_t* Bf16(DeviceBuffer& b) { return b.data_as<uint16_t>(); }
const uint16_t* Bf16(const DeviceBuffer& b) { return b.data_as<const uint16_t>(); }

// A bf16 tensor of `n` weights drawn from the seed (random_weights.h).
absl::StatusOr<DeviceBuffer> Weights(uint32_t seed, uint64_t tensor, int64_t n, float mean,
                                     float stddev, void* stream) {
  ASSIGN_OR_RETURN(DeviceBuffer b,
                   DeviceBuffer::Create(static_cast<size_t>(n) * 2, MemoryKind::kDevice));
  RETURN_IF_ERROR(
      internal::LaunchRandomBf16(seed, tensor, n, mean, stddev, Bf16(b), stream));
  return b;
}

absl::StatusOr<DeviceBuffer> Matrix(uint32_t seed, uint64_t tensor, int64_t rows, int64_t cols,
                                    void* stream) {
  return Weights(seed, tensor, rows * cols, 0.0f, 1.0f / std::sqrt(static_cast<float>(rows)),
                 stream);
}

absl::StatusOr<DeviceBuffer> NormWeight(uint32_t seed, uint64_t tensor, int64_t n,
                                        void* stream) {
  return Weights(seed, tensor, n, internal::kNormWeightMean, internal::kNormWeightStddev,
                 stream);
}

// A scratch buffer that grows to the largest step seen.
absl::Status Reserve(DeviceBuffer& b, size_t bytes) {
  if (b.size() >= bytes) return absl::OkStatus();
  ASSIGN_OR_RETURN(b, DeviceBuffer::Create(bytes, MemoryKind::kDevice));
  return absl::OkStatus();
}

template <typename T>
absl::Status Upload(DeviceBuffer& b, absl::Span<const T> values, void* stream) {
  RETURN_IF_ERROR(Reserve(b, std::max<size_t>(1, values.size()) * sizeof(T)));
  if (values.empty()) return absl::OkStatus();
  // From pageable memory: the copy has read the source when the call returns.
  return Cuda(cudaMemcpyAsync(b.data(), values.data(), values.size() * sizeof(T),
                              cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)),
              "CudaModel: upload");
}

}  // namespace

struct CudaModel::State {
  ToyModelConfig config;
  LayerRange range;
  LayerRegistry* registry = nullptr;
  CudaStream stream;
  std::optional<internal::CublasGemm> gemm;
  struct Layer {
    std::unique_ptr<Attention> attention;
    void* attention_stream = nullptr;
    CudaEvent inputs_ready, output_ready;
    DeviceBuffer attn_norm, mlp_norm, wqkv, wo, w_gate_up, w_down;
  };
  std::vector<Layer> layers;                          // by layer - range.begin
  std::vector<std::shared_ptr<void>> cache_memory;    // declared before caches: outlives them
  std::vector<std::unique_ptr<KvCache>> caches;       // by layer - range.begin
  DeviceBuffer embedding, final_norm, lm_head;
  // Scratch, grown on demand.
  DeviceBuffer tokens, positions, query_start, seq_lens, block_table, slots;
  DeviceBuffer x, h, qkv, q, k, v, attn, gate_up, act, last, logits;

  int hidden() const { return config.hidden_size(); }
  int kv() const { return config.num_kv_heads * config.head_size; }
  void* s() const { return stream.get(); }

  // out[rows of each segment] = in * w (+ out when residual), one product per segment.
  absl::Status Products(const uint16_t* in, const DeviceBuffer& w, uint16_t* out,
                        absl::Span<const int32_t> segments, int64_t k_dim, int64_t n,
                        bool residual) {
    int64_t row = 0;
    for (int32_t m : segments) {
      RETURN_IF_ERROR(gemm->MatMulBf16(in + row * k_dim, Bf16(w), out + row * n, m, n, k_dim,
                                       residual ? 1.0f : 0.0f));
      row += m;
    }
    return absl::OkStatus();
  }

  // `kv_only`: the layer's KV (cache update and hook) and attention, not what follows it.
  absl::Status RunLayer(Layer& layer, int64_t rows, absl::Span<const int32_t> segments,
                        bool kv_only) {
    const int64_t hid = hidden(), kvw = kv(), width = hid + 2 * kvw;
    const int64_t inter = config.intermediate_size;
    RETURN_IF_ERROR(internal::LaunchRmsNorm(Bf16(x), Bf16(layer.attn_norm), rows, hid, kRmsEps,
                                            Bf16(h), s()));
    RETURN_IF_ERROR(Products(Bf16(h), layer.wqkv, Bf16(qkv), segments, hid, width, false));
    // q and k heads are adjacent at the start of each row: rotate them together.
    RETURN_IF_ERROR(internal::LaunchRotary(Bf16(qkv), rows, width,
                                           config.num_heads + config.num_kv_heads,
                                           config.head_size, positions.data_as<int32_t>(),
                                           config.rope_theta, s()));
    const cudaStream_t cs = static_cast<cudaStream_t>(s());
    RETURN_IF_ERROR(Cuda(cudaMemcpy2DAsync(q.data(), hid * 2, qkv.data(), width * 2, hid * 2,
                                           rows, cudaMemcpyDeviceToDevice, cs),
                         "CudaModel: split q"));
    RETURN_IF_ERROR(Cuda(cudaMemcpy2DAsync(k.data(), kvw * 2, Bf16(qkv) + hid, width * 2,
                                           kvw * 2, rows, cudaMemcpyDeviceToDevice, cs),
                         "CudaModel: split k"));
    RETURN_IF_ERROR(Cuda(cudaMemcpy2DAsync(v.data(), kvw * 2, Bf16(qkv) + hid + kvw, width * 2,
                                           kvw * 2, rows, cudaMemcpyDeviceToDevice, cs),
                         "CudaModel: split v"));
    // Attention on its backend's stream, between the model's work before and after.
    RETURN_IF_ERROR(layer.inputs_ready.Record(s()));
    RETURN_IF_ERROR(layer.inputs_ready.MakeStreamWait(layer.attention_stream));
    TensorView tq(q.data(), DType::kBFloat16, {rows, hid}, MemoryKind::kDevice);
    TensorView tk(k.data(), DType::kBFloat16, {rows, kvw}, MemoryKind::kDevice);
    TensorView tv(v.data(), DType::kBFloat16, {rows, kvw}, MemoryKind::kDevice);
    TensorView to(attn.data(), DType::kBFloat16, {rows, hid}, MemoryKind::kDevice);
    RETURN_IF_ERROR(layer.attention->Forward(tq, tk, tv, to));
    RETURN_IF_ERROR(layer.output_ready.Record(layer.attention_stream));
    RETURN_IF_ERROR(layer.output_ready.MakeStreamWait(s()));
    if (kv_only) return absl::OkStatus();
    RETURN_IF_ERROR(Products(Bf16(attn), layer.wo, Bf16(x), segments, hid, hid, true));
    RETURN_IF_ERROR(internal::LaunchRmsNorm(Bf16(x), Bf16(layer.mlp_norm), rows, hid, kRmsEps,
                                            Bf16(h), s()));
    RETURN_IF_ERROR(Products(Bf16(h), layer.w_gate_up, Bf16(gate_up), segments, hid, 2 * inter,
                             false));
    RETURN_IF_ERROR(internal::LaunchSiluMul(Bf16(gate_up), rows, inter, Bf16(act), s()));
    return Products(Bf16(act), layer.w_down, Bf16(x), segments, inter, hid, true);
  }
};

CudaModel::CudaModel(std::unique_ptr<State> state) : state_(std::move(state)) {}

CudaModel::~CudaModel() {
  // Work still enqueued reads the buffers about to be freed.
  if (state_ != nullptr) (void)state_->stream.Synchronize(absl::Seconds(30));
}

const ToyModelConfig& CudaModel::config() const { return state_->config; }
const LayerRange& CudaModel::layers() const { return state_->range; }

KvCache* CudaModel::cache(int layer) const {
  return state_->range.Contains(layer) ? state_->caches[layer - state_->range.begin].get()
                                       : nullptr;
}

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::Create(const ToyModelConfig& config,
                                                             int64_t num_blocks,
                                                             LayerRegistry* registry,
                                                             const Allocator& allocate,
                                                             std::optional<LayerRange> layers) {
  RETURN_IF_ERROR(CudaAvailability());
  if (config.vocab_size <= 1 || config.num_layers <= 0 || config.intermediate_size <= 0 ||
      config.num_heads <= 0 || config.num_kv_heads <= 0 || config.head_size <= 0 ||
      !(config.rope_theta > 1) || num_blocks <= 0 || registry == nullptr) {
    return absl::InvalidArgumentError(
        "CUDA model: vocab, layers, heads, head size, intermediate size and blocks must be "
        "positive, RoPE theta above 1, and a registry given");
  }
  if (config.hidden_size() % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA model: hidden size ",
                                                   config.hidden_size(),
                                                   " must be a multiple of 8"));
  }
  const LayerRange range = layers.value_or(LayerRange{0, config.num_layers});
  if (range.begin < 0 || range.end > config.num_layers || range.size() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA model: layers ", FormatLayerRange(range),
                                                   " are not a range of its ",
                                                   config.num_layers, " layers"));
  }
  auto st = std::make_unique<State>();
  st->config = config;
  st->range = range;
  st->registry = registry;
  ASSIGN_OR_RETURN(st->stream, CudaStream::Create());
  ASSIGN_OR_RETURN(internal::CublasGemm gemm, internal::CublasGemm::Create(st->s()));
  st->gemm.emplace(std::move(gemm));
  ASSIGN_OR_RETURN(KvLayout layout, ParseKvLayout(config.layout));
  const int64_t hidden = config.hidden_size();
  const int64_t kv = static_cast<int64_t>(config.num_kv_heads) * config.head_size;
  const int64_t inter = config.intermediate_size;
  const uint32_t seed = config.seed;
  void* s = st->s();
  for (int l = range.begin; l < range.end; ++l) {
    State::Layer w;
    using internal::LayerTensor;
    ASSIGN_OR_RETURN(w.attn_norm, NormWeight(seed, LayerTensor(l, internal::kAttnNorm), hidden, s));
    ASSIGN_OR_RETURN(w.mlp_norm, NormWeight(seed, LayerTensor(l, internal::kMlpNorm), hidden, s));
    ASSIGN_OR_RETURN(w.wqkv, Matrix(seed, LayerTensor(l, internal::kQkv), hidden, hidden + 2 * kv, s));
    ASSIGN_OR_RETURN(w.wo, Matrix(seed, LayerTensor(l, internal::kOutProj), hidden, hidden, s));
    ASSIGN_OR_RETURN(w.w_gate_up, Matrix(seed, LayerTensor(l, internal::kGateUp), hidden, 2 * inter, s));
    ASSIGN_OR_RETURN(w.w_down, Matrix(seed, LayerTensor(l, internal::kDown), inter, hidden, s));
    ASSIGN_OR_RETURN(w.inputs_ready, CudaEvent::Create());
    ASSIGN_OR_RETURN(w.output_ready, CudaEvent::Create());

    AttentionOptions o = internal::LayerAttentionOptions(config, l, DType::kBFloat16);
    o.backend = "cuda";
    o.batch_invariant = true;  // the model's rows must not depend on their batch
    ASSIGN_OR_RETURN(w.attention, Attention::Create(o, registry));
    CudaAttentionBackend* backend = AsCudaAttentionBackend(&w.attention->backend());
    if (backend == nullptr) return absl::InternalError("CUDA model: the layer's backend is not CUDA");
    w.attention_stream = backend->stream();

    ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache,
                     internal::CreateLayerCache(w.attention->kv_cache_spec(), layout, num_blocks,
                                                MemoryKind::kDevice, allocate, st->cache_memory));
    RETURN_IF_ERROR(registry->BindKvCache(o.prefix, cache.get()));
    st->layers.push_back(std::move(w));
    st->caches.push_back(std::move(cache));
  }
  if (range.begin == 0) {
    ASSIGN_OR_RETURN(st->embedding,
                     Matrix(seed, internal::kEmbeddingTensor, config.vocab_size, hidden, s));
  }
  if (range.end == config.num_layers) {
    ASSIGN_OR_RETURN(st->final_norm, NormWeight(seed, internal::kFinalNormTensor, hidden, s));
    ASSIGN_OR_RETURN(st->lm_head,
                     Matrix(seed, internal::kHeadTensor, hidden, config.vocab_size, s));
  }
  RETURN_IF_ERROR(st->stream.Synchronize(absl::Minutes(5)));
  return std::unique_ptr<CudaModel>(new CudaModel(std::move(st)));
}

absl::StatusOr<std::vector<float>> CudaModel::Forward(absl::Span<const int32_t> tokens,
                                                      absl::Span<const int32_t> positions,
                                                      absl::Span<const int32_t> segments,
                                                      absl::Span<const int64_t> logit_rows,
                                                      absl::Duration timeout) {
  State& st = *state_;
  const ToyModelConfig& c = st.config;
  if (st.range.begin != 0 || st.range.end != c.num_layers) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA model: Forward needs every layer; this one has ", FormatLayerRange(st.range)));
  }
  const ForwardContext context = st.registry->forward_context();
  if (context.metadata == nullptr) {
    return absl::FailedPreconditionError("CUDA model: no forward context (metadata) is set");
  }
  const AttentionMetadata& md = *context.metadata;
  const int64_t rows = static_cast<int64_t>(tokens.size());
  if (rows == 0 || positions.size() != tokens.size() || md.num_actual_tokens != rows ||
      md.slot_mapping.size() != tokens.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA model: ", rows, " tokens, ", positions.size(), " positions and metadata of ",
        md.num_actual_tokens, " rows (", md.slot_mapping.size(), " slots) must agree"));
  }
  for (int32_t t : tokens) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("token ", t, " outside the vocabulary"));
    }
  }
  int64_t covered = 0;
  for (int32_t n : segments) {
    if (n <= 0) return absl::InvalidArgumentError("CUDA model: empty segment");
    covered += n;
  }
  if (covered != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA model: segments cover ", covered, " rows of ", rows));
  }
  for (int64_t r : logit_rows) {
    if (r < 0 || r >= rows) {
      return absl::InvalidArgumentError(absl::StrCat("CUDA model: logit row ", r, " of ", rows));
    }
  }
  const size_t hid = static_cast<size_t>(st.hidden());
  const size_t kvw = static_cast<size_t>(st.kv());
  const size_t inter = static_cast<size_t>(c.intermediate_size);
  const size_t n = static_cast<size_t>(rows);
  void* s = st.s();
  RETURN_IF_ERROR(Reserve(st.x, n * hid * 2));
  RETURN_IF_ERROR(Reserve(st.h, n * hid * 2));
  RETURN_IF_ERROR(Reserve(st.qkv, n * (hid + 2 * kvw) * 2));
  RETURN_IF_ERROR(Reserve(st.q, n * hid * 2));
  RETURN_IF_ERROR(Reserve(st.k, n * kvw * 2));
  RETURN_IF_ERROR(Reserve(st.v, n * kvw * 2));
  RETURN_IF_ERROR(Reserve(st.attn, n * hid * 2));
  RETURN_IF_ERROR(Reserve(st.gate_up, n * 2 * inter * 2));
  RETURN_IF_ERROR(Reserve(st.act, n * inter * 2));
  const size_t out_rows = std::max<size_t>(1, logit_rows.size());
  RETURN_IF_ERROR(Reserve(st.last, out_rows * hid * 2));
  RETURN_IF_ERROR(Reserve(st.logits, out_rows * static_cast<size_t>(c.vocab_size) * 4));
  RETURN_IF_ERROR(Upload(st.tokens, tokens, s));
  RETURN_IF_ERROR(Upload(st.positions, positions, s));
  RETURN_IF_ERROR(Upload(st.query_start, absl::MakeConstSpan(md.query_start_loc), s));
  RETURN_IF_ERROR(Upload(st.seq_lens, absl::MakeConstSpan(md.seq_lens), s));
  RETURN_IF_ERROR(Upload(st.block_table, absl::MakeConstSpan(md.block_table), s));
  RETURN_IF_ERROR(Upload(st.slots, absl::MakeConstSpan(md.slot_mapping), s));

  DeviceAttentionMetadata device;
  device.query_start_loc = st.query_start.data_as<int32_t>();
  device.seq_lens = st.seq_lens.data_as<int32_t>();
  device.block_table = st.block_table.data_as<int32_t>();
  device.slot_mapping = st.slots.data_as<int64_t>();
  ForwardContext with_device = context;
  with_device.device = &device;
  st.registry->SetForwardContext(with_device);
  absl::Status status = internal::LaunchEmbed(Bf16(st.embedding), c.vocab_size,
                                              static_cast<int64_t>(hid),
                                              st.tokens.data_as<int32_t>(), rows, Bf16(st.x), s);
  for (size_t i = 0; status.ok() && i < st.layers.size(); ++i) {
    const bool kv_only = logit_rows.empty() && i + 1 == st.layers.size();
    status = st.RunLayer(st.layers[i], rows, segments, kv_only);
  }
  st.registry->SetForwardContext(context);
  RETURN_IF_ERROR(status);

  // The requested rows, each normalised and projected on its own (one product per row).
  const cudaStream_t cs = static_cast<cudaStream_t>(s);
  for (size_t i = 0; i < logit_rows.size(); ++i) {
    RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(Bf16(st.last) + i * hid,
                                         Bf16(st.x) + static_cast<size_t>(logit_rows[i]) * hid,
                                         hid * 2, cudaMemcpyDeviceToDevice, cs),
                         "CUDA model: gathering a logit row"));
  }
  const int64_t m = static_cast<int64_t>(logit_rows.size());
  std::vector<float> logits(logit_rows.size() * static_cast<size_t>(c.vocab_size));
  if (m > 0) {
    RETURN_IF_ERROR(internal::LaunchRmsNorm(Bf16(st.last), Bf16(st.final_norm), m,
                                            static_cast<int64_t>(hid), kRmsEps, Bf16(st.last), s));
    for (int64_t i = 0; i < m; ++i) {
      RETURN_IF_ERROR(st.gemm->MatMulBf16ToF32(
          Bf16(st.last) + static_cast<size_t>(i) * hid, Bf16(st.lm_head),
          st.logits.data_as<float>() + static_cast<size_t>(i) * c.vocab_size, 1, c.vocab_size,
          static_cast<int64_t>(hid)));
    }
    RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(logits.data(), st.logits.data(), logits.size() * 4,
                                         cudaMemcpyDeviceToHost, cs),
                         "CUDA model: logits to the host"));
  }
  RETURN_IF_ERROR(st.stream.Synchronize(timeout));
  return logits;
}

}  // namespace kvstream
