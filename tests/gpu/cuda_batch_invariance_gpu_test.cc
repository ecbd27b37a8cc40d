// GPU tests of the CUDA backend's batch-invariant mode (CudaBackendOptions::batch_invariant):
// the bits of a sequence's output rows are the same when it is computed alone, in decode
// batches of other sizes and lengths, and in batches mixing decodes with prefills (decodes
// first); the results match the golden CPU reference; and a decode after a longer sequence
// is refused.
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "gpu_test_util.h"
#include "kvstream/attention/cuda_attention.h"
#include "kvstream/common/cuda_status.h"

namespace kvstream {
namespace {

using gpu_test::DeviceAttnProblem;
using testing_util::AttnCase;
using testing_util::AttnProblem;
using testing_util::PromptData;
using testing_util::SeqSpec;

AttnCase Base(DType dtype, int head_size) {
  AttnCase c;
  c.block_size = 16;
  c.num_kv_heads = 8;
  c.group = 4;
  c.head_size = head_size;
  c.head_size_v = head_size;
  c.q_dtype = c.out_dtype = c.cache_dtype = dtype;
  c.pad_tokens = 2;  // rows past the batch must stay untouched
  return c;
}

class CudaBatchInvarianceGpuTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    const absl::Status available = CudaAvailability();
    if (!available.ok()) GTEST_SKIP() << "SKIPPED: no usable GPU: " << available.message();
    CudaBackendOptions o;
    o.batch_invariant = true;
    auto b = CreateCudaAttentionBackend(o);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(b).value();
  }

  // The output rows of sequence `target` of a batch of `seqs`, the target holding `prompt`
  // (the other sequences random); and, when `check`, the whole call against the reference.
  std::vector<std::vector<uint8_t>> Rows(AttnCase c, std::vector<SeqSpec> seqs, size_t target,
                                         const PromptData& prompt, uint32_t seed,
                                         bool check = false) {
    c.seqs = std::move(seqs);
    c.seed = seed;
    AttnProblem pb(c);
    pb.FillSequence(target, prompt);
    auto d = DeviceAttnProblem::Create(pb);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return {};
    const absl::Status run = backend_->Forward((*d)->params());
    EXPECT_TRUE(run.ok()) << run;
    EXPECT_TRUE(AsCudaAttentionBackend(backend_.get())->Synchronize(absl::Seconds(30)).ok());
    auto out = (*d)->Out();
    EXPECT_TRUE(out.ok());
    if (!out.ok()) return {};
    if (check) gpu_test::ExpectMatchesReference(pb, *out, "against the reference");
    std::vector<std::vector<uint8_t>> rows;
    for (int32_t r = pb.query_start_loc()[target]; r < pb.query_start_loc()[target + 1]; ++r) {
      rows.push_back(pb.OutRow(*out, r));
    }
    return rows;
  }

  std::unique_ptr<AttentionBackend> backend_;
};

TEST_P(CudaBatchInvarianceGpuTest, DecodeRowsDoNotDependOnTheBatch) {
  for (int head_size : {64, 128}) {
    const AttnCase c = Base(GetParam(), head_size);
    for (int context : {3, 15, 300, 4100}) {
      SCOPED_TRACE(testing::Message() << "head size " << head_size << ", context " << context);
      const PromptData prompt = PromptData::Random(c, context + 1, 7 + context);
      const auto alone = Rows(c, {{context, 1}}, 0, prompt, 1, /*check=*/true);
      ASSERT_EQ(alone.size(), 1u);
      // Decode batches of other sizes and lengths, the target anywhere among them.
      std::mt19937 rng(static_cast<uint32_t>(context));
      for (int n : {2, 5, 40}) {
        std::vector<SeqSpec> seqs;
        for (int i = 0; i < n; ++i) {
          seqs.push_back({static_cast<int>(rng() % 3000), 1});
        }
        const size_t at = rng() % seqs.size();
        seqs[at] = {context, 1};
        EXPECT_EQ(Rows(c, seqs, at, prompt, 2 + n, /*check=*/n == 40), alone) << n << " decodes";
      }
      // Decodes first, then prefills and chunked prefills.
      const std::vector<SeqSpec> mixed = {{20, 1}, {context, 1}, {0, 37}, {100, 20}, {4000, 3}};
      EXPECT_EQ(Rows(c, mixed, 1, prompt, 9, /*check=*/true), alone) << "mixed batch";
    }
  }
}

TEST_P(CudaBatchInvarianceGpuTest, PrefillRowsDoNotDependOnTheBatch) {
  const AttnCase c = Base(GetParam(), 128);
  const PromptData prompt = PromptData::Random(c, 400, 5);
  for (SeqSpec target : {SeqSpec{0, 50}, SeqSpec{300, 100}}) {
    const auto alone = Rows(c, {target}, 0, prompt, 1, /*check=*/true);
    ASSERT_EQ(alone.size(), static_cast<size_t>(target.query_len));
    const std::vector<SeqSpec> mixed = {{10, 1}, {2000, 1}, {0, 7}, target, {64, 200}};
    EXPECT_EQ(Rows(c, mixed, 3, prompt, 3, /*check=*/true), alone);
  }
}

TEST_P(CudaBatchInvarianceGpuTest, ADecodeAfterALongerSequenceIsRefused) {
  AttnCase c = Base(GetParam(), 128);
  c.seqs = {{0, 5}, {30, 1}};
  AttnProblem pb(c);
  auto d = DeviceAttnProblem::Create(pb);
  ASSERT_TRUE(d.ok());
  const absl::Status s = backend_->Forward((*d)->params());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("sequence 1"), std::string::npos) << s;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaBatchInvarianceGpuTest,
                         ::testing::Values(DType::kBFloat16, DType::kFloat16),
                         [](const ::testing::TestParamInfo<DType>& p) { return std::string(DTypeName(p.param)); });

}  // namespace
}  // namespace kvstream
