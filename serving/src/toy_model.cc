// The synthetic model of toy_model.h.
#include "kvstream/serving/toy_model.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvstream/common/status_macros.h"
#include "layer_cache.h"
#include "random_weights.h"

namespace kvstream {
namespace {

// Weights are counter-based random numbers (random_weights.h): element i of tensor t is a
// function of (seed, t, i) alone, so any layer range can be built on its own with the
// weights of the whole model, and a big tensor can be filled by several threads (the 8B
// preset has 7 billion weights).
using internal::kEmbeddingTensor;
using internal::kFinalNormTensor;
using internal::kHeadTensor;
using internal::LayerTensor;

// `n` numbers of mean `mean` and standard deviation `stddev` (random_weights.h).
std::vector<float> RandomTensor(uint32_t seed, uint64_t tensor, int64_t n, float mean,
                                float stddev) {
  std::vector<float> out(static_cast<size_t>(n));
  const uint64_t base = internal::RandomTensorBase(seed, tensor);
  auto fill = [&](int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i) {
      out[static_cast<size_t>(i)] =
          internal::RandomTensorElement(base, static_cast<uint64_t>(i), mean, stddev);
    }
  };
  const int64_t threads = std::min<int64_t>(
      std::max(1u, std::thread::hardware_concurrency()), std::max<int64_t>(1, n >> 20));
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) {
    pool.emplace_back(fill, n * t / threads, n * (t + 1) / threads);
  }
  fill(0, n / threads);
  for (std::thread& t : pool) t.join();
  return out;
}

std::vector<float> RandomMatrix(uint32_t seed, uint64_t tensor, int64_t rows, int64_t cols) {
  return RandomTensor(seed, tensor, rows * cols, 0.0f,
                      1.0f / std::sqrt(static_cast<float>(rows)));
}

std::vector<float> RandomNormWeight(uint32_t seed, uint64_t tensor, int n) {
  return RandomTensor(seed, tensor, n, internal::kNormWeightMean, internal::kNormWeightStddev);
}

// out = in * w for each segment of rows on its own: in [rows, k], w [k, n], out [rows, n].
void MatMul(const float* in, const std::vector<float>& w, absl::Span<const int32_t> segments,
            int k, int n, float* out) {
  size_t row = 0;
  for (int32_t m : segments) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, in + row * k, k,
                w.data(), n, 0.0f, out + row * n, n);
    row += static_cast<size_t>(m);
  }
}

// Rotary embedding (GPT-NeoX style: element i pairs with i + half) of every head of `x`
// ([rows, heads * head_size]) at the rows' positions.
void Rope(float* x, int rows, int heads, int head_size, double theta,
          absl::Span<const int32_t> positions) {
  const int half = head_size / 2;
  std::vector<double> inv_freq(half);
  for (int i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -2.0 * i / head_size);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < half; ++i) {
      const double angle = positions[r] * inv_freq[i];
      const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
      for (int h = 0; h < heads; ++h) {
        float* v = x + (static_cast<size_t>(r) * heads + h) * head_size;
        const float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = a * s + b * c;
      }
    }
  }
}

void RmsNorm(const float* in, int rows, int n, const std::vector<float>& weight, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* x = in + static_cast<size_t>(r) * n;
    float ss = 0.0f;
    for (int j = 0; j < n; ++j) ss += x[j] * x[j];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + 1e-6f);
    float* o = out + static_cast<size_t>(r) * n;
    for (int j = 0; j < n; ++j) o[j] = x[j] * inv * weight[j];
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<ToyModel>> ToyModel::Create(const ToyModelConfig& config,
                                                           int64_t num_blocks,
                                                           LayerRegistry* registry,
                                                           const Allocator& allocate,
                                                           std::optional<LayerRange> layers) {
  if (config.vocab_size <= 1 || config.num_layers <= 0 || config.intermediate_size <= 0 ||
      config.blas_threads <= 0 || !(config.rope_theta > 1)) {
    return absl::InvalidArgumentError(
        "toy model: vocab, layers, intermediate size and BLAS threads must be positive and "
        "RoPE theta above 1");
  }
  const LayerRange range = layers.value_or(LayerRange{0, config.num_layers});
  if (range.begin < 0 || range.end > config.num_layers || range.size() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("toy model: layers ", FormatLayerRange(range),
                                                   " are not a range of its ",
                                                   config.num_layers, " layers"));
  }
  std::unique_ptr<ToyModel> m(new ToyModel());
  m->config_ = config;
  m->range_ = range;
  m->registry_ = registry;
  openblas_set_num_threads(config.blas_threads);
  ASSIGN_OR_RETURN(KvLayout layout, ParseKvLayout(config.layout));
  const int hidden = config.hidden_size();
  const int kv = config.num_kv_heads * config.head_size;
  const int inter = config.intermediate_size;

  const uint32_t seed = config.seed;
  for (int l = range.begin; l < range.end; ++l) {
    LayerWeights w;
    w.attn_norm = RandomNormWeight(seed, LayerTensor(l, internal::kAttnNorm), hidden);
    w.mlp_norm = RandomNormWeight(seed, LayerTensor(l, internal::kMlpNorm), hidden);
    w.wqkv = RandomMatrix(seed, LayerTensor(l, internal::kQkv), hidden, hidden + 2 * kv);
    w.wo = RandomMatrix(seed, LayerTensor(l, internal::kOutProj), hidden, hidden);
    w.w_gate_up = RandomMatrix(seed, LayerTensor(l, internal::kGateUp), hidden, 2 * inter);
    w.w_down = RandomMatrix(seed, LayerTensor(l, internal::kDown), inter, hidden);
    m->weights_.push_back(std::move(w));
  }
  if (range.begin == 0) {
    m->embedding_ = RandomMatrix(seed, kEmbeddingTensor, config.vocab_size, hidden);
  }
  if (range.end == config.num_layers) {
    m->final_norm_ = RandomNormWeight(seed, kFinalNormTensor, hidden);
    m->lm_head_ = RandomMatrix(seed, kHeadTensor, hidden, config.vocab_size);
  }

  for (int l = range.begin; l < range.end; ++l) {
    const AttentionOptions o = internal::LayerAttentionOptions(config, l, DType::kFloat32);
    ASSIGN_OR_RETURN(auto layer, Attention::Create(o, registry));
    ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache,
                     internal::CreateLayerCache(layer->kv_cache_spec(), layout, num_blocks,
                                                MemoryKind::kHost, allocate, m->cache_memory_));
    RETURN_IF_ERROR(registry->BindKvCache(o.prefix, cache.get()));
    m->attention_.push_back(std::move(layer));
    m->caches_.push_back(std::move(cache));
  }
  return m;
}

KvCache* ToyModel::cache(int layer) const {
  return range_.Contains(layer) ? caches_[layer - range_.begin].get() : nullptr;
}

absl::StatusOr<std::vector<float>> ToyModel::Embed(absl::Span<const int32_t> tokens) const {
  if (embedding_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("toy model: layers ",
                                                      FormatLayerRange(range_),
                                                      " have no embedding (not the first stage)"));
  }
  const int hidden = config_.hidden_size();
  std::vector<float> x(tokens.size() * static_cast<size_t>(hidden));
  for (size_t r = 0; r < tokens.size(); ++r) {
    if (tokens[r] < 0 || tokens[r] >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("token ", tokens[r], " outside the vocabulary"));
    }
    std::copy_n(embedding_.data() + static_cast<size_t>(tokens[r]) * hidden, hidden,
                x.data() + r * hidden);
  }
  return x;
}

absl::Status ToyModel::RunLayers(std::vector<float>& x, absl::Span<const int32_t> positions,
                                 absl::Span<const int32_t> segments) {
  const int rows = static_cast<int>(positions.size());
  const int hidden = config_.hidden_size();
  const int kv = config_.num_kv_heads * config_.head_size;
  const int inter = config_.intermediate_size;
  const int qkv_width = hidden + 2 * kv;
  if (x.size() != static_cast<size_t>(rows) * hidden) {
    return absl::InvalidArgumentError(absl::StrCat("toy model: ", x.size(),
                                                   " hidden values for ", rows, " rows of ",
                                                   hidden));
  }
  int64_t covered = 0;
  for (int32_t s : segments) {
    if (s <= 0) return absl::InvalidArgumentError("toy model: empty segment");
    covered += s;
  }
  if (covered != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("toy model: segments cover ", covered, " rows of ", rows));
  }
  std::vector<float> h(x.size()), o(x.size());
  std::vector<float> qkv(static_cast<size_t>(rows) * qkv_width);
  std::vector<float> q(x.size()), k(static_cast<size_t>(rows) * kv), v(k.size());
  std::vector<float> gate_up(static_cast<size_t>(rows) * 2 * inter);
  std::vector<float> act(static_cast<size_t>(rows) * inter);
  for (size_t i = 0; i < weights_.size(); ++i) {
    const LayerWeights& w = weights_[i];
    RmsNorm(x.data(), rows, hidden, w.attn_norm, h.data());
    MatMul(h.data(), w.wqkv, segments, hidden, qkv_width, qkv.data());
    for (int r = 0; r < rows; ++r) {
      const float* src = qkv.data() + static_cast<size_t>(r) * qkv_width;
      std::copy_n(src, hidden, q.data() + static_cast<size_t>(r) * hidden);
      std::copy_n(src + hidden, kv, k.data() + static_cast<size_t>(r) * kv);
      std::copy_n(src + hidden + kv, kv, v.data() + static_cast<size_t>(r) * kv);
    }
    Rope(q.data(), rows, config_.num_heads, config_.head_size, config_.rope_theta, positions);
    Rope(k.data(), rows, config_.num_kv_heads, config_.head_size, config_.rope_theta, positions);
    TensorView qv(q.data(), DType::kFloat32, {rows, hidden});
    TensorView kvw(k.data(), DType::kFloat32, {rows, kv});
    TensorView vv(v.data(), DType::kFloat32, {rows, kv});
    TensorView ov(o.data(), DType::kFloat32, {rows, hidden});
    RETURN_IF_ERROR(attention_[i]->Forward(qv, kvw, vv, ov));
    MatMul(o.data(), w.wo, segments, hidden, hidden, h.data());
    for (size_t j = 0; j < x.size(); ++j) x[j] += h[j];
    RmsNorm(x.data(), rows, hidden, w.mlp_norm, h.data());
    MatMul(h.data(), w.w_gate_up, segments, hidden, 2 * inter, gate_up.data());
    for (int r = 0; r < rows; ++r) {
      const float* g = gate_up.data() + static_cast<size_t>(r) * 2 * inter;
      const float* u = g + inter;
      float* a = act.data() + static_cast<size_t>(r) * inter;
      for (int j = 0; j < inter; ++j) a[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];  // SiLU
    }
    MatMul(act.data(), w.w_down, segments, inter, hidden, h.data());
    for (size_t j = 0; j < x.size(); ++j) x[j] += h[j];
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> ToyModel::Logits(absl::Span<const float> x,
                                                    absl::Span<const int64_t> rows) const {
  if (lm_head_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("toy model: layers ",
                                                      FormatLayerRange(range_),
                                                      " have no LM head (not the last stage)"));
  }
  const int hidden = config_.hidden_size();
  const int vocab = config_.vocab_size;
  const int64_t num_rows = static_cast<int64_t>(x.size() / hidden);
  std::vector<float> logits(rows.size() * static_cast<size_t>(vocab));
  std::vector<float> normed(hidden);
  const int32_t one_row[] = {1};
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || rows[i] >= num_rows) {
      return absl::InvalidArgumentError(absl::StrCat("logit row ", rows[i], " out of range"));
    }
    RmsNorm(x.data() + static_cast<size_t>(rows[i]) * hidden, 1, hidden, final_norm_,
            normed.data());
    MatMul(normed.data(), lm_head_, one_row, hidden, vocab, logits.data() + i * vocab);
  }
  return logits;
}

absl::StatusOr<std::vector<float>> ToyModel::Forward(absl::Span<const int32_t> tokens,
                                                     absl::Span<const int32_t> positions,
                                                     absl::Span<const int32_t> segments,
                                                     absl::Span<const int64_t> logit_rows) {
  if (positions.size() != tokens.size()) {
    return absl::InvalidArgumentError("toy model: one position per token");
  }
  ASSIGN_OR_RETURN(std::vector<float> x, Embed(tokens));
  RETURN_IF_ERROR(RunLayers(x, positions, segments));
  return Logits(x, logit_rows);
}

int32_t Argmax(absl::Span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

}  // namespace kvstream
