// The attention example behind `kvstream demo` (see attention_example.h).
#include "attention_example.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvstream/attention/attention.h"
#include "kvstream/attention/layer_registry.h"
#include "kvstream/attention/metadata.h"
#include "kvstream/cache/block_pool.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/common/numeric.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

// One engine: a registry, its layers and their caches, on one backend.
struct Engine {
  LayerRegistry registry;
  std::vector<std::unique_ptr<Attention>> layers;
  std::vector<std::unique_ptr<KvCache>> caches;
};

absl::Status BuildEngine(const AttentionExampleOptions& o, const std::string& backend,
                         int64_t num_blocks, Engine& engine) {
  ASSIGN_OR_RETURN(DType model_dtype, ParseDType(o.model_dtype));
  ASSIGN_OR_RETURN(KvLayout layout, ParseKvLayout(o.layout));
  for (int l = 0; l < o.num_layers; ++l) {
    AttentionOptions a;
    a.num_heads = o.num_heads;
    a.num_kv_heads = o.num_kv_heads;
    a.head_size = o.head_size;
    a.scale = 1.0f / std::sqrt(static_cast<float>(o.head_size));
    a.kv_cache_dtype = o.kv_cache_dtype;
    a.dtype = model_dtype;
    a.block_size = o.block_size;
    a.backend = backend;
    a.prefix = absl::StrCat("model.layers.", l, ".self_attn.attn");
    ASSIGN_OR_RETURN(auto layer, Attention::Create(a, &engine.registry));
    ASSIGN_OR_RETURN(auto cache, KvCache::Create({layer->kv_cache_spec(), layout, num_blocks}));
    if (IsFp8(cache->spec().dtype)) {
      std::vector<float> scales(cache->spec().quant_mode == KvQuantMode::kPerHead
                                    ? static_cast<size_t>(o.num_kv_heads)
                                    : 1u,
                                0.05f);
      RETURN_IF_ERROR(cache->SetScales(scales, scales));
    }
    RETURN_IF_ERROR(engine.registry.BindKvCache(a.prefix, cache.get()));
    engine.layers.push_back(std::move(layer));
    engine.caches.push_back(std::move(cache));
  }
  return absl::OkStatus();
}

struct Request {
  int prompt_len = 0;
  int computed = 0;  // tokens already in the cache
  std::vector<int32_t> blocks;
};

Tensor RandomTensor(std::vector<int64_t> shape, DType dtype, std::mt19937& rng) {
  Tensor t = Tensor::Zeros(std::move(shape), dtype);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.SetFloat(i, dist(rng));
  return t;
}

bool CachesEqual(const KvCache& a, const KvCache& b) {
  const KvCacheView va = a.view(), vb = b.view();
  const size_t kbytes = static_cast<size_t>(va.num_blocks) * va.spec.KBytesPerBlock();
  const size_t vbytes = static_cast<size_t>(va.num_blocks) * va.spec.VBytesPerBlock();
  return std::memcmp(va.k, vb.k, kbytes) == 0 && std::memcmp(va.v, vb.v, vbytes) == 0;
}

}  // namespace

absl::Status RunAttentionExample(const AttentionExampleOptions& o, std::ostream& out) {
  // Three requests whose prompts are prefilled in chunks of at most `chunk` tokens per step,
  // then decoded: the steps mix prefill, chunked prefill and decode.
  std::vector<Request> requests(3);
  requests[0].prompt_len = 37;
  requests[1].prompt_len = 150;
  requests[2].prompt_len = 9;
  const int chunk = 64;
  const int max_len = 150 + o.decode_steps + 1;
  const int64_t blocks_per_req = (max_len + o.block_size - 1) / o.block_size;
  const int64_t num_blocks = blocks_per_req * static_cast<int64_t>(requests.size()) + 7;

  Engine fast, reference;
  RETURN_IF_ERROR(BuildEngine(o, "cpu", num_blocks, fast));
  RETURN_IF_ERROR(BuildEngine(o, "cpu_reference", num_blocks, reference));
  const KvCacheSpec& spec = fast.layers[0]->kv_cache_spec();
  out << "kvstream attention example (CPU): " << o.num_layers << " layers, " << o.num_heads
      << " query / " << o.num_kv_heads << " KV heads, head size " << o.head_size << ", block size "
      << o.block_size << ", cache " << DTypeName(spec.dtype) << " " << o.layout << ", "
      << num_blocks << " blocks per layer\n";

  // Scattered blocks: allocate from a pool after shuffling its free list by allocating and
  // freeing in a random order.
  ASSIGN_OR_RETURN(auto pool, BlockPool::Create(static_cast<int32_t>(num_blocks)));
  std::mt19937 rng(o.seed);
  {
    ASSIGN_OR_RETURN(std::vector<int32_t> all, pool->Allocate(static_cast<int32_t>(num_blocks)));
    std::shuffle(all.begin(), all.end(), rng);
    for (int32_t id : all) RETURN_IF_ERROR(pool->Free({id}));
  }
  for (Request& r : requests) {
    ASSIGN_OR_RETURN(r.blocks, pool->Allocate(static_cast<int32_t>(blocks_per_req)));
  }

  ASSIGN_OR_RETURN(DType model_dtype, ParseDType(o.model_dtype));
  double worst = 0;
  double fast_s = 0, ref_s = 0;
  int step = 0;
  for (;; ++step) {
    std::vector<SequenceSchedule> batch;
    std::string shape;
    for (Request& r : requests) {
      if (r.computed >= r.prompt_len + o.decode_steps) continue;
      const int q = r.computed < r.prompt_len ? std::min(chunk, r.prompt_len - r.computed) : 1;
      batch.push_back({r.computed, q, r.blocks});
      const char* kind = r.computed == 0 ? "prefill" : q > 1 ? "chunked-prefill" : "decode";
      absl::StrAppend(&shape, shape.empty() ? "" : " + ", kind, "(", r.computed, "+", q, ")");
    }
    if (batch.empty()) break;
    ASSIGN_OR_RETURN(AttentionMetadata md, BuildAttentionMetadata(batch, o.block_size, 3));
    const int64_t rows = static_cast<int64_t>(md.slot_mapping.size());
    fast.registry.SetForwardContext({&md});
    reference.registry.SetForwardContext({&md});
    double step_err = 0;
    for (int l = 0; l < o.num_layers; ++l) {
      Tensor q = RandomTensor({rows, o.num_heads * o.head_size}, model_dtype, rng);
      Tensor k = RandomTensor({rows, o.num_kv_heads * o.head_size}, model_dtype, rng);
      Tensor v = RandomTensor({rows, o.num_kv_heads * o.head_size}, model_dtype, rng);
      auto t0 = std::chrono::steady_clock::now();
      ASSIGN_OR_RETURN(Tensor got, fast.layers[l]->Forward(q.view(), k.view(), v.view()));
      auto t1 = std::chrono::steady_clock::now();
      ASSIGN_OR_RETURN(Tensor want, reference.layers[l]->Forward(q.view(), k.view(), v.view()));
      auto t2 = std::chrono::steady_clock::now();
      fast_s += std::chrono::duration<double>(t1 - t0).count();
      ref_s += std::chrono::duration<double>(t2 - t1).count();
      const int64_t valid = md.num_actual_tokens * o.num_heads * o.head_size;
      for (int64_t i = 0; i < valid; ++i) {
        const double g = got.GetFloat(i), w = want.GetFloat(i);
        if (!std::isfinite(g)) {
          return absl::InternalError(absl::StrCat("step ", step, " layer ", l, ": non-finite output"));
        }
        step_err = std::max(step_err, std::fabs(g - w));
      }
      if (!CachesEqual(*fast.caches[l], *reference.caches[l])) {
        return absl::InternalError(
            absl::StrCat("step ", step, " layer ", l, ": the caches of the two backends differ"));
      }
    }
    for (Request& r : requests) {
      if (r.computed >= r.prompt_len + o.decode_steps) continue;
      r.computed += r.computed < r.prompt_len ? std::min(chunk, r.prompt_len - r.computed) : 1;
    }
    worst = std::max(worst, step_err);
    out << absl::StrFormat("  step %d: %-60s %4d tokens, max |fast - reference| = %.2e\n", step,
                           shape, static_cast<int>(md.num_actual_tokens), step_err);
  }
  out << absl::StrFormat(
      "checked: %d steps x %d layers; caches bit-identical between backends; outputs within "
      "%.1e (worst %.2e); fast path %.1f ms, reference %.1f ms\n",
      step, o.num_layers, o.tolerance, worst, fast_s * 1e3, ref_s * 1e3);
  if (!(worst <= o.tolerance)) {
    return absl::InternalError(absl::StrFormat(
        "fast path and reference differ by %.3e, more than the tolerance %.1e", worst,
        o.tolerance));
  }
  return absl::OkStatus();
}

}  // namespace kvstream
