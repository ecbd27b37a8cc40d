// Tests of the demo model: presets and their shapes, stage models that build the same
// weights as the whole model, and rows whose results do not depend on the rest of the batch.
#include "kvstream/serving/toy_model.h"

#include <cstring>
#include <memory>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kvstream/attention/metadata.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;

TEST(ModelPresetTest, Llama3_8bShapes) {
  ToyModelConfig c;
  c.block_size = 32;
  c.seed = 7;
  ASSERT_TRUE(ApplyModelPreset("llama3-8b", c).ok());
  EXPECT_EQ(c.num_layers, 32);
  EXPECT_EQ(c.hidden_size(), 4096);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_size, 128);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.rope_theta, 500000);
  // Meta-Llama-3-8B's published parameter count (untied LM head, RMSNorm weights).
  EXPECT_EQ(c.ParameterCount(), 8030261248);
  // Settings that are not shapes stay as they were.
  EXPECT_EQ(c.block_size, 32);
  EXPECT_EQ(c.seed, 7u);
  // A smaller vocabulary (--vocab) shrinks only the embedding and the head.
  c.vocab_size = 32000;
  EXPECT_EQ(c.ParameterCount(), 8030261248 - 2LL * (128256 - 32000) * 4096);
}

TEST(ModelPresetTest, ToyIsTheDefaultAndUnknownNamesAreErrors) {
  ToyModelConfig c;
  c.num_layers = 9;
  c.vocab_size = 77;
  ASSERT_TRUE(ApplyModelPreset("toy", c).ok());
  EXPECT_EQ(c.num_layers, ToyModelConfig().num_layers);
  EXPECT_EQ(c.vocab_size, ToyModelConfig().vocab_size);
  absl::Status s = ApplyModelPreset("llama2", c);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("llama3-8b"));
  EXPECT_EQ(ModelPresetNames(), (std::vector<std::string>{"toy", "llama3-8b"}));
}

ToyModelConfig SmallConfig() {
  ToyModelConfig c;
  c.num_layers = 4;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_size = 16;
  c.intermediate_size = 96;
  c.vocab_size = 101;
  c.block_size = 4;
  c.seed = 5;
  return c;
}

std::vector<int32_t> Tokens(int n, int salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back((i * 37 + salt * 11 + 3) % 101);
  return t;
}

std::vector<int32_t> Iota(int n, int from = 0) {
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i) v.push_back(from + i);
  return v;
}

TEST(ToyModelTest, StagesBuildTheLayersOfTheWholeModel) {
  const ToyModelConfig c = SmallConfig();
  const std::vector<int32_t> tokens = Tokens(9, 1);
  const std::vector<int32_t> positions = Iota(9);
  const std::vector<int32_t> segments = {8, 1};
  auto md = BuildAttentionMetadata({{0, 9, {0, 1, 2}}}, c.block_size);
  ASSERT_TRUE(md.ok()) << md.status();

  LayerRegistry whole_registry;
  auto whole = ToyModel::Create(c, 8, &whole_registry);
  ASSERT_TRUE(whole.ok()) << whole.status();
  whole_registry.SetForwardContext({&*md});
  auto expected = (*whole)->Forward(tokens, positions, segments, {8});
  ASSERT_TRUE(expected.ok()) << expected.status();

  LayerRegistry r0, r1;
  auto first = ToyModel::Create(c, 8, &r0, nullptr, LayerRange{0, 1});
  auto second = ToyModel::Create(c, 8, &r1, nullptr, LayerRange{1, 4});
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ((*first)->cache(0) != nullptr, true);
  EXPECT_EQ((*first)->cache(1), nullptr);
  EXPECT_EQ((*second)->cache(0), nullptr);
  r0.SetForwardContext({&*md});
  r1.SetForwardContext({&*md});
  auto hidden = (*first)->Embed(tokens);
  ASSERT_TRUE(hidden.ok());
  ASSERT_TRUE((*first)->RunLayers(*hidden, positions, segments).ok());
  ASSERT_TRUE((*second)->RunLayers(*hidden, positions, segments).ok());
  auto logits = (*second)->Logits(*hidden, {8});
  ASSERT_TRUE(logits.ok()) << logits.status();
  ASSERT_EQ(logits->size(), expected->size());
  EXPECT_EQ(std::memcmp(logits->data(), expected->data(), logits->size() * sizeof(float)), 0);

  // Only the first stage embeds, only the last has the LM head.
  EXPECT_EQ((*second)->Embed(tokens).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*first)->Logits(*hidden, {0}).status().code(), absl::StatusCode::kFailedPrecondition);
  LayerRegistry r2;
  EXPECT_EQ(ToyModel::Create(c, 8, &r2, nullptr, LayerRange{2, 5}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A request's KV and logits must not depend on which other requests share its batch: this
// is what lets the decode worker continue a prompt the prefill worker computed among other
// prompts and still match a colocated run bit for bit. BLAS products do depend on the rows
// of a call, so the model computes them segment by segment.
TEST(ToyModelTest, RowsDoNotDependOnTheRestOfTheBatch) {
  const ToyModelConfig c = SmallConfig();
  const std::vector<int32_t> a = Tokens(23, 2), b = Tokens(17, 3);

  // A alone.
  LayerRegistry alone_registry;
  auto alone = ToyModel::Create(c, 16, &alone_registry);
  ASSERT_TRUE(alone.ok());
  auto md_alone = BuildAttentionMetadata({{0, 23, {0, 1, 2, 3, 4, 5}}}, c.block_size);
  ASSERT_TRUE(md_alone.ok());
  alone_registry.SetForwardContext({&*md_alone});
  auto alone_logits = (*alone)->Forward(a, Iota(23), {22, 1}, {22});
  ASSERT_TRUE(alone_logits.ok()) << alone_logits.status();

  // B then A in one batch, A in the same blocks.
  LayerRegistry batch_registry;
  auto batch = ToyModel::Create(c, 16, &batch_registry);
  ASSERT_TRUE(batch.ok());
  auto md_batch = BuildAttentionMetadata(
      {{0, 17, {10, 11, 12, 13, 14}}, {0, 23, {0, 1, 2, 3, 4, 5}}}, c.block_size);
  ASSERT_TRUE(md_batch.ok());
  batch_registry.SetForwardContext({&*md_batch});
  std::vector<int32_t> tokens = b;
  tokens.insert(tokens.end(), a.begin(), a.end());
  std::vector<int32_t> positions = Iota(17);
  for (int32_t p : Iota(23)) positions.push_back(p);
  auto batch_logits = (*batch)->Forward(tokens, positions, {16, 1, 22, 1}, {16, 39});
  ASSERT_TRUE(batch_logits.ok()) << batch_logits.status();

  ASSERT_EQ(batch_logits->size(), 2 * alone_logits->size());
  EXPECT_EQ(std::memcmp(batch_logits->data() + c.vocab_size, alone_logits->data(),
                        alone_logits->size() * sizeof(float)),
            0);
  for (int l = 0; l < c.num_layers; ++l) {
    const KvCacheView x = (*alone)->cache(l)->view(), y = (*batch)->cache(l)->view();
    const size_t bytes = 6 * x.spec.KBytesPerBlock();  // A's blocks 0-5 lead the cache
    EXPECT_EQ(std::memcmp(x.k, y.k, bytes), 0) << "K of layer " << l;
    EXPECT_EQ(std::memcmp(x.v, y.v, bytes), 0) << "V of layer " << l;
  }
}

TEST(ToyModelTest, BadSegmentsAndTokensRejected) {
  const ToyModelConfig c = SmallConfig();
  LayerRegistry registry;
  auto m = ToyModel::Create(c, 8, &registry);
  ASSERT_TRUE(m.ok());
  auto md = BuildAttentionMetadata({{0, 3, {0}}}, c.block_size);
  registry.SetForwardContext({&*md});
  EXPECT_EQ((*m)->Forward(Tokens(3, 0), Iota(3), {2}, {2}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*m)->Forward(Tokens(3, 0), Iota(3), {3, 0}, {2}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*m)->Forward({1, 2, 500}, Iota(3), {3}, {2}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*m)->Forward(Tokens(3, 0), Iota(3), {3}, {3}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstream
