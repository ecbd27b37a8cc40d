// Uses the installed kvstream: one attention layer over a paged cache, one prefill step.
#include <cmath>
#include <cstdio>

#include "kvstream/attention/attention.h"
#include "kvstream/cache/kv_cache.h"

int main() {
  kvstream::LayerRegistry registry;
  kvstream::AttentionOptions o;
  o.num_heads = 2;
  o.head_size = 4;
  o.scale = 0.5f;
  o.dtype = kvstream::DType::kFloat32;
  o.prefix = "model.layers.0.attn";
  auto layer = kvstream::Attention::Create(o, &registry);
  if (!layer.ok()) return std::printf("%s\n", layer.status().ToString().c_str()), 1;
  auto cache = kvstream::KvCache::Create({(*layer)->kv_cache_spec(), kvstream::KvLayout::kNHD, 2});
  if (!cache.ok()) return std::printf("%s\n", cache.status().ToString().c_str()), 1;
  if (!registry.BindKvCache(o.prefix, cache->get()).ok()) return 1;
  auto md = kvstream::BuildAttentionMetadata({{0, 3, {1}}}, 16);
  if (!md.ok()) return 1;
  registry.SetForwardContext({&*md});
  kvstream::Tensor q = kvstream::Tensor::Zeros({3, 8}, kvstream::DType::kFloat32);
  kvstream::Tensor k = kvstream::Tensor::Zeros({3, 8}, kvstream::DType::kFloat32);
  kvstream::Tensor v = kvstream::Tensor::Zeros({3, 8}, kvstream::DType::kFloat32);
  for (int i = 0; i < 24; ++i) v.SetFloat(i, static_cast<float>(i / 8));  // token t's values = t
  auto out = (*layer)->Forward(q.view(), k.view(), v.view());
  if (!out.ok()) return std::printf("%s\n", out.status().ToString().c_str()), 1;
  // Zero queries: uniform attention, token t sees values 0..t -> mean t/2.
  for (int t = 0; t < 3; ++t) {
    if (std::fabs(out->GetFloat(t * 8) - t / 2.0f) > 1e-6f) return std::printf("bad output\n"), 1;
  }
  std::printf("attention ok\n");
  return 0;
}
