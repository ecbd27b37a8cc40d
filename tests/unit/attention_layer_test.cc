// Tests of the Attention layer: options, cache dtype resolution, KV sharing, and the forward
// pass around the cache update, the transfer hook and the backend.
#include "kvstream/attention/attention.h"

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kvstream/attention/cpu_attention.h"
#include "kvstream/cache/slot_mapping.h"
#include "kvstream/common/numeric.h"

namespace kvstream {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

AttentionOptions Options(const std::string& name) {
  AttentionOptions o;
  o.num_heads = 4;
  o.num_kv_heads = 2;
  o.head_size = 8;
  o.scale = 1.0f / std::sqrt(8.0f);
  o.prefix = name;
  o.dtype = DType::kFloat32;
  o.block_size = 4;
  return o;
}

Tensor Random(std::vector<int64_t> shape, DType dtype, uint32_t seed) {
  Tensor t = Tensor::Zeros(std::move(shape), dtype);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.SetFloat(i, dist(rng));
  return t;
}

// ---- options and cache dtype ----

TEST(AttentionOptionsTest, AutoCacheDtypeFollowsTheModel) {
  LayerRegistry r;
  AttentionOptions o = Options("l.0");
  o.dtype = DType::kBFloat16;
  auto a = Attention::Create(o, &r);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->kv_cache_spec().dtype, DType::kBFloat16);
  EXPECT_EQ((*a)->kv_cache_spec().quant_mode, KvQuantMode::kNone);
  EXPECT_EQ((*a)->kv_cache_spec().num_kv_heads, 2);
  EXPECT_EQ((*a)->kv_cache_spec().head_size_v, 8);
}

TEST(AttentionOptionsTest, KvCacheSchemeTurnsAutoIntoFp8) {
  LayerRegistry r;
  AttentionOptions o = Options("l.0");
  o.quant_config = QuantConfig{KvCacheScheme{}};
  auto a = Attention::Create(o, &r);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->kv_cache_dtype(), KvCacheDType::kFp8E4M3);
  EXPECT_EQ((*a)->kv_cache_spec().dtype, DType::kFloat8E4M3);
  EXPECT_EQ((*a)->kv_cache_spec().quant_mode, KvQuantMode::kPerTensor);
}

TEST(AttentionOptionsTest, AttnHeadStrategyGivesPerHeadScales) {
  LayerRegistry r;
  AttentionOptions o = Options("l.0");
  KvCacheScheme scheme;
  scheme.strategy = "attn_head";
  o.quant_config = QuantConfig{scheme};
  auto a = Attention::Create(o, &r);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->kv_cache_spec().quant_mode, KvQuantMode::kPerHead);
}

TEST(AttentionOptionsTest, ExplicitCacheDtypeWinsOverScheme) {
  LayerRegistry r;
  AttentionOptions o = Options("l.0");
  o.kv_cache_dtype = "bfloat16";
  o.quant_config = QuantConfig{KvCacheScheme{}};
  auto a = Attention::Create(o, &r);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->kv_cache_spec().dtype, DType::kBFloat16);
  EXPECT_EQ((*a)->kv_cache_spec().quant_mode, KvQuantMode::kNone);

  AttentionOptions e5 = Options("l.1");
  e5.kv_cache_dtype = "fp8_e5m2";
  e5.quant_config = QuantConfig{KvCacheScheme{}};
  auto b = Attention::Create(e5, &r);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->kv_cache_spec().dtype, DType::kFloat8E5M2);
}

TEST(AttentionOptionsTest, BadOptionsNameTheOption) {
  struct Case {
    const char* what;
    void (*mutate)(AttentionOptions&);
  };
  const Case cases[] = {
      {"num_heads", [](AttentionOptions& o) { o.num_heads = 0; }},
      {"head_size", [](AttentionOptions& o) { o.head_size = -1; }},
      {"scale", [](AttentionOptions& o) { o.scale = 0; }},
      {"num_kv_heads", [](AttentionOptions& o) { o.num_kv_heads = 3; }},
      {"alibi_slopes", [](AttentionOptions& o) { o.alibi_slopes = {1.0f}; }},
      {"sliding_window", [](AttentionOptions& o) { o.sliding_window = 0; }},
      {"logits_soft_cap", [](AttentionOptions& o) { o.logits_soft_cap = -2.0f; }},
      {"head_size_v", [](AttentionOptions& o) { o.head_size_v = 0; }},
      {"block_size", [](AttentionOptions& o) { o.block_size = 0; }},
      {"fp9", [](AttentionOptions& o) { o.kv_cache_dtype = "fp9"; }},
      {"strategy", [](AttentionOptions& o) {
         KvCacheScheme s;
         s.strategy = "channel";
         o.quant_config = QuantConfig{s};
       }},
      {"model dtype", [](AttentionOptions& o) { o.dtype = DType::kInt32; }},
  };
  for (const Case& c : cases) {
    LayerRegistry r;
    AttentionOptions o = Options("model.layers.3.attn");
    c.mutate(o);
    auto a = Attention::Create(o, &r);
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(a.status().message(), HasSubstr(c.what));
    EXPECT_THAT(a.status().message(), HasSubstr("model.layers.3.attn")) << c.what;
    EXPECT_FALSE(r.Contains("model.layers.3.attn")) << c.what;
  }
  LayerRegistry r;
  AttentionOptions o = Options("l.0");
  o.backend = "tpu";
  EXPECT_EQ(Attention::Create(o, &r).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(Attention::Create(Options(""), &r).ok());
  EXPECT_FALSE(Attention::Create(Options("x"), nullptr).ok());
}

TEST(AttentionTypeTest, ParsesNames) {
  EXPECT_EQ(*ParseAttentionType("encoder_only"), AttentionType::kEncoderOnly);
  EXPECT_EQ(*ParseAttentionType("DECODER"), AttentionType::kDecoder);
  EXPECT_EQ(ParseAttentionType("cross").status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- KV sharing ----

TEST(KvSharingTest, TargetMustExistEarlierWithSameTypeAndShape) {
  LayerRegistry r;
  AttentionOptions s = Options("l.1");
  s.kv_sharing_target_layer_name = "l.0";
  // Target not registered yet (it would come later).
  auto early = Attention::Create(s, &r);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(early.status().message(), HasSubstr("l.0"));

  auto target = Attention::Create(Options("l.0"), &r);
  ASSERT_TRUE(target.ok());

  AttentionOptions other_type = s;
  other_type.attn_type = AttentionType::kEncoderOnly;
  auto t = Attention::Create(other_type, &r);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("encoder_only"));

  AttentionOptions other_shape = s;
  other_shape.num_kv_heads = 4;
  EXPECT_EQ(Attention::Create(other_shape, &r).status().code(), absl::StatusCode::kInvalidArgument);

  AttentionOptions self = Options("l.0b");
  self.kv_sharing_target_layer_name = "l.0b";
  EXPECT_EQ(Attention::Create(self, &r).status().code(), absl::StatusCode::kInvalidArgument);

  auto ok = Attention::Create(s, &r);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE((*ok)->shares_kv());
  EXPECT_EQ((*ok)->kv_cache_owner(), "l.0");
}

// ---- forward ----

// Records hook calls and, at BeforeAttention, what the cache held.
class RecordingHook : public TransferHook {
 public:
  absl::Status BeforeAttention(absl::string_view layer, void* stream) override {
    calls.push_back("before:" + std::string(layer));
    streams.push_back(stream);
    return before_status;
  }
  absl::Status AfterAttention(absl::string_view layer, const KvCache& cache,
                              const AttentionMetadata& md, void* stream) override {
    calls.push_back("after:" + std::string(layer));
    streams.push_back(stream);
    saved_cache = &cache;
    saved_tokens = md.num_actual_tokens;
    return absl::OkStatus();
  }
  std::vector<std::string> calls;
  std::vector<void*> streams;  // what each call was given (host caches: null)
  absl::Status before_status;
  const KvCache* saved_cache = nullptr;
  int64_t saved_tokens = -1;
};

class ForwardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = Attention::Create(Options("model.layers.0.attn"), &registry_);
    ASSERT_TRUE(a.ok()) << a.status();
    layer_ = std::move(a).value();
    auto c = KvCache::Create({layer_->kv_cache_spec(), KvLayout::kNHD, 8});
    ASSERT_TRUE(c.ok());
    cache_ = std::move(c).value();
    ASSERT_TRUE(registry_.BindKvCache("model.layers.0.attn", cache_.get()).ok());
    // Prefill of 6 tokens in blocks {5, 2} and a decode at position 4 in blocks {1, 7}.
    auto md = BuildAttentionMetadata({{0, 6, {5, 2}},
                                      {4, 1, {1, 7}}},
                                     4);
    ASSERT_TRUE(md.ok());
    md_ = *md;
    registry_.SetForwardContext({&md_});
    q_ = Random({7, 4 * 8}, DType::kFloat32, 1);
    k_ = Random({7, 2 * 8}, DType::kFloat32, 2);
    v_ = Random({7, 2 * 8}, DType::kFloat32, 3);
  }

  // Expected output: the golden reference on the layer's cache after the update.
  Tensor Reference() {
    Tensor out = Tensor::Zeros({7, 4, 8}, DType::kFloat32);
    PagedAttentionParams p;
    p.q = q_.data();
    p.q_dtype = DType::kFloat32;
    p.q_token_stride = 32;
    p.q_head_stride = 8;
    p.out = out.data();
    p.out_dtype = DType::kFloat32;
    p.o_token_stride = 32;
    p.o_head_stride = 8;
    p.num_tokens = 7;
    p.cache = cache_->view();
    p.query_start_loc = md_.query_start_loc.data();
    p.seq_lens = md_.seq_lens.data();
    p.block_table = md_.block_table.data();
    p.block_table_stride = md_.max_blocks_per_seq;
    p.num_seqs = md_.num_seqs();
    p.max_query_len = md_.max_query_len;
    p.max_seq_len = md_.max_seq_len;
    p.num_heads = 4;
    p.scale = layer_->options().scale;
    p.causal = true;
    EXPECT_TRUE(RunAttentionReference(p).ok());
    return out;
  }

  // K cache element (block, token, head, d) as float.
  float KAt(int b, int t, int h, int d) const {
    const KvCacheView v = cache_->view();
    return LoadAsFloat(v.k, v.spec.dtype, v.k_strides.Offset(b, t, h, d));
  }

  LayerRegistry registry_;
  std::unique_ptr<Attention> layer_;
  std::unique_ptr<KvCache> cache_;
  AttentionMetadata md_;
  Tensor q_, k_, v_;
};

TEST_F(ForwardTest, WritesCacheThenMatchesReference) {
  auto out = layer_->Forward(q_.view(), k_.view(), v_.view());
  ASSERT_TRUE(out.ok()) << out.status();
  // Token 4 of the prefill (slot 2*4+0), head 1, element 3.
  EXPECT_EQ(KAt(2, 0, 1, 3), k_.GetFloat(4 * 16 + 1 * 8 + 3));
  // The decode token at position 4 -> block 7 offset 0.
  EXPECT_EQ(KAt(7, 0, 0, 0), k_.GetFloat(6 * 16));
  Tensor want = Reference();
  ASSERT_EQ(out->numel(), want.numel());
  for (int64_t i = 0; i < want.numel(); ++i) {
    ASSERT_NEAR(out->GetFloat(i), want.GetFloat(i), 1e-5) << i;
  }
}

TEST_F(ForwardTest, Accepts3dInputsAndCallerOutput) {
  auto q3 = q_.view().Reshape({7, 4, 8});
  auto k3 = k_.view().Reshape({7, 2, 8});
  auto v3 = v_.view().Reshape({7, 2, 8});
  Tensor out = Tensor::Zeros({7, 4, 8}, DType::kFloat32);
  ASSERT_TRUE(layer_->Forward(*q3, *k3, *v3, out.view()).ok());
  Tensor want = Reference();
  for (int64_t i = 0; i < want.numel(); ++i) ASSERT_NEAR(out.GetFloat(i), want.GetFloat(i), 1e-5);
}

TEST_F(ForwardTest, HookWrapsAttentionAfterTheCacheUpdate) {
  RecordingHook hook;
  registry_.SetTransferHook(&hook);
  ASSERT_TRUE(layer_->Forward(q_.view(), k_.view(), v_.view()).ok());
  EXPECT_THAT(hook.calls, ElementsAre("before:model.layers.0.attn", "after:model.layers.0.attn"));
  EXPECT_EQ(hook.saved_cache, cache_.get());
  EXPECT_EQ(hook.saved_tokens, 7);
  // A host cache: its work is done when the hook is called, so no stream is passed.
  EXPECT_THAT(hook.streams, ElementsAre(nullptr, nullptr));
}

TEST_F(ForwardTest, HookErrorFailsTheLayerAndSkipsSave) {
  RecordingHook hook;
  hook.before_status = absl::DeadlineExceededError("layer 0 did not arrive");
  registry_.SetTransferHook(&hook);
  auto out = layer_->Forward(q_.view(), k_.view(), v_.view());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(out.status().message(), HasSubstr("model.layers.0.attn"));
  EXPECT_THAT(hook.calls, ElementsAre("before:model.layers.0.attn"));
}

TEST_F(ForwardTest, DummyRunZeroesOutputAndSkipsCacheAndHook) {
  RecordingHook hook;
  registry_.SetTransferHook(&hook);
  registry_.SetForwardContext({&md_, true});
  Tensor out = Tensor::Zeros({7, 32}, DType::kFloat32);
  for (int64_t i = 0; i < out.numel(); ++i) out.SetFloat(i, 5.0f);
  ASSERT_TRUE(layer_->Forward(q_.view(), k_.view(), v_.view(), out.view()).ok());
  for (int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.GetFloat(i), 0.0f);
  EXPECT_TRUE(hook.calls.empty());
  EXPECT_EQ(KAt(5, 0, 0, 0), 0.0f);

  registry_.SetForwardContext({});  // no metadata: a profiling run
  ASSERT_TRUE(layer_->Forward(q_.view(), k_.view(), v_.view(), out.view()).ok());
  EXPECT_TRUE(hook.calls.empty());
}

TEST_F(ForwardTest, AbsentKeyOrBypassSkipsTheUpdate) {
  ASSERT_TRUE(layer_->Forward(q_.view(), TensorView(), TensorView()).ok());
  EXPECT_EQ(KAt(5, 0, 0, 0), 0.0f);
  layer_->set_kv_cache_update_bypass(true);
  ASSERT_TRUE(layer_->Forward(q_.view(), k_.view(), v_.view()).ok());
  EXPECT_EQ(KAt(5, 0, 0, 0), 0.0f);
  layer_->set_kv_cache_update_bypass(false);
  ASSERT_TRUE(layer_->Forward(q_.view(), k_.view(), v_.view()).ok());
  EXPECT_EQ(KAt(5, 0, 0, 0), k_.GetFloat(0));
}

TEST_F(ForwardTest, SharingLayerReadsTargetCacheAndWritesNothing) {
  AttentionOptions o = Options("model.layers.1.attn");
  o.kv_sharing_target_layer_name = "model.layers.0.attn";
  auto shared = Attention::Create(o, &registry_);
  ASSERT_TRUE(shared.ok()) << shared.status();
  // Fill the target's cache through layer 0.
  auto first = layer_->Forward(q_.view(), k_.view(), v_.view());
  ASSERT_TRUE(first.ok());
  std::vector<float> before;
  const KvCacheView v = cache_->view();
  for (int64_t i = 0; i < 8 * 4 * 2 * 8; ++i) before.push_back(LoadAsFloat(v.k, v.spec.dtype, i));
  // Other keys through the sharing layer: the cache must not change, the output must equal
  // layer 0's (same queries, same cache).
  Tensor other_k = Random({7, 16}, DType::kFloat32, 9);
  auto second = (*shared)->Forward(q_.view(), other_k.view(), v_.view());
  ASSERT_TRUE(second.ok()) << second.status();
  for (int64_t i = 0; i < static_cast<int64_t>(before.size()); ++i) {
    ASSERT_EQ(LoadAsFloat(v.k, v.spec.dtype, i), before[i]);
  }
  for (int64_t i = 0; i < first->numel(); ++i) ASSERT_EQ(second->GetFloat(i), first->GetFloat(i));
}

TEST_F(ForwardTest, BadInputsAreErrors) {
  // Wrong query width.
  Tensor bad_q = Random({7, 30}, DType::kFloat32, 4);
  auto s = layer_->Forward(bad_q.view(), k_.view(), v_.view());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("query"));
  // Key without value.
  EXPECT_EQ(layer_->Forward(q_.view(), k_.view(), TensorView()).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Key rows != slot mapping entries.
  Tensor short_k = Random({5, 16}, DType::kFloat32, 5);
  Tensor short_v = Random({5, 16}, DType::kFloat32, 6);
  EXPECT_EQ(layer_->Forward(q_.view(), short_k.view(), short_v.view()).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Fewer query rows than the metadata's tokens.
  Tensor few_q = Random({3, 32}, DType::kFloat32, 7);
  Tensor few_k = Random({3, 16}, DType::kFloat32, 7);
  EXPECT_FALSE(layer_->Forward(few_q.view(), few_k.view(), few_k.view()).ok());
  // A block id outside the cache: rejected before anything is written.
  AttentionMetadata bad = md_;
  bad.block_table[0] = 99;
  registry_.SetForwardContext({&bad});
  auto oob = layer_->Forward(q_.view(), k_.view(), v_.view());
  EXPECT_EQ(oob.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(KAt(5, 0, 0, 0), 0.0f);
  // Unbound cache.
  AttentionOptions o = Options("model.layers.9.attn");
  auto unbound = Attention::Create(o, &registry_);
  ASSERT_TRUE(unbound.ok());
  registry_.SetForwardContext({&md_});
  EXPECT_EQ((*unbound)->Forward(q_.view(), k_.view(), v_.view()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(EncoderAttentionTest, NonDecoderTypesAreBidirectional) {
  // With a single sequence of 3 tokens, a bidirectional layer's first token sees all three
  // keys; the causal one sees only its own, so their outputs for token 0 differ.
  LayerRegistry r;
  AttentionOptions dec = Options("dec");
  AttentionOptions enc = Options("enc");
  enc.attn_type = AttentionType::kEncoderOnly;
  auto d = Attention::Create(dec, &r);
  auto e = Attention::Create(enc, &r);
  ASSERT_TRUE(d.ok() && e.ok());
  auto cd = KvCache::Create({(*d)->kv_cache_spec(), KvLayout::kNHD, 2});
  auto ce = KvCache::Create({(*e)->kv_cache_spec(), KvLayout::kNHD, 2});
  ASSERT_TRUE(r.BindKvCache("dec", cd->get()).ok());
  ASSERT_TRUE(r.BindKvCache("enc", ce->get()).ok());
  auto md = BuildAttentionMetadata({{0, 3, {1}}}, 4);
  r.SetForwardContext({&*md});
  Tensor q = Random({3, 32}, DType::kFloat32, 11);
  Tensor k = Random({3, 16}, DType::kFloat32, 12);
  Tensor v = Random({3, 16}, DType::kFloat32, 13);
  auto od = (*d)->Forward(q.view(), k.view(), v.view());
  auto oe = (*e)->Forward(q.view(), k.view(), v.view());
  ASSERT_TRUE(od.ok() && oe.ok());
  // Causal token 0 sees only value 0: output head 0 == value head 0 of token 0.
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(od->GetFloat(i), v.GetFloat(i), 1e-6);
  float diff = 0;
  for (int i = 0; i < 8; ++i) diff += std::fabs(oe->GetFloat(i) - od->GetFloat(i));
  EXPECT_GT(diff, 1e-3);
  // The last token sees everything in both.
  for (int i = 2 * 32; i < 3 * 32; ++i) EXPECT_NEAR(oe->GetFloat(i), od->GetFloat(i), 1e-5);
}

}  // namespace
}  // namespace kvstream
