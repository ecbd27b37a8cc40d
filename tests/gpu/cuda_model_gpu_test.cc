// GPU tests of CudaModel (serving/include/kvstream/serving/cuda_model.h): deterministic
// across instances, batch invariant (a request's logits do not depend on what shares its
// batch), and what disaggregation relies on: a decode step over KV copied from another
// model's cache gives the logits of the model that computed that KV itself, bit for bit.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "kvstream/attention/layer_registry.h"
#include "kvstream/attention/metadata.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/serving/cuda_model.h"

namespace kvstream {
namespace {

ToyModelConfig SmallConfig() {
  ToyModelConfig c;
  c.vocab_size = 1000;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_size = 128;
  c.intermediate_size = 1024;
  c.block_size = 16;
  c.seed = 11;
  return c;
}

constexpr int64_t kBlocks = 32;

std::vector<int32_t> Prompt(int n, int32_t salt) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) p[static_cast<size_t>(i)] = (i * 37 + salt * 101 + 5) % 1000;
  return p;
}

// One model with its registry.
struct Instance {
  LayerRegistry registry;
  std::unique_ptr<CudaModel> model;
};

std::unique_ptr<Instance> Make(const ToyModelConfig& c = SmallConfig()) {
  auto in = std::make_unique<Instance>();
  auto m = CudaModel::Create(c, kBlocks, &in->registry);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return nullptr;
  in->model = std::move(m).value();
  return in;
}

// A sequence of a step: its tokens this step, context already cached, blocks, and the
// segments its rows split into.
struct Seq {
  std::vector<int32_t> tokens;
  int32_t context = 0;
  std::vector<int32_t> blocks;
  std::vector<int32_t> segments;
};

// Runs one step; returns the logits of each sequence's last row (none with `logits` false).
absl::StatusOr<std::vector<float>> Step(Instance& in, const std::vector<Seq>& seqs,
                                        bool logits = true) {
  std::vector<SequenceSchedule> schedule;
  std::vector<int32_t> tokens, positions, segments;
  std::vector<int64_t> rows;
  for (const Seq& s : seqs) {
    schedule.push_back({s.context, static_cast<int32_t>(s.tokens.size()), s.blocks});
    for (size_t i = 0; i < s.tokens.size(); ++i) {
      tokens.push_back(s.tokens[i]);
      positions.push_back(s.context + static_cast<int32_t>(i));
    }
    segments.insert(segments.end(), s.segments.begin(), s.segments.end());
    if (logits) rows.push_back(static_cast<int64_t>(tokens.size()) - 1);
  }
  auto md = BuildAttentionMetadata(schedule, SmallConfig().block_size);
  if (!md.ok()) return md.status();
  in.registry.SetForwardContext({&*md});
  auto out = in.model->Forward(tokens, positions, segments, rows);
  in.registry.SetForwardContext({});
  return out;
}

std::vector<int32_t> Blocks(int32_t first, int n) {
  std::vector<int32_t> b(static_cast<size_t>(n));
  std::iota(b.begin(), b.end(), first);
  return b;
}

class CudaModelGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const absl::Status available = CudaAvailability();
    if (!available.ok()) GTEST_SKIP() << "SKIPPED: no usable GPU: " << available.message();
  }
};

TEST_F(CudaModelGpuTest, TwoInstancesGiveTheSameFiniteLogits) {
  auto a = Make();
  auto b = Make();
  ASSERT_TRUE(a && b);
  const Seq x{Prompt(40, 1), 0, Blocks(0, 3), {39, 1}};
  auto la = Step(*a, {x});
  auto lb = Step(*b, {x});
  ASSERT_TRUE(la.ok()) << la.status();
  ASSERT_TRUE(lb.ok()) << lb.status();
  ASSERT_EQ(la->size(), 1000u);
  EXPECT_EQ(*la, *lb);
  for (float v : *la) ASSERT_TRUE(std::isfinite(v));
  // Not a constant: the logits carry the prompt.
  EXPECT_NE(*std::max_element(la->begin(), la->end()), *std::min_element(la->begin(), la->end()));
  // Another seed, other weights, other logits.
  ToyModelConfig other = SmallConfig();
  other.seed = 12;
  auto c = Make(other);
  ASSERT_TRUE(c);
  auto lc = Step(*c, {x});
  ASSERT_TRUE(lc.ok());
  EXPECT_NE(*lc, *la);
}

TEST_F(CudaModelGpuTest, LogitsDoNotDependOnTheRestOfTheBatch) {
  auto alone = Make();
  auto batched = Make();
  ASSERT_TRUE(alone && batched);
  const Seq x{Prompt(40, 1), 0, Blocks(0, 3), {39, 1}};
  const Seq y{Prompt(25, 2), 0, Blocks(3, 2), {24, 1}};
  Seq x_moved = x;
  x_moved.blocks = Blocks(10, 3);  // other blocks too
  auto la = Step(*alone, {x});
  auto lb = Step(*batched, {y, x_moved});
  ASSERT_TRUE(la.ok() && lb.ok());
  ASSERT_EQ(lb->size(), 2000u);
  EXPECT_TRUE(std::equal(la->begin(), la->end(), lb->begin() + 1000));
  // The next decode step too: x's token 41 after its 40, batched with y's token 26.
  const Seq x2{{7}, 40, Blocks(0, 3), {1}};
  Seq x2_moved = x2;
  x2_moved.blocks = Blocks(10, 3);
  const Seq y2{{9}, 25, Blocks(3, 2), {1}};
  auto da = Step(*alone, {x2});
  auto db = Step(*batched, {x2_moved, y2});
  ASSERT_TRUE(da.ok() && db.ok());
  EXPECT_TRUE(std::equal(da->begin(), da->end(), db->begin()));
}

// Model P prefills the prompt but its last token; its cache is copied into model D's (what
// the transport does); D computes the last token. Model C runs the same two steps itself.
// D's logits are C's, bit for bit, and so are the caches.
TEST_F(CudaModelGpuTest, DecodingOverCopiedKvEqualsComputingIt) {
  auto p = Make();
  auto d = Make();
  auto c = Make();
  ASSERT_TRUE(p && d && c);
  const std::vector<int32_t> prompt = Prompt(50, 3);
  const std::vector<int32_t> head(prompt.begin(), prompt.end() - 1);
  const Seq first{head, 0, Blocks(4, 4), {49}};
  const Seq last{{prompt.back()}, 49, Blocks(4, 4), {1}};
  ASSERT_TRUE(Step(*p, {first}).ok());
  ASSERT_TRUE(Step(*c, {first}).ok());
  for (int l = 0; l < SmallConfig().num_layers; ++l) {
    KvCache* from = p->model->cache(l);
    KvCache* to = d->model->cache(l);
    ASSERT_TRUE(from && to);
    const size_t k_bytes = static_cast<size_t>(kBlocks) * from->spec().KBytesPerBlock();
    const size_t v_bytes = static_cast<size_t>(kBlocks) * from->spec().VBytesPerBlock();
    ASSERT_EQ(cudaMemcpy(to->view().k, from->view().k, k_bytes, cudaMemcpyDeviceToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(to->view().v, from->view().v, v_bytes, cudaMemcpyDeviceToDevice),
              cudaSuccess);
    // P's KV is C's.
    std::vector<char> kp(k_bytes), kc(k_bytes);
    ASSERT_EQ(cudaMemcpy(kp.data(), from->view().k, k_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(kc.data(), c->model->cache(l)->view().k, k_bytes,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(kp, kc) << "layer " << l;
  }
  auto ld = Step(*d, {last});
  auto lc = Step(*c, {last});
  ASSERT_TRUE(ld.ok() && lc.ok());
  EXPECT_EQ(*ld, *lc);
}

// A pass without logit rows (a prefill worker's) stops the last layer after its attention:
// every layer's KV must still be what a full pass leaves, so a decode step over it gives the
// same logits.
TEST_F(CudaModelGpuTest, APassWithoutLogitsLeavesTheSameKv) {
  auto full = Make();
  auto kv_only = Make();
  ASSERT_TRUE(full && kv_only);
  const std::vector<int32_t> prompt = Prompt(41, 4);
  const Seq prefill{std::vector<int32_t>(prompt.begin(), prompt.end() - 1), 0, Blocks(0, 3), {40}};
  ASSERT_TRUE(Step(*full, {prefill}).ok());
  auto none = Step(*kv_only, {prefill}, /*logits=*/false);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
  const Seq decode{{prompt.back()}, 40, Blocks(0, 3), {1}};
  auto a = Step(*full, {decode});
  auto b = Step(*kv_only, {decode});
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->size(), b->size());
  EXPECT_EQ(0, std::memcmp(a->data(), b->data(), a->size() * sizeof(float)));
}

TEST_F(CudaModelGpuTest, BadInputsAreErrors) {
  auto a = Make();
  ASSERT_TRUE(a);
  const Seq bad{{5, 1000}, 0, Blocks(0, 1), {1, 1}};
  EXPECT_EQ(Step(*a, {bad}).status().code(), absl::StatusCode::kInvalidArgument);
  const Seq short_segments{{5, 6, 7}, 0, Blocks(0, 1), {2}};
  EXPECT_EQ(Step(*a, {short_segments}).status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int32_t> t = {1};
  EXPECT_EQ(a->model->Forward(t, t, t, {}).status().code(),
            absl::StatusCode::kFailedPrecondition);  // no forward context
  // A pipeline stage (layers 1..2) has no embedding: Forward needs every layer.
  LayerRegistry registry;
  auto stage = CudaModel::Create(SmallConfig(), kBlocks, &registry, nullptr, LayerRange{1, 3});
  ASSERT_TRUE(stage.ok()) << stage.status();
  EXPECT_EQ((*stage)->cache(0), nullptr);
  EXPECT_NE((*stage)->cache(2), nullptr);
  EXPECT_EQ((*stage)->Forward(t, t, t, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CudaModel::Create(SmallConfig(), kBlocks, &registry, nullptr, LayerRange{2, 5})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstream
