// The synthetic model of toy_model.h.
#include "toy_model.h"

#include <cmath>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

std::vector<float> RandomMatrix(std::mt19937& rng, int rows, int cols) {
  std::normal_distribution<float> dist(0.0f, 1.0f / std::sqrt(static_cast<float>(rows)));
  std::vector<float> m(static_cast<size_t>(rows) * cols);
  for (float& x : m) x = dist(rng);
  return m;
}

// out[r] = in[r] * w, in [rows, k], w [k, n]; accumulation order fixed per row.
void MatMul(const float* in, const std::vector<float>& w, int rows, int k, int n, float* out) {
  for (int r = 0; r < rows; ++r) {
    float* o = out + static_cast<size_t>(r) * n;
    for (int j = 0; j < n; ++j) o[j] = 0.0f;
    const float* x = in + static_cast<size_t>(r) * k;
    for (int i = 0; i < k; ++i) {
      const float xi = x[i];
      const float* wr = w.data() + static_cast<size_t>(i) * n;
      for (int j = 0; j < n; ++j) o[j] += xi * wr[j];
    }
  }
}

// Rotary embedding (GPT-NeoX style: element i pairs with i + half) of every head of `x`
// ([rows, heads * head_size]) at the rows' positions.
void Rope(float* x, int rows, int heads, int head_size, absl::Span<const int32_t> positions) {
  const int half = head_size / 2;
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < half; ++i) {
      const double inv_freq = std::pow(10000.0, -2.0 * i / head_size);
      const double angle = positions[r] * inv_freq;
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

void RmsNorm(const float* in, int rows, int n, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* x = in + static_cast<size_t>(r) * n;
    float ss = 0.0f;
    for (int j = 0; j < n; ++j) ss += x[j] * x[j];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + 1e-6f);
    for (int j = 0; j < n; ++j) out[static_cast<size_t>(r) * n + j] = x[j] * inv;
  }
}

}  // namespace

std::string ToyModelConfig::LayerName(int layer) const {
  return absl::StrCat("model.layers.", layer, ".self_attn.attn");
}

absl::StatusOr<std::unique_ptr<ToyModel>> ToyModel::Create(const ToyModelConfig& config,
                                                           int64_t num_blocks,
                                                           LayerRegistry* registry,
                                                           const Allocator& allocate) {
  if (config.vocab_size <= 1 || config.num_layers <= 0 || config.intermediate_size <= 0) {
    return absl::InvalidArgumentError("toy model: vocab, layers and intermediate size must be positive");
  }
  std::unique_ptr<ToyModel> m(new ToyModel());
  m->config_ = config;
  m->registry_ = registry;
  ASSIGN_OR_RETURN(KvLayout layout, ParseKvLayout(config.layout));
  std::mt19937 rng(config.seed);
  const int hidden = config.hidden_size();
  m->embedding_ = RandomMatrix(rng, config.vocab_size, hidden);
  for (int l = 0; l < config.num_layers; ++l) {
    AttentionOptions o;
    o.num_heads = config.num_heads;
    o.num_kv_heads = config.num_kv_heads;
    o.head_size = config.head_size;
    o.scale = 1.0f / std::sqrt(static_cast<float>(config.head_size));
    o.kv_cache_dtype = config.kv_cache_dtype;
    o.dtype = DType::kFloat32;
    o.block_size = config.block_size;
    o.backend = config.backend;
    o.prefix = config.LayerName(l);
    ASSIGN_OR_RETURN(auto layer, Attention::Create(o, registry));
    std::unique_ptr<KvCache> cache;
    if (allocate) {
      // K then V in one allocation, dense in `layout`.
      const KvCacheSpec& spec = layer->kv_cache_spec();
      const size_t k_bytes = static_cast<size_t>(num_blocks) * spec.KBytesPerBlock();
      const size_t v_off = (k_bytes + 63) / 64 * 64;
      const size_t v_bytes = static_cast<size_t>(num_blocks) * spec.VBytesPerBlock();
      ASSIGN_OR_RETURN(std::shared_ptr<void> memory, allocate(v_off + v_bytes));
      char* base = static_cast<char*>(memory.get());
      const CacheStrides ks = MakeCacheStrides(spec, layout, false);
      const CacheStrides vs = MakeCacheStrides(spec, layout, true);
      TensorView k(base, spec.dtype, {num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size},
                   {ks.block, ks.token, ks.head, ks.dim});
      TensorView v(base + v_off, spec.dtype,
                   {num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size_v},
                   {vs.block, vs.token, vs.head, vs.dim});
      ASSIGN_OR_RETURN(cache, KvCache::Borrow(spec, k, v));
      m->cache_memory_.push_back(std::move(memory));
    } else {
      ASSIGN_OR_RETURN(cache, KvCache::Create({layer->kv_cache_spec(), layout, num_blocks}));
    }
    if (IsFp8(cache->spec().dtype)) {
      const size_t n = cache->spec().quant_mode == KvQuantMode::kPerHead
                           ? static_cast<size_t>(config.num_kv_heads)
                           : 1u;
      std::vector<float> scales(n, 0.05f);
      RETURN_IF_ERROR(cache->SetScales(scales, scales));
    }
    RETURN_IF_ERROR(registry->BindKvCache(o.prefix, cache.get()));
    LayerWeights w;
    const int kv = config.num_kv_heads * config.head_size;
    w.wq = RandomMatrix(rng, hidden, hidden);
    w.wk = RandomMatrix(rng, hidden, kv);
    w.wv = RandomMatrix(rng, hidden, kv);
    w.wo = RandomMatrix(rng, hidden, hidden);
    w.w_up = RandomMatrix(rng, hidden, config.intermediate_size);
    w.w_down = RandomMatrix(rng, config.intermediate_size, hidden);
    m->weights_.push_back(std::move(w));
    m->layers_.push_back(std::move(layer));
    m->caches_.push_back(std::move(cache));
  }
  return m;
}

absl::StatusOr<std::vector<float>> ToyModel::Forward(absl::Span<const int32_t> tokens,
                                                     absl::Span<const int32_t> positions,
                                                     absl::Span<const int64_t> logit_rows) {
  const int rows = static_cast<int>(tokens.size());
  if (positions.size() != tokens.size()) {
    return absl::InvalidArgumentError("toy model: one position per token");
  }
  const int hidden = config_.hidden_size();
  const int kv = config_.num_kv_heads * config_.head_size;
  const int inter = config_.intermediate_size;
  std::vector<float> x(static_cast<size_t>(rows) * hidden), h(x.size()), q(x.size()), o(x.size());
  std::vector<float> k(static_cast<size_t>(rows) * kv), v(k.size());
  std::vector<float> up(static_cast<size_t>(rows) * inter);
  for (int r = 0; r < rows; ++r) {
    if (tokens[r] < 0 || tokens[r] >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("token ", tokens[r], " outside the vocabulary"));
    }
    std::copy_n(embedding_.data() + static_cast<size_t>(tokens[r]) * hidden, hidden,
                x.data() + static_cast<size_t>(r) * hidden);
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerWeights& w = weights_[l];
    RmsNorm(x.data(), rows, hidden, h.data());
    MatMul(h.data(), w.wq, rows, hidden, hidden, q.data());
    MatMul(h.data(), w.wk, rows, hidden, kv, k.data());
    MatMul(h.data(), w.wv, rows, hidden, kv, v.data());
    Rope(q.data(), rows, config_.num_heads, config_.head_size, positions);
    Rope(k.data(), rows, config_.num_kv_heads, config_.head_size, positions);
    TensorView qv(q.data(), DType::kFloat32, {rows, hidden});
    TensorView kvw(k.data(), DType::kFloat32, {rows, kv});
    TensorView vv(v.data(), DType::kFloat32, {rows, kv});
    TensorView ov(o.data(), DType::kFloat32, {rows, hidden});
    RETURN_IF_ERROR(layers_[l]->Forward(qv, kvw, vv, ov));
    MatMul(o.data(), w.wo, rows, hidden, hidden, h.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += h[i];
    RmsNorm(x.data(), rows, hidden, h.data());
    MatMul(h.data(), w.w_up, rows, hidden, inter, up.data());
    for (float& u : up) u = u > 0.0f ? u : 0.0f;
    MatMul(up.data(), w.w_down, rows, inter, hidden, h.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += h[i];
  }
  std::vector<float> logits(logit_rows.size() * static_cast<size_t>(config_.vocab_size));
  std::vector<float> normed(hidden);
  for (size_t i = 0; i < logit_rows.size(); ++i) {
    const int64_t r = logit_rows[i];
    if (r < 0 || r >= rows) return absl::InvalidArgumentError("logit row out of range");
    RmsNorm(x.data() + static_cast<size_t>(r) * hidden, 1, hidden, normed.data());
    for (int t = 0; t < config_.vocab_size; ++t) {
      const float* e = embedding_.data() + static_cast<size_t>(t) * hidden;
      float s = 0.0f;
      for (int j = 0; j < hidden; ++j) s += normed[j] * e[j];
      logits[i * config_.vocab_size + t] = s;
    }
  }
  return logits;
}

int32_t Argmax(absl::Span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

}  // namespace kvstream
