// Tests of LayerRegistry: names, cache bindings, KV-sharing resolution.
#include "kvstream/attention/layer_registry.h"

#include <cmath>
#include <memory>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kvstream/attention/attention.h"

namespace kvstream {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

AttentionOptions Layer(const std::string& name) {
  AttentionOptions o;
  o.num_heads = 4;
  o.num_kv_heads = 2;
  o.head_size = 8;
  o.scale = 1.0f / std::sqrt(8.0f);
  o.prefix = name;
  o.dtype = DType::kFloat32;
  return o;
}

std::unique_ptr<KvCache> CacheFor(const Attention& layer, int blocks = 4) {
  auto c = KvCache::Create({layer.kv_cache_spec(), KvLayout::kNHD, blocks});
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(c).value();
}

TEST(LayerRegistryTest, RegistersInOrderAndRejectsDuplicates) {
  LayerRegistry registry;
  auto a = Attention::Create(Layer("model.layers.0.attn"), &registry);
  auto b = Attention::Create(Layer("model.layers.1.attn"), &registry);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_THAT(registry.layer_names(), ElementsAre("model.layers.0.attn", "model.layers.1.attn"));
  auto dup = Attention::Create(Layer("model.layers.0.attn"), &registry);
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(dup.status().message(), HasSubstr("model.layers.0.attn"));
  EXPECT_EQ(*registry.Get("model.layers.1.attn"), b->get());
}

TEST(LayerRegistryTest, UnknownLayerIsNotFound) {
  LayerRegistry registry;
  auto s = registry.Get("model.layers.7.attn");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.status().message(), HasSubstr("model.layers.7.attn"));
  EXPECT_EQ(registry.BindKvCache("nope", nullptr).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.KvCacheFor("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST(LayerRegistryTest, DestroyedLayerUnregisters) {
  LayerRegistry registry;
  {
    auto a = Attention::Create(Layer("l.0"), &registry);
    ASSERT_TRUE(a.ok());
    EXPECT_TRUE(registry.Contains("l.0"));
  }
  EXPECT_FALSE(registry.Contains("l.0"));
  EXPECT_TRUE(registry.layer_names().empty());
  // The name is free again.
  EXPECT_TRUE(Attention::Create(Layer("l.0"), &registry).ok());
}

TEST(LayerRegistryTest, BindsCachesAndResolvesSharing) {
  LayerRegistry registry;
  auto a = Attention::Create(Layer("l.0"), &registry);
  AttentionOptions so = Layer("l.1");
  so.kv_sharing_target_layer_name = "l.0";
  auto b = Attention::Create(so, &registry);
  AttentionOptions so2 = Layer("l.2");
  so2.kv_sharing_target_layer_name = "l.1";  // a chain ends at l.0
  auto c = Attention::Create(so2, &registry);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok()) << b.status() << c.status();

  EXPECT_EQ(registry.KvCacheFor("l.0").status().code(), absl::StatusCode::kFailedPrecondition);
  auto cache = CacheFor(**a);
  ASSERT_TRUE(registry.BindKvCache("l.0", cache.get()).ok());
  EXPECT_EQ(*registry.KvCacheFor("l.0"), cache.get());
  EXPECT_EQ(*registry.KvCacheFor("l.1"), cache.get());
  EXPECT_EQ(*registry.KvCacheFor("l.2"), cache.get());

  // A sharing layer has no cache of its own.
  auto other = CacheFor(**a);
  absl::Status s = registry.BindKvCache("l.1", other.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("l.0"));
}

TEST(LayerRegistryTest, RejectsCacheOfAnotherShape) {
  LayerRegistry registry;
  auto a = Attention::Create(Layer("l.0"), &registry);
  ASSERT_TRUE(a.ok());
  KvCacheSpec spec = (*a)->kv_cache_spec();
  spec.head_size = 16;
  spec.head_size_v = 16;
  auto cache = KvCache::Create({spec, KvLayout::kNHD, 2});
  ASSERT_TRUE(cache.ok());
  absl::Status s = registry.BindKvCache("l.0", cache->get());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("l.0"));
  EXPECT_EQ(registry.BindKvCache("l.0", nullptr).code(), absl::StatusCode::kInvalidArgument);
}

TEST(LayerRegistryTest, RegistriesAreIndependent) {
  LayerRegistry r1, r2;
  auto a = Attention::Create(Layer("l.0"), &r1);
  auto b = Attention::Create(Layer("l.0"), &r2);  // same name, another engine
  EXPECT_TRUE(a.ok());
  EXPECT_TRUE(b.ok());
}

}  // namespace
}  // namespace kvstream
