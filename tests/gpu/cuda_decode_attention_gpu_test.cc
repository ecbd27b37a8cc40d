// The CUDA decode kernel (LaunchDecodeAttention) against the golden CPU reference
// (RunAttentionReference) over the grids of the CPU tests, decode batches only: every
// q/out dtype x cache dtype (fp8 per-tensor and per-head) x layout; block sizes 1/5/16 x
// MHA/GQA/MQA head configurations (group tiles of 1..8, several tiles per KV head) x head
// sizes 64..512 with head_size_v != head_size; soft cap, ALiBi, sliding window, causal or
// not, alone and combined; padded strides (element-wise copies); every split count from 1
// to 256, including empty splits; and the errors the launcher and validation report.
// Each problem runs with the launcher's own split choice and with one split, so both the
// direct write and the merge kernel are checked.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "cuda/decode_tc_launch.h"
#include "cuda/kernel_params.h"
#include "cuda/launchers.h"
#include "gpu_test_util.h"
#include "kvstream/attention/backend.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "tests/unit/attention_test_util.h"

namespace kvstream {
namespace {

using ::kvstream::gpu_test::DeviceAttnProblem;
using ::kvstream::internal::DecodeFp8StagingName;
using ::kvstream::gpu_test::ExpectMatchesReference;
using ::kvstream::testing_util::AttnCase;
using ::kvstream::testing_util::AttnProblem;
using ::kvstream::testing_util::DTypeGrid;
using ::kvstream::testing_util::DTypeGridCase;
using ::kvstream::testing_util::DTypeGridName;
using ::kvstream::testing_util::DTypeGridParam;
using ::kvstream::testing_util::FeatureGrid;
using ::kvstream::testing_util::FeatureGridCase;
using ::kvstream::testing_util::FeatureGridName;
using ::kvstream::testing_util::FeatureGridParam;
using ::kvstream::testing_util::HeadConfig;
using ::kvstream::testing_util::HeadSizes;
using ::kvstream::testing_util::SeqSpec;
using ::kvstream::testing_util::ShapeGridCase;
using ::kvstream::testing_util::ShapeGridName;
using ::kvstream::testing_util::ShortDType;
using ::kvstream::testing_util::TestLayout;
using ::kvstream::testing_util::TestLayoutName;
using ::testing::HasSubstr;

// Decode batches: one query token per sequence (one sequence without any), lengths from 1
// to past several tiles and splits.
std::vector<SeqSpec> DecodeSeqs() {
  return {{0, 1}, {26, 1}, {99, 1}, {6, 0}, {300, 1}, {1000, 1}, {15, 1}};
}

// A problem of the TMA kernel's shape: head size 128, block size 16, `dtype` for q, out and
// the cache.
AttnCase TmaCase(int num_kv_heads, int group, DType dtype) {
  AttnCase c;
  c.num_kv_heads = num_kv_heads;
  c.group = group;
  c.head_size = c.head_size_v = 128;
  c.block_size = 16;
  c.q_dtype = c.out_dtype = c.cache_dtype = dtype;
  return c;
}

class CudaDecodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const absl::Status status = CudaAvailability();
    if (!status.ok()) GTEST_SKIP() << "no usable GPU: " << status.message();
    auto stream = CudaStream::Create();
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = std::move(stream).value();
    auto sms = gpu_test::NumSms();
    ASSERT_TRUE(sms.ok()) << sms.status();
    num_sms_ = *sms;
    auto cc9 = gpu_test::ComputeCapability9();
    ASSERT_TRUE(cc9.ok()) << cc9.status();
    dependent_merge_ = *cc9;
    tma_ = *cc9;
  }

  // How a TMA launch that splits the keys (into 4 parts at most) merges them: in the
  // split kernel with the fixture's arrival counters (as the backend launches it), or with
  // the merge kernel.
  enum class Merge { kInKernel, kMergeKernel };

  // Validates, plans and launches the decode kernels for device params `p`, then waits.
  // With Merge::kInKernel, also fails unless the launch left every arrival counter it was
  // given at zero.
  absl::Status Launch(const PagedAttentionParams& p, int num_splits,
                      internal::DecodeKernel kernel = internal::DecodeKernel::kAuto,
                      Merge merge = Merge::kInKernel,
                      internal::DecodeFp8Staging fp8_staging = internal::DecodeFp8Staging::kAuto) {
    ASSIGN_OR_RETURN(internal::PagedKernelParams kp, internal::MakePagedKernelParams(p));
    internal::DecodeLaunchOptions options;
    options.num_sms = num_sms_;
    options.dependent_merge = dependent_merge_;  // as the backend launches the merge
    options.tma = tma_;
    options.num_splits = num_splits;
    options.kernel = kernel;
    options.fp8_staging = fp8_staging;
    const DType cache_dtype = p.cache.spec.dtype;
    DeviceBuffer workspace;  // exactly the bytes the launch asks for, so that overruns show
    options.workspace = [&workspace](size_t bytes) -> absl::StatusOr<void*> {
      ASSIGN_OR_RETURN(workspace, DeviceBuffer::Create(bytes, MemoryKind::kDevice));
      return workspace.data();
    };
    size_t counters_used = 0;
    if (merge != Merge::kMergeKernel) {
      // Zeroed when first made or grown, then kept: the launches must leave them zero.
      options.arrival_counters = [this, &counters_used](size_t count) -> absl::StatusOr<uint32_t*> {
        counters_used = count;
        ++arrival_requests_;
        return internal::ZeroedArrivalCounters(counters_, count, count,
                                               static_cast<cudaStream_t>(stream_.get()));
      };
    }
    RETURN_IF_ERROR(internal::LaunchDecodeAttention(kp, p.q_dtype, p.out_dtype, cache_dtype,
                                                    options,
                                                    static_cast<cudaStream_t>(stream_.get())));
    RETURN_IF_ERROR(stream_.Synchronize(absl::Seconds(60)));  // the workspace lives until then
    if (counters_used > 0) {
      std::vector<uint32_t> counters(counters_used);
      RETURN_IF_ERROR(CudaErrorToStatus(
          static_cast<int>(cudaMemcpy(counters.data(), counters_.data(),
                                      counters_used * sizeof(uint32_t), cudaMemcpyDeviceToHost)),
          "reading the test's arrival counters"));
      for (size_t i = 0; i < counters_used; ++i) {
        if (counters[i] != 0) {
          return absl::InternalError(absl::StrCat("arrival counter ", i, " is ", counters[i],
                                                  " after the launch, not 0"));
        }
      }
    }
    return absl::OkStatus();
  }

  // The fp8 staging the tensor-core kernel's plan resolves `requested` to for device params
  // `p` (as Launch plans it, with the launcher's split choice).
  absl::StatusOr<internal::DecodeFp8Staging> PlannedFp8Staging(
      const PagedAttentionParams& p, internal::DecodeFp8Staging requested) const {
    ASSIGN_OR_RETURN(internal::PagedKernelParams kp, internal::MakePagedKernelParams(p));
    internal::DecodeLaunchOptions options;
    options.num_sms = num_sms_;
    options.fp8_staging = requested;
    ASSIGN_OR_RETURN(internal::DecodeTcPlan plan,
                     internal::PlanDecodeTc(kp, p.cache.spec.dtype, options));
    return plan.fp8_staging;
  }

  // Whether the tensor-core kernel takes device params `p`.
  static bool TensorCoresApply(const PagedAttentionParams& p) {
    auto kp = internal::MakePagedKernelParams(p);
    return kp.ok() && internal::DecodeTensorCoresApply(*kp, p.q_dtype, p.out_dtype,
                                                       p.cache.spec.dtype);
  }

  // Whether the TMA kernel takes device params `p` on this device.
  bool TmaApplies(const PagedAttentionParams& p) const {
    auto kp = internal::MakePagedKernelParams(p);
    return tma_ && kp.ok() &&
           internal::DecodeTmaApplies(*kp, p.q_dtype, p.out_dtype, p.cache.spec.dtype);
  }

  static const char* KernelName(internal::DecodeKernel kernel) {
    switch (kernel) {
      case internal::DecodeKernel::kCudaCores: return "CUDA cores";
      case internal::DecodeKernel::kTensorCores: return "tensor cores";
      case internal::DecodeKernel::kTensorCoresTma: return "tensor cores with TMA";
      default: return "automatic kernel";
    }
  }

  // Runs `pb` on the GPU with each kernel of `kernels` that takes it (the CUDA-core kernel
  // takes every problem here; the tensor-core one 16-bit q == out and 16-byte rows; the TMA
  // one d 128, block size 16 and KV heads in fours, on devices with TMA), with the
  // launcher's split choice (0) and with each of `splits`, and compares every output with
  // the reference. `fp8_staging`: the tensor-core kernel's (DecodeLaunchOptions).
  void ExpectMatches(AttnProblem& pb, const std::vector<int>& splits = {0, 1},
                     const std::vector<internal::DecodeKernel>& kernels =
                         {internal::DecodeKernel::kCudaCores, internal::DecodeKernel::kTensorCores,
                          internal::DecodeKernel::kTensorCoresTma},
                     internal::DecodeFp8Staging fp8_staging = internal::DecodeFp8Staging::kAuto) {
    auto dev = DeviceAttnProblem::Create(pb);
    ASSERT_TRUE(dev.ok()) << dev.status();
    for (internal::DecodeKernel kernel : kernels) {
      if (kernel == internal::DecodeKernel::kTensorCores && !TensorCoresApply((*dev)->params())) {
        continue;
      }
      if (kernel == internal::DecodeKernel::kTensorCoresTma && !TmaApplies((*dev)->params())) {
        continue;
      }
      for (int num_splits : splits) {
        const std::string what = absl::StrCat(
            KernelName(kernel), ", ",
            num_splits == 0 ? std::string("automatic splits") : absl::StrCat(num_splits, " splits"),
            ", fp8 staging ", DecodeFp8StagingName(fp8_staging));
        ASSERT_TRUE((*dev)->ResetOut().ok());
        const absl::Status st =
            Launch((*dev)->params(), num_splits, kernel, Merge::kInKernel, fp8_staging);
        ASSERT_TRUE(st.ok()) << st << " (" << what << ")";
        auto out = (*dev)->Out();
        ASSERT_TRUE(out.ok()) << out.status();
        ExpectMatchesReference(pb, *out, what);
        if (kernel != internal::DecodeKernel::kTensorCoresTma) continue;
        // Where the TMA kernel merged its splits itself above, the merge kernel must give
        // the same bits.
        ASSERT_TRUE((*dev)->ResetOut().ok());
        const absl::Status merged =
            Launch((*dev)->params(), num_splits, kernel, Merge::kMergeKernel);
        ASSERT_TRUE(merged.ok()) << merged << " (" << what << ", merge kernel)";
        auto merged_out = (*dev)->Out();
        ASSERT_TRUE(merged_out.ok()) << merged_out.status();
        EXPECT_EQ(*out, *merged_out) << what << ": the in-kernel merge and the merge kernel "
                                     << "differ";
      }
    }
  }

  // The tensor-core kernel on `c` made to suit it: q and out of one 16-bit dtype (q's, or
  // bfloat16 for float32), a 16-bit cache of that dtype where `c`'s is float32. Fails
  // unless the kernel takes the problem, when `must_apply`.
  void ExpectTensorCoresMatch(AttnCase c, const std::vector<int>& splits = {0, 1, 3},
                              bool must_apply = true) {
    const DType act = c.q_dtype == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
    c.q_dtype = act;
    c.out_dtype = act;
    if (!IsFp8(c.cache_dtype)) c.cache_dtype = act;
    SCOPED_TRACE(absl::StrCat("tensor-core variant: q/out/cache ", ShortDType(act), "/",
                              ShortDType(act), "/", ShortDType(c.cache_dtype)));
    AttnProblem pb(c);
    if (must_apply) {
      auto dev = DeviceAttnProblem::Create(pb);
      ASSERT_TRUE(dev.ok()) << dev.status();
      ASSERT_TRUE(TensorCoresApply((*dev)->params()))
          << "the tensor-core kernel should take d " << c.head_size << "/" << c.head_size_v;
    }
    ExpectMatches(pb, splits,
                  {internal::DecodeKernel::kTensorCores, internal::DecodeKernel::kTensorCoresTma});
  }

  // `kernel` (kTensorCores or kTensorCoresTma) refuses `pb` with InvalidArgument naming
  // `why`; kAuto then runs another kernel and matches the reference.
  void ExpectRefusedThenAutoMatches(AttnProblem& pb, internal::DecodeKernel kernel,
                                    const std::string& why) {
    auto dev = DeviceAttnProblem::Create(pb);
    ASSERT_TRUE(dev.ok()) << dev.status();
    EXPECT_FALSE(kernel == internal::DecodeKernel::kTensorCoresTma
                     ? TmaApplies((*dev)->params())
                     : TensorCoresApply((*dev)->params()));
    const absl::Status st = Launch((*dev)->params(), 0, kernel);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(why));
    ASSERT_TRUE((*dev)->ResetOut().ok());
    const absl::Status auto_st = Launch((*dev)->params(), 0, internal::DecodeKernel::kAuto);
    ASSERT_TRUE(auto_st.ok()) << auto_st;
    auto out = (*dev)->Out();
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectMatchesReference(pb, *out, "automatic kernel choice");
  }

  CudaStream stream_;
  DeviceBuffer counters_;  // arrival counters, zero between launches
  int arrival_requests_ = 0;  // calls of the arrival counter provider
  int num_sms_ = 0;
  bool dependent_merge_ = false;
  bool tma_ = false;  // compute capability 9.0 or newer
};

// ---------------------------------------------------------------------------------------
// Every q/out dtype x cache dtype x layout.

class CudaDecodeDTypeTest
    : public CudaDecodeTest,
      public ::testing::WithParamInterface<DTypeGridParam> {};

TEST_P(CudaDecodeDTypeTest, MatchesReference) {
  AttnCase c = DTypeGridCase(GetParam());
  c.block_size = 5;
  c.head_size = 64;
  c.head_size_v = 64;
  c.seqs = DecodeSeqs();
  c.seed = 7;
  AttnProblem pb(c);
  ExpectMatches(pb);
  ExpectTensorCoresMatch(c);
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, CudaDecodeDTypeTest, DTypeGrid(), DTypeGridName);

TEST_F(CudaDecodeTest, OutputDTypeDiffersFromQuery) {
  for (DType q : {DType::kBFloat16, DType::kFloat32}) {
    for (DType out : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      SCOPED_TRACE(absl::StrCat("q ", ShortDType(q), " out ", ShortDType(out)));
      AttnCase c;
      c.q_dtype = q;
      c.out_dtype = out;
      c.cache_dtype = DType::kFloat16;
      c.seqs = DecodeSeqs();
      AttnProblem pb(c);
      ExpectMatches(pb);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Block sizes x head configurations x head sizes.

class CudaDecodeShapeTest
    : public CudaDecodeTest,
      public ::testing::WithParamInterface<std::tuple<int, HeadConfig, HeadSizes>> {};

TEST_P(CudaDecodeShapeTest, MatchesReference) {
  const auto& [block_size, heads, sizes] = GetParam();
  AttnCase c = ShapeGridCase(block_size, heads, sizes);
  c.q_dtype = DType::kBFloat16;
  c.out_dtype = DType::kFloat32;
  c.seqs = {{0, 1}, {67, 1}, {99, 1}, {6, 1}, {600, 1}, {0, 0}};
  c.seed = static_cast<uint32_t>(block_size * 100 + heads.group * 10 + sizes.v);
  AttnProblem pb(c);
  ExpectMatches(pb);
  // Head sizes up to 256 in multiples of 8 are the tensor-core kernel's.
  const bool tc_sizes = sizes.k <= 256 && sizes.v <= 256 && sizes.k % 8 == 0 && sizes.v % 8 == 0;
  ExpectTensorCoresMatch(c, {0, 1, 3}, tc_sizes);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaDecodeShapeTest,
    ::testing::Combine(::testing::Values(1, 5, 16),
                       ::testing::Values(HeadConfig{4, 1}, HeadConfig{2, 3}, HeadConfig{2, 4},
                                         HeadConfig{1, 8}, HeadConfig{2, 8}, HeadConfig{1, 12},
                                         HeadConfig{1, 16}),
                       ::testing::Values(HeadSizes{64, 64}, HeadSizes{80, 80},
                                         HeadSizes{128, 128}, HeadSizes{256, 256},
                                         HeadSizes{64, 32}, HeadSizes{72, 40},
                                         HeadSizes{128, 64}, HeadSizes{40, 128},
                                         HeadSizes{512, 512}, HeadSizes{96, 100})),
    [](const auto& param_info) {
      return ShapeGridName(std::get<0>(param_info.param), std::get<1>(param_info.param),
                           std::get<2>(param_info.param));
    });

// Two chunks per lane for 32-bit caches (head sizes past 128), fp8 at the largest size.
TEST_F(CudaDecodeTest, LargeHeadsOfWideAndNarrowCaches) {
  struct Case {
    DType cache;
    int d, dv;
  };
  for (const Case& k : {Case{DType::kFloat32, 256, 256}, Case{DType::kFloat32, 200, 136},
                        Case{DType::kFloat8E4M3, 512, 512}, Case{DType::kFloat8E5M2, 256, 192}}) {
    SCOPED_TRACE(absl::StrCat(ShortDType(k.cache), " d ", k.d, "/", k.dv));
    AttnCase c;
    c.cache_dtype = k.cache;
    c.quant = KvQuantMode::kPerHead;
    c.head_size = k.d;
    c.head_size_v = k.dv;
    c.group = 4;
    c.seqs = DecodeSeqs();
    AttnProblem pb(c);
    ExpectMatches(pb);
  }
}

// ---------------------------------------------------------------------------------------
// Features alone and combined.

class CudaDecodeFeatureTest : public CudaDecodeTest,
                              public ::testing::WithParamInterface<FeatureGridParam> {};

TEST_P(CudaDecodeFeatureTest, MatchesReference) {
  AttnCase c = FeatureGridCase(GetParam());
  c.seqs = {{150, 1}, {200, 1}, {3, 1}, {40, 1}, {0, 1}, {69, 1}, {70, 1}, {700, 1}};
  AttnProblem pb(c);
  ExpectMatches(pb, {0, 1, 3});
  ExpectTensorCoresMatch(c);
}

INSTANTIATE_TEST_SUITE_P(Features, CudaDecodeFeatureTest, FeatureGrid(), FeatureGridName);

// fp8 with every feature at once, and a window shorter than a block.
TEST_F(CudaDecodeTest, Fp8WithEveryFeature) {
  for (int window : {1, 3, 100}) {
    SCOPED_TRACE(absl::StrCat("window ", window));
    AttnCase c;
    c.cache_dtype = DType::kFloat8E4M3;
    c.quant = KvQuantMode::kPerHead;
    c.q_dtype = DType::kBFloat16;
    c.out_dtype = DType::kBFloat16;
    c.sliding_window = window;
    c.alibi = true;
    c.soft_cap = 5.0f;
    c.head_size = 128;
    c.head_size_v = 128;
    c.seqs = DecodeSeqs();
    AttnProblem pb(c);
    ExpectMatches(pb, {0, 1, 2});
  }
}

// ---------------------------------------------------------------------------------------
// Strides and splits.

// Padded heads, tokens and blocks: no row is 4-byte aligned in 16-bit and fp8 caches, so
// the element-wise copy path runs.
TEST_F(CudaDecodeTest, PaddedStridesUseElementCopies) {
  for (DType cache : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                      DType::kFloat8E5M2}) {
    SCOPED_TRACE(ShortDType(cache));
    AttnCase c;
    c.layout = TestLayout::kPadded;
    c.cache_dtype = cache;
    c.quant = KvQuantMode::kPerHead;
    c.head_size_v = 48;
    c.sliding_window = 30;
    c.seqs = DecodeSeqs();
    AttnProblem pb(c);
    ExpectMatches(pb);
  }
}

TEST_F(CudaDecodeTest, EverySplitCountMatches) {
  AttnCase c;
  c.cache_dtype = DType::kBFloat16;
  c.q_dtype = DType::kBFloat16;
  c.out_dtype = DType::kFloat32;
  c.num_kv_heads = 2;
  c.group = 4;
  c.head_size = 128;
  c.head_size_v = 128;
  c.block_size = 16;
  // Sequences shorter than the split count leave splits empty.
  c.seqs = {{1999, 1}, {0, 1}, {512, 1}, {254, 1}, {255, 1}, {31, 0}, {4, 1}};
  AttnProblem pb(c);
  ExpectMatches(pb, {1, 2, 3, 7, 64, 255, 256});
  ExpectTensorCoresMatch(c, {1, 2, 3, 7, 64, 255, 256});
}

// A realistic decode step: 32 query heads on 8 KV heads, head size 128, 4k keys.
TEST_F(CudaDecodeTest, LongSequencesGqa) {
  AttnCase c;
  c.cache_dtype = DType::kBFloat16;
  c.q_dtype = DType::kBFloat16;
  c.out_dtype = DType::kFloat32;
  c.num_kv_heads = 8;
  c.group = 4;
  c.head_size = 128;
  c.head_size_v = 128;
  c.block_size = 16;
  c.seqs = {{4095, 1}, {4000, 1}, {1234, 1}, {4096, 1}};
  AttnProblem pb(c);
  ExpectMatches(pb);
  ExpectTensorCoresMatch(c);
}

// What the tensor-core kernel leaves to the CUDA-core one: kTensorCores says why, kAuto
// falls back (and matches the reference through ExpectMatches' CUDA-core run above).
TEST_F(CudaDecodeTest, TensorCoresRefuseWhatTheyDoNotTake) {
  struct Case {
    DType q, out, cache;
    TestLayout layout;
    int d;
    const char* why;
  };
  for (const Case& k :
       {Case{DType::kFloat32, DType::kFloat32, DType::kFloat32, TestLayout::kNHD, 64, "q dtype"},
        Case{DType::kBFloat16, DType::kFloat32, DType::kBFloat16, TestLayout::kNHD, 64,
             "out dtype"},
        Case{DType::kBFloat16, DType::kBFloat16, DType::kFloat16, TestLayout::kNHD, 64,
             "cache dtype"},
        Case{DType::kBFloat16, DType::kBFloat16, DType::kBFloat16, TestLayout::kPadded, 64,
             "16-byte"},
        Case{DType::kBFloat16, DType::kBFloat16, DType::kBFloat16, TestLayout::kNHD, 512,
             "above 256"}}) {
    SCOPED_TRACE(k.why);
    AttnCase c;
    c.q_dtype = k.q;
    c.out_dtype = k.out;
    c.cache_dtype = k.cache;
    c.layout = k.layout;
    c.head_size = k.d;
    c.head_size_v = k.d;
    c.seqs = DecodeSeqs();
    AttnProblem pb(c);
    ExpectRefusedThenAutoMatches(pb, internal::DecodeKernel::kTensorCores, k.why);
  }
}

// The tensor-core kernel's GQA decode shapes: group sizes 1 / 4 / 8 / 32 (two head tiles),
// head sizes 64 / 80 / 128 / 256 and 192 / 128, fp8 per head, window + ALiBi + soft cap.
TEST_F(CudaDecodeTest, TensorCoreShapesAndFeatures) {
  struct Case {
    int group, d, dv;
    DType cache;
    int window;
    bool alibi;
    float cap;
  };
  for (const Case& k : {Case{1, 64, 64, DType::kBFloat16, 0, false, 0},
                        Case{4, 80, 80, DType::kFloat16, 0, false, 0},
                        Case{8, 128, 128, DType::kBFloat16, 0, false, 0},
                        Case{32, 128, 128, DType::kBFloat16, 0, false, 0},
                        Case{4, 256, 256, DType::kFloat16, 0, false, 0},
                        Case{4, 192, 128, DType::kBFloat16, 0, false, 0},
                        Case{4, 80, 80, DType::kFloat8E4M3, 100, true, 0},
                        Case{4, 128, 128, DType::kFloat8E5M2, 0, false, 5.0f},
                        Case{8, 128, 128, DType::kBFloat16, 70, true, 2.0f}}) {
    // Block sizes below, at and above the 64-key tile (128: tiles inside one block).
    for (int block_size : {1, 5, 16, 32, 128}) {
      SCOPED_TRACE(absl::StrCat("group ", k.group, " d ", k.d, "/", k.dv, " cache ",
                                ShortDType(k.cache), " window ", k.window, " bs ", block_size));
      AttnCase c;
      c.num_kv_heads = 2;
      c.group = k.group;
      c.head_size = k.d;
      c.head_size_v = k.dv;
      c.q_dtype = k.cache == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
      c.cache_dtype = k.cache;
      c.quant = IsFp8(k.cache) ? KvQuantMode::kPerHead : KvQuantMode::kNone;
      c.sliding_window = k.window;
      c.alibi = k.alibi;
      c.soft_cap = k.cap;
      c.scale = 0.3f;
      c.block_size = block_size;
      c.layout = block_size == 5 || block_size == 32 ? TestLayout::kHND : TestLayout::kNHD;
      c.seqs = {{0, 1}, {67, 1}, {6, 0}, {600, 1}, {127, 1}, {1000, 1}};
      ExpectTensorCoresMatch(c, {0, 1, 2, 5});
    }
  }
}

// The tensor-core kernel's fp8 stagings (DecodeFp8Staging) on the shapes where both exist
// (fp8 caches at padded head size 128, up to 8 query heads per KV head): kAuto must plan
// kInRegisters there, and kShared, kInRegisters and kAuto must each match the reference over
// both fp8 formats, per-tensor and per-head scales, K narrower than V, windows, ALiBi and
// soft caps, block sizes below, at and above the 64-key tile, the launcher's split choice
// and fixed ones.
TEST_F(CudaDecodeTest, Fp8StagingsMatchTheReference) {
  struct Case {
    int group, d;
    DType act, cache;
    KvQuantMode quant;
    int window, block_size;
    bool alibi;
    float cap;
  };
  for (const Case& k :
       {Case{4, 128, DType::kBFloat16, DType::kFloat8E4M3, KvQuantMode::kPerTensor, 0, 16,
             false, 0},
        Case{4, 128, DType::kFloat16, DType::kFloat8E4M3, KvQuantMode::kPerHead, 0, 5, false,
             0},
        Case{8, 128, DType::kBFloat16, DType::kFloat8E5M2, KvQuantMode::kPerHead, 70, 128,
             true, 0},
        Case{1, 96, DType::kFloat16, DType::kFloat8E5M2, KvQuantMode::kPerTensor, 0, 16,
             false, 3.0f}}) {
    AttnCase c;
    c.num_kv_heads = 2;
    c.group = k.group;
    c.head_size = k.d;
    c.head_size_v = 128;
    c.q_dtype = c.out_dtype = k.act;
    c.cache_dtype = k.cache;
    c.quant = k.quant;
    c.sliding_window = k.window;
    c.alibi = k.alibi;
    c.soft_cap = k.cap;
    c.scale = 0.3f;
    c.block_size = k.block_size;
    c.layout = k.block_size == 5 ? TestLayout::kHND : TestLayout::kNHD;
    c.seqs = {{0, 1}, {67, 1}, {6, 0}, {600, 1}, {127, 1}, {1000, 1}};
    SCOPED_TRACE(absl::StrCat("group ", k.group, " d ", k.d, " ", ShortDType(k.act), "/",
                              ShortDType(k.cache), " bs ", k.block_size));
    AttnProblem pb(c);
    auto dev = DeviceAttnProblem::Create(pb);
    ASSERT_TRUE(dev.ok()) << dev.status();
    for (const auto& [requested, planned] :
         {std::pair{internal::DecodeFp8Staging::kAuto, internal::DecodeFp8Staging::kInRegisters},
          std::pair{internal::DecodeFp8Staging::kShared, internal::DecodeFp8Staging::kShared},
          std::pair{internal::DecodeFp8Staging::kInRegisters,
                    internal::DecodeFp8Staging::kInRegisters}}) {
      absl::StatusOr<internal::DecodeFp8Staging> staging =
          PlannedFp8Staging((*dev)->params(), requested);
      ASSERT_TRUE(staging.ok()) << staging.status();
      EXPECT_STREQ(DecodeFp8StagingName(*staging), DecodeFp8StagingName(planned))
          << "requested " << DecodeFp8StagingName(requested);
      ExpectMatches(pb, {0, 1, 3}, {internal::DecodeKernel::kTensorCores}, requested);
    }
  }
}

// Where kInRegisters does not exist (fp8 caches at another padded head size or with more
// than 8 query heads per KV head, 16-bit caches), kAuto plans kShared and matches the
// reference.
TEST_F(CudaDecodeTest, Fp8AutoStagingIsSharedWhereInRegistersDoesNotExist) {
  struct Case {
    int group, d, dv;
    DType cache;
  };
  for (const Case& k :
       {Case{4, 64, 64, DType::kFloat8E4M3}, Case{4, 80, 160, DType::kFloat8E5M2},
        Case{12, 128, 128, DType::kFloat8E4M3}, Case{9, 128, 128, DType::kFloat8E5M2},
        Case{4, 128, 128, DType::kBFloat16}}) {
    SCOPED_TRACE(
        absl::StrCat("group ", k.group, " d ", k.d, "/", k.dv, " cache ", ShortDType(k.cache)));
    AttnCase c;
    c.num_kv_heads = 2;
    c.group = k.group;
    c.head_size = k.d;
    c.head_size_v = k.dv;
    c.q_dtype = c.out_dtype = DType::kBFloat16;
    c.cache_dtype = k.cache;
    c.quant = IsFp8(k.cache) ? KvQuantMode::kPerHead : KvQuantMode::kNone;
    c.scale = 0.3f;
    c.seqs = {{0, 1}, {67, 1}, {6, 0}, {600, 1}, {127, 1}};
    AttnProblem pb(c);
    auto dev = DeviceAttnProblem::Create(pb);
    ASSERT_TRUE(dev.ok()) << dev.status();
    absl::StatusOr<internal::DecodeFp8Staging> staging =
        PlannedFp8Staging((*dev)->params(), internal::DecodeFp8Staging::kAuto);
    ASSERT_TRUE(staging.ok()) << staging.status();
    EXPECT_STREQ(DecodeFp8StagingName(*staging),
                 DecodeFp8StagingName(internal::DecodeFp8Staging::kShared));
    ExpectMatches(pb, {0, 2}, {internal::DecodeKernel::kTensorCores},
                  internal::DecodeFp8Staging::kAuto);
  }
}

// Where kInRegisters does not exist, forcing it makes the launch say so (InvalidArgument,
// naming what it lacks) and write nothing; kAuto and kShared take the same launches.
TEST_F(CudaDecodeTest, InRegistersFp8StagingRefusesWhatItDoesNotTake) {
  struct Case {
    int group, d;
    DType cache;
    internal::DecodeKernel kernel;
    const char* why;
  };
  for (const Case& k :
       {Case{4, 64, DType::kFloat8E4M3, internal::DecodeKernel::kTensorCores,
             "padded head size 64"},
        Case{4, 128, DType::kBFloat16, internal::DecodeKernel::kTensorCores,
             "cache dtype bfloat16"},
        Case{12, 128, DType::kFloat8E4M3, internal::DecodeKernel::kTensorCores,
             "12 query heads per KV head"},
        Case{4, 128, DType::kFloat8E4M3, internal::DecodeKernel::kCudaCores,
             "needs the tensor-core kernel"}}) {
    SCOPED_TRACE(k.why);
    AttnCase c;
    c.num_kv_heads = 2;
    c.group = k.group;
    c.head_size = c.head_size_v = k.d;
    c.q_dtype = c.out_dtype = DType::kBFloat16;
    c.cache_dtype = k.cache;
    c.quant = IsFp8(k.cache) ? KvQuantMode::kPerTensor : KvQuantMode::kNone;
    c.block_size = 16;
    c.seqs = {{67, 1}, {300, 1}};
    AttnProblem pb(c);
    auto dev = DeviceAttnProblem::Create(pb);
    ASSERT_TRUE(dev.ok()) << dev.status();
    ASSERT_TRUE((*dev)->ResetOut().ok());
    const absl::Status st = Launch((*dev)->params(), 0, k.kernel, Merge::kMergeKernel,
                                   internal::DecodeFp8Staging::kInRegisters);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(k.why));
    auto out = (*dev)->Out();
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(*out, std::vector<uint8_t>(out->size(), AttnProblem::kSentinel))
        << "a refused launch wrote to the output";
    for (const auto staging :
         {internal::DecodeFp8Staging::kAuto, internal::DecodeFp8Staging::kShared}) {
      ExpectMatches(pb, {0}, {k.kernel}, staging);
    }
  }
}

// The tensor-core kernel lets a head's running max trail its scores by up to 2^8 (base 2)
// and moves it, rescaling the output, only past that. ALiBi slopes of both signs and many
// sizes give scores that climb past the trailing max in every tile, now and then, or never
// (falling from the first key on); a trailing max that moved too late would overflow P.
TEST_F(CudaDecodeTest, TensorCoresTrailingMaxOnClimbingAndFallingScores) {
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(ShortDType(dtype));
    AttnCase c;
    c.num_kv_heads = 2;
    c.group = 8;
    c.head_size = c.head_size_v = 128;
    c.q_dtype = c.out_dtype = c.cache_dtype = dtype;
    c.alibi = true;
    c.scale = 0.3f;
    c.seqs = {{1000, 1}, {63, 1}, {4000, 1}, {300, 1}};
    AttnProblem pb(c);
    pb.alibi_slopes() = {4.0f,  1.0f,   0.5f,  0.3f,  0.1f,  0.03f,  0.01f,  0.0f,
                         -0.01f, -0.1f, -0.5f, -4.0f, 2.0f,  0.2f,   -0.2f,  0.05f};
    ExpectMatches(pb, {0, 1, 3}, {internal::DecodeKernel::kTensorCores});
  }
}

// The TMA kernel's shapes: 4, 8 and 12 KV heads, groups 1 to 8, NHD and HND, both 16-bit
// dtypes, sliding windows that start inside a block, ALiBi and soft cap; sequences of one
// key, exactly one block, one block and a key, partial last blocks, thousands of keys, and
// none with no query. The rows the kernel copies with a block but must not use are NaN:
// past a sequence's end (AttnProblem leaves the cache NaN wherever no key was written) and
// before its window (written NaN here; the reference never reads them).
TEST_F(CudaDecodeTest, TmaShapesAndFeatures) {
  if (!tma_) GTEST_SKIP() << "the device has no TMA (compute capability below 9.0)";
  struct Case {
    int kv_heads, group;
    DType dtype;
    TestLayout layout;
    int window;
    bool alibi;
    float cap;
  };
  for (const Case& k : {Case{8, 4, DType::kBFloat16, TestLayout::kNHD, 0, false, 0.0f},
                        Case{4, 1, DType::kFloat16, TestLayout::kHND, 0, false, 0.0f},
                        Case{8, 8, DType::kBFloat16, TestLayout::kHND, 70, true, 0.0f},
                        Case{4, 4, DType::kFloat16, TestLayout::kNHD, 5, false, 3.0f},
                        Case{12, 3, DType::kBFloat16, TestLayout::kNHD, 1000, true, 2.0f}}) {
    SCOPED_TRACE(absl::StrCat(k.kv_heads, " KV heads, group ", k.group, ", ", ShortDType(k.dtype),
                              ", window ", k.window, ", layout ", static_cast<int>(k.layout)));
    AttnCase c;
    c.num_kv_heads = k.kv_heads;
    c.group = k.group;
    c.head_size = c.head_size_v = 128;
    c.block_size = 16;
    c.q_dtype = c.out_dtype = c.cache_dtype = k.dtype;
    c.layout = k.layout;
    c.sliding_window = k.window;
    c.alibi = k.alibi;
    c.soft_cap = k.cap;
    c.scale = 0.3f;
    c.seqs = {{0, 1}, {67, 1}, {6, 0}, {2047, 1}, {15, 1}, {16, 1}, {1000, 1}, {4100, 1}};
    AttnProblem pb(c);
    if (k.window > 0) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (size_t s = 0; s < c.seqs.size(); ++s) {
        for (int j = 0; j < pb.seq_len(s) - k.window; ++j) {
          for (int g = 0; g < c.num_kv_heads; ++g) {
            for (int d = 0; d < 128; ++d) {
              pb.SetCache(false, s, j, g, d, nan);
              pb.SetCache(true, s, j, g, d, nan);
            }
          }
        }
      }
    }
    auto dev = DeviceAttnProblem::Create(pb);
    ASSERT_TRUE(dev.ok()) << dev.status();
    ASSERT_TRUE(TmaApplies((*dev)->params()));
    // 64 splits: more than the short sequences have blocks, so some splits are empty.
    ExpectMatches(pb, {0, 1, 2, 5, 64}, {internal::DecodeKernel::kTensorCoresTma});
  }
}

// What the TMA kernel leaves to the others: kTensorCoresTma says why, kAuto falls back and
// matches the reference.
TEST_F(CudaDecodeTest, TmaRefusesWhatItDoesNotTake) {
  struct Case {
    int kv_heads, group, d, block_size;
    DType cache;
    const char* why;
  };
  for (const Case& k : {Case{2, 4, 128, 16, DType::kBFloat16, "num_kv_heads 2"},
                        Case{4, 4, 64, 16, DType::kBFloat16, "head sizes 64/64"},
                        Case{4, 4, 128, 32, DType::kBFloat16, "block size 32"},
                        Case{4, 16, 128, 16, DType::kBFloat16, "more than 8"},
                        Case{4, 4, 128, 16, DType::kFloat8E4M3, "fp8"}}) {
    SCOPED_TRACE(k.why);
    AttnCase c;
    c.num_kv_heads = k.kv_heads;
    c.group = k.group;
    c.head_size = c.head_size_v = k.d;
    c.block_size = k.block_size;
    c.q_dtype = c.out_dtype = DType::kBFloat16;
    c.cache_dtype = k.cache;
    c.quant = IsFp8(k.cache) ? KvQuantMode::kPerHead : KvQuantMode::kNone;
    c.seqs = DecodeSeqs();
    AttnProblem pb(c);
    ExpectRefusedThenAutoMatches(pb, internal::DecodeKernel::kTensorCoresTma,
                                 tma_ ? k.why : "the device has no TMA");
  }
}

// On the decode shape (8 KV heads, group 4, d 128, bf16, block size 16) kAuto runs
// the TMA kernel: the same bytes as kTensorCoresTma with the same (automatic) splits.
TEST_F(CudaDecodeTest, AutoRunsTheTmaKernelWhereItApplies) {
  if (!tma_) GTEST_SKIP() << "the device has no TMA (compute capability below 9.0)";
  AttnCase c = TmaCase(8, 4, DType::kBFloat16);
  c.seqs = {{4095, 1}, {4000, 1}, {1234, 1}, {4096, 1}};
  AttnProblem pb(c);
  auto dev = DeviceAttnProblem::Create(pb);
  ASSERT_TRUE(dev.ok()) << dev.status();
  std::vector<std::vector<uint8_t>> outs;
  for (const internal::DecodeKernel kernel :
       {internal::DecodeKernel::kAuto, internal::DecodeKernel::kTensorCoresTma,
        internal::DecodeKernel::kTensorCores}) {
    ASSERT_TRUE((*dev)->ResetOut().ok());
    const absl::Status st = Launch((*dev)->params(), 0, kernel);
    ASSERT_TRUE(st.ok()) << st;
    auto out = (*dev)->Out();
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectMatchesReference(pb, *out, KernelName(kernel));
    outs.push_back(*out);
  }
  EXPECT_EQ(outs[0], outs[1]) << "kAuto did not run the TMA kernel";
  EXPECT_NE(outs[0], outs[2]) << "the cp.async and TMA kernels agree to the bit: the check "
                                 "above cannot tell them apart";
}

// The decode shape with the TMA kernel's splits merged in the kernel (2 to 4
// splits): launches that reuse the same counters without zeroing them again each match
// the reference and give the merge kernel's bits, and each asks for one counter per
// (sequence, KV head); with more splits the merge kernel runs and no counters are asked.
TEST_F(CudaDecodeTest, TmaInKernelMergeReusesItsCounters) {
  if (!tma_) GTEST_SKIP() << "the device has no TMA (compute capability below 9.0)";
  AttnCase c = TmaCase(8, 4, DType::kBFloat16);
  c.seqs = {{8191, 1}, {3000, 1}, {0, 1}, {6, 0}, {4096, 1}, {17, 1}};
  AttnProblem pb(c);
  auto dev = DeviceAttnProblem::Create(pb);
  ASSERT_TRUE(dev.ok()) << dev.status();
  for (const int splits : {2, 3, 4, 5}) {
    SCOPED_TRACE(absl::StrCat(splits, " splits"));
    ASSERT_TRUE((*dev)->ResetOut().ok());
    ASSERT_TRUE(Launch((*dev)->params(), splits, internal::DecodeKernel::kTensorCoresTma,
                       Merge::kMergeKernel)
                    .ok());
    auto merged = (*dev)->Out();
    ASSERT_TRUE(merged.ok()) << merged.status();
    ExpectMatchesReference(pb, *merged, "merge kernel");
    for (int round = 0; round < 4; ++round) {
      const int requests = arrival_requests_;
      ASSERT_TRUE((*dev)->ResetOut().ok());
      const absl::Status st =
          Launch((*dev)->params(), splits, internal::DecodeKernel::kTensorCoresTma);
      ASSERT_TRUE(st.ok()) << st << " (round " << round << ")";
      EXPECT_EQ(arrival_requests_, requests + (splits <= 4 ? 1 : 0))
          << "counters asked for where they should not be, or not asked for";
      auto out = (*dev)->Out();
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(*out, *merged) << "round " << round;
    }
  }
  EXPECT_EQ(counters_.size(), c.seqs.size() * c.num_kv_heads * sizeof(uint32_t));
}

// The arrival counter provider's contract on the device: its error fails the launch with
// nothing written, a null or misaligned pointer is InvalidArgument, and launches that do
// not split (or whose kernel is not the TMA one) never ask.
TEST_F(CudaDecodeTest, TmaArrivalCounterProvider) {
  if (!tma_) GTEST_SKIP() << "the device has no TMA (compute capability below 9.0)";
  AttnCase c = TmaCase(4, 2, DType::kFloat16);
  c.seqs = {{900, 1}, {40, 1}};
  AttnProblem pb(c);
  auto dev = DeviceAttnProblem::Create(pb);
  ASSERT_TRUE(dev.ok()) << dev.status();
  auto kp = internal::MakePagedKernelParams((*dev)->params());
  ASSERT_TRUE(kp.ok()) << kp.status();
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_.get());
  auto workspace = DeviceBuffer::Create(1 << 20, MemoryKind::kDevice);
  ASSERT_TRUE(workspace.ok()) << workspace.status();
  internal::DecodeLaunchOptions options;
  options.num_sms = num_sms_;
  options.tma = true;
  options.dependent_merge = dependent_merge_;
  options.kernel = internal::DecodeKernel::kTensorCoresTma;
  options.num_splits = 3;
  options.workspace = [&workspace](size_t) -> absl::StatusOr<void*> { return workspace->data(); };
  std::vector<size_t> asked;
  options.arrival_counters = [&asked](size_t count) -> absl::StatusOr<uint32_t*> {
    asked.push_back(count);
    return absl::ResourceExhaustedError("test provider: no counters");
  };
  absl::Status st = internal::LaunchDecodeAttention(*kp, c.q_dtype, c.out_dtype, c.cache_dtype,
                                                    options, stream);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(asked, std::vector<size_t>{2 * 4});
  ASSERT_TRUE(stream_.Synchronize(absl::Seconds(60)).ok());
  auto out = (*dev)->Out();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, pb.NewOut()) << "wrote output despite the provider's error";

  auto counters = DeviceBuffer::Create(64, MemoryKind::kDevice);
  ASSERT_TRUE(counters.ok()) << counters.status();
  for (uint32_t* bad : {static_cast<uint32_t*>(nullptr),
                        reinterpret_cast<uint32_t*>(counters->data_as<char>() + 2)}) {
    options.arrival_counters = [bad](size_t) -> absl::StatusOr<uint32_t*> { return bad; };
    st = internal::LaunchDecodeAttention(*kp, c.q_dtype, c.out_dtype, c.cache_dtype, options,
                                         stream);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr("arrival counter provider"));
  }

  asked.clear();
  options.arrival_counters = [&asked](size_t count) -> absl::StatusOr<uint32_t*> {
    asked.push_back(count);
    return absl::ResourceExhaustedError("test provider: no counters");
  };
  options.num_splits = 1;
  EXPECT_TRUE(internal::LaunchDecodeAttention(*kp, c.q_dtype, c.out_dtype, c.cache_dtype,
                                              options, stream)
                  .ok());
  options.num_splits = 3;
  options.kernel = internal::DecodeKernel::kTensorCores;
  EXPECT_TRUE(internal::LaunchDecodeAttention(*kp, c.q_dtype, c.out_dtype, c.cache_dtype,
                                              options, stream)
                  .ok());
  EXPECT_TRUE(asked.empty());
  EXPECT_TRUE(stream_.Synchronize(absl::Seconds(60)).ok());
}

// ---------------------------------------------------------------------------------------
// Errors: validation through the host mirrors, and what the decode kernel does not take.

class CudaDecodeErrorTest : public CudaDecodeTest {
 protected:
  void SetUp() override {
    CudaDecodeTest::SetUp();
    if (IsSkipped()) return;
    AttnCase c;
    c.seqs = DecodeSeqs();
    pb_ = std::make_unique<AttnProblem>(c);
    auto dev = DeviceAttnProblem::Create(*pb_);
    ASSERT_TRUE(dev.ok()) << dev.status();
    dev_ = std::move(dev).value();
  }

  void ExpectInvalid(const PagedAttentionParams& p, const std::string& needle, int splits = 0) {
    const absl::Status st = Launch(p, splits);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(needle));
    auto out = dev_->Out();
    ASSERT_TRUE(out.ok());
    EXPECT_EQ(*out, pb_->NewOut()) << "wrote output despite the error";
  }

  std::unique_ptr<AttnProblem> pb_;
  std::unique_ptr<DeviceAttnProblem> dev_;
};

// The split choice (a host function: runs without a GPU). 132 SMs x 3 CTAs = 396 slots.
TEST(DecodeSplitChoiceTest, FewestSplitsWithAMostlyFullLastWave) {
  // 64 sequences x 8 KV heads, two full waves at least: 2 splits give 2.6 waves (last one
  // 86% full).
  EXPECT_EQ(internal::ChooseDecodeSplits(512, 396, 16, 2), 2);
  // 16 x 8: 7 splits are the fewest with 2 waves but leave a last wave 75% full; 8 do not.
  EXPECT_EQ(internal::ChooseDecodeSplits(128, 396, 128, 2), 8);
  // Never more than the keys allow, never fewer than one.
  EXPECT_EQ(internal::ChooseDecodeSplits(128, 396, 4, 2), 4);
  EXPECT_EQ(internal::ChooseDecodeSplits(1, 396, 1, 2), 1);
  // Enough CTAs without splitting.
  EXPECT_EQ(internal::ChooseDecodeSplits(4096, 396, 64, 2), 1);
  // Degenerate inputs stay in range instead of dividing by zero.
  EXPECT_EQ(internal::ChooseDecodeSplits(0, 0, 0, 0), 1);
}

// No full wave required (sequences of equal length): 132 SMs x 4 CTAs = 528 slots.
TEST(DecodeSplitChoiceTest, OneMostlyFullWaveWhenNoFullWaveIsRequired) {
  // 64 x 8 CTAs fill 97% of one wave unsplit (two full waves would take 3 splits).
  EXPECT_EQ(internal::ChooseDecodeSplits(512, 528, 16, 0), 1);
  EXPECT_EQ(internal::ChooseDecodeSplits(512, 528, 16, 2), 3);
  // 16 x 8: 3 splits fill 73% of a wave, 4 splits 97%.
  EXPECT_EQ(internal::ChooseDecodeSplits(128, 528, 128, 0), 4);
}

// One CTA per SM (the TMA kernel) with a higher bar for the wave's fill: 8 sequences x 2
// groups of 4 KV heads take 7 splits at the default 80% (112 of 132 SMs) and 8 at 94%.
TEST(DecodeSplitChoiceTest, AHigherFillBarTakesMoreSplits) {
  EXPECT_EQ(internal::ChooseDecodeSplits(16, 132, 64, 0), 7);
  EXPECT_EQ(internal::ChooseDecodeSplits(16, 132, 64, 0, 0.94), 8);
  // 64 x 2 and 16 x 2 groups: 1 and 4 splits either way (128 CTAs).
  EXPECT_EQ(internal::ChooseDecodeSplits(128, 132, 16, 0, 0.94), 1);
  EXPECT_EQ(internal::ChooseDecodeSplits(32, 132, 128, 0, 0.94), 4);
}

internal::PagedKernelParams BatchOf(std::vector<int32_t> seq_lens, int32_t sliding_window) {
  internal::PagedKernelParams p{};
  p.num_seqs = static_cast<int32_t>(seq_lens.size());
  p.sliding_window = sliding_window;
  for (int32_t len : seq_lens) {
    p.max_seq_len = std::max(p.max_seq_len, len);
    p.total_visible_keys += sliding_window > 0 ? std::min(len, sliding_window) : len;
  }
  return p;
}

TEST(DecodeSplitChoiceTest, NoFullWaveRequiredOnlyForSequencesOfAboutEqualLength) {
  EXPECT_EQ(internal::DecodeMinFullWaves(BatchOf({4096, 4096, 4096, 4096}, 0)), 0);
  EXPECT_EQ(internal::DecodeMinFullWaves(BatchOf({4096, 4090, 4000, 4096}, 0)), 0);
  EXPECT_EQ(internal::DecodeMinFullWaves(BatchOf({4096, 1024, 4096, 4096}, 0)), 2);
  // A window caps what the long sequences see: 5000 and 9000 keys both see 512.
  EXPECT_EQ(internal::DecodeMinFullWaves(BatchOf({5000, 9000}, 512)), 0);
  EXPECT_EQ(internal::DecodeMinFullWaves(BatchOf({5000, 9000}, 0)), 2);
  // Unknown lengths (no host mirror): as for uneven ones.
  internal::PagedKernelParams unknown = BatchOf({4096, 4096}, 0);
  unknown.total_visible_keys = 0;
  EXPECT_EQ(internal::DecodeMinFullWaves(unknown), 2);
}

// What the TMA kernel takes, decided on the host (no GPU needed): the decode shape
// in NHD and HND, and each thing it refuses, named.
TEST(DecodeTmaAppliesTest, TakesTheCommonShapeAndNamesWhatItRefuses) {
  alignas(16) static uint8_t cache[16];  // only the pointers' alignment is looked at
  auto shape = [](bool hnd) {
    internal::PagedKernelParams p{};
    p.k_cache = p.v_cache = cache;
    p.num_seqs = 16;
    p.max_query_len = 1;
    p.max_seq_len = 32768;
    p.num_heads = 32;
    p.num_kv_heads = 8;
    p.head_size = p.head_size_v = 128;
    p.block_size = 16;
    p.num_blocks = 16 * 2048;
    p.k_block_stride = p.v_block_stride = 16 * 8 * 128;
    p.k_token_stride = p.v_token_stride = hnd ? 128 : 8 * 128;
    p.k_head_stride = p.v_head_stride = hnd ? 16 * 128 : 128;
    return p;
  };
  const DType bf16 = DType::kBFloat16;
  for (const bool hnd : {false, true}) {
    std::string why;
    EXPECT_TRUE(internal::DecodeTmaApplies(shape(hnd), bf16, bf16, bf16, &why)) << why;
  }
  struct Case {
    std::function<void(internal::PagedKernelParams&)> change;
    DType cache;
    const char* why;
  };
  const std::vector<Case> cases = {
      {[](internal::PagedKernelParams&) {}, DType::kFloat8E4M3, "fp8"},
      {[](internal::PagedKernelParams& p) { p.head_size = p.head_size_v = 64; }, bf16,
       "head sizes 64/64"},
      {[](internal::PagedKernelParams& p) { p.head_size_v = 64; }, bf16, "head sizes 128/64"},
      {[](internal::PagedKernelParams& p) { p.block_size = 32; }, bf16, "block size 32"},
      {[](internal::PagedKernelParams& p) {
         p.num_kv_heads = 2;
         p.num_heads = 8;
       },
       bf16, "num_kv_heads 2"},
      {[](internal::PagedKernelParams& p) { p.num_heads = 8 * 16; }, bf16, "more than 8"},
      {[](internal::PagedKernelParams& p) { p.num_blocks = int64_t{1} << 32; }, bf16,
       "block count"},
      {[](internal::PagedKernelParams& p) { p.k_block_stride = int64_t{1} << 40; }, bf16,
       "stride"},
      {[](internal::PagedKernelParams& p) { p.max_query_len = 2; }, bf16, "max_query_len"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.why);
    internal::PagedKernelParams p = shape(false);
    k.change(p);
    std::string why;
    EXPECT_FALSE(internal::DecodeTmaApplies(p, bf16, bf16, k.cache, &why));
    EXPECT_THAT(why, HasSubstr(k.why));
  }
}

// The workspace provider's contract on the host side (no GPU needed: the launch plans,
// asks and checks before it touches the device): asked once by a launch that splits, for
// at least the partial results' bytes; its error returned as is; no provider, a null or a
// misaligned pointer are InvalidArgument. For both kernels.
TEST(DecodeWorkspaceProviderTest, AskedOnceForThePlannedBytes) {
  internal::PagedKernelParams p = BatchOf({4096, 4096}, 0);
  p.max_query_len = 1;
  p.num_tokens = 2;
  p.num_heads = 8;
  p.num_kv_heads = 2;
  p.head_size = p.head_size_v = 128;
  p.block_size = 16;
  p.num_blocks = 2 * 4096 / 16;
  p.block_table_stride = 4096 / 16;
  p.k_head_stride = p.v_head_stride = 128;
  p.k_token_stride = p.v_token_stride = 2 * 128;
  p.k_block_stride = p.v_block_stride = 16 * 2 * 128;
  p.q_head_stride = p.o_head_stride = 128;
  p.q_token_stride = p.o_token_stride = 8 * 128;
  p.scale = 0.088f;
  p.num_scales = 1;
  p.k_scale[0] = p.v_scale[0] = 1.0f;
  // Never dereferenced: nothing is launched. 16-byte aligned, as the kernels require.
  void* const fake = reinterpret_cast<void*>(uintptr_t{1} << 20);
  p.q = p.k_cache = p.v_cache = fake;
  p.out = fake;
  const size_t slots = size_t{2} * 8 * 4;  // sequences x heads x splits
  for (const auto& [kernel, dtype] :
       {std::pair{internal::DecodeKernel::kCudaCores, DType::kFloat32},
        std::pair{internal::DecodeKernel::kTensorCores, DType::kBFloat16}}) {
    SCOPED_TRACE(DTypeName(dtype));
    internal::DecodeLaunchOptions options;
    options.num_sms = 132;
    options.num_splits = 4;
    options.kernel = kernel;
    auto launch = [&] {
      return internal::LaunchDecodeAttention(p, dtype, dtype, dtype, options, nullptr);
    };
    absl::Status st = launch();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr("no workspace provider"));

    std::vector<size_t> asked;
    options.workspace = [&asked](size_t bytes) -> absl::StatusOr<void*> {
      asked.push_back(bytes);
      return absl::ResourceExhaustedError("test provider: out of workspace");
    };
    st = launch();
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr("test provider"));
    ASSERT_EQ(asked.size(), 1u);
    EXPECT_GE(asked[0], slots * (128 + 2) * sizeof(float));  // partial outputs, (max, sum)

    for (const uintptr_t bad : {uintptr_t{0}, (uintptr_t{1} << 20) + 4}) {
      options.workspace = [bad](size_t) -> absl::StatusOr<void*> {
        return reinterpret_cast<void*>(bad);
      };
      st = launch();
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_THAT(std::string(st.message()), HasSubstr("16-byte aligned"));
    }
  }
}

// The planner's count of visible keys comes from the host mirror of seq_lens.
TEST_F(CudaDecodeErrorTest, KernelParamsCountVisibleKeysFromTheHostMirror) {
  PagedAttentionParams p = dev_->params();
  ASSERT_NE(p.host.seq_lens, nullptr);
  for (const int32_t window : {0, 8}) {
    p.sliding_window = window;
    int64_t want = 0;
    for (int32_t i = 0; i < p.num_seqs; ++i) {
      want += window > 0 ? std::min(p.host.seq_lens[i], window) : p.host.seq_lens[i];
    }
    auto kp = internal::MakePagedKernelParams(p);
    ASSERT_TRUE(kp.ok()) << kp.status();
    EXPECT_GT(want, 0);
    EXPECT_EQ(kp->total_visible_keys, want) << "sliding_window " << window;
  }
}

TEST_F(CudaDecodeErrorTest, BadBlockIdInTheHostMirror) {
  PagedAttentionParams p = dev_->params();
  std::vector<int32_t> table = pb_->block_table();
  table[static_cast<size_t>(2 * p.block_table_stride)] = static_cast<int32_t>(pb_->num_blocks());
  p.host.block_table = table.data();
  ExpectInvalid(p, "sequence 2 block_table[0]");
  table = pb_->block_table();
  table[static_cast<size_t>(5 * p.block_table_stride)] = -1;
  p.host.block_table = table.data();
  ExpectInvalid(p, "sequence 5 block_table[0] = -1");
}

TEST_F(CudaDecodeErrorTest, MissingHostMirror) {
  PagedAttentionParams p = dev_->params();
  p.host.block_table = nullptr;
  ExpectInvalid(p, "host copies");
  p = dev_->params();
  p.alibi_slopes = static_cast<const float*>(p.q);  // any device pointer, never read
  p.host.alibi_slopes = nullptr;
  ExpectInvalid(p, "alibi");
}

TEST_F(CudaDecodeErrorTest, WhatTheDecodeKernelDoesNotTake) {
  PagedAttentionParams p = dev_->params();
  p.max_query_len = 2;  // a valid batch, but not a decode batch
  ExpectInvalid(p, "max_query_len");
  p = dev_->params();
  // A host cache is validated through the batch arrays themselves: point them at the host
  // copies, so that only the memory kind is wrong.
  p.cache.memory = MemoryKind::kHost;
  p.query_start_loc = p.host.query_start_loc;
  p.seq_lens = p.host.seq_lens;
  p.block_table = p.host.block_table;
  ExpectInvalid(p, "device memory");
  p = dev_->params();
  ExpectInvalid(p, "num_splits", /*splits=*/257);
}

TEST_F(CudaDecodeErrorTest, DimStridedCacheIsRejected) {
  AttnCase c;
  c.layout = TestLayout::kDimStrided;
  c.seqs = DecodeSeqs();
  AttnProblem pb(c);
  auto dev = DeviceAttnProblem::Create(pb);
  ASSERT_TRUE(dev.ok());
  const absl::Status st = Launch((*dev)->params(), 0);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("dim strides must be 1"));
}

// On the device: a provider's error fails the launch with nothing written, and a launch
// that does not split never asks (the contract's host side: DecodeWorkspaceProviderTest).
TEST_F(CudaDecodeErrorTest, WorkspaceProvider) {
  auto kp = internal::MakePagedKernelParams(dev_->params());
  ASSERT_TRUE(kp.ok()) << kp.status();
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_.get());
  internal::DecodeLaunchOptions options;
  options.num_sms = num_sms_;
  std::vector<size_t> asked;
  options.workspace = [&asked](size_t bytes) -> absl::StatusOr<void*> {
    asked.push_back(bytes);
    return absl::ResourceExhaustedError("test provider: out of workspace");
  };
  options.num_splits = 4;
  absl::Status st = internal::LaunchDecodeAttention(*kp, DType::kFloat32, DType::kFloat32,
                                                    DType::kFloat32, options, stream);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(asked.size(), 1u);
  ASSERT_TRUE(stream_.Synchronize(absl::Seconds(60)).ok());
  auto out = dev_->Out();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, pb_->NewOut()) << "wrote output despite the provider's error";

  asked.clear();
  options.num_splits = 1;
  st = internal::LaunchDecodeAttention(*kp, DType::kFloat32, DType::kFloat32, DType::kFloat32,
                                       options, stream);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_TRUE(asked.empty());
  EXPECT_TRUE(stream_.Synchronize(absl::Seconds(60)).ok());
}

TEST_F(CudaDecodeErrorTest, HeadSizeTooLarge) {
  AttnCase c;
  c.head_size = 520;
  c.head_size_v = 64;
  c.group = 1;
  c.seqs = {{3, 1}};
  AttnProblem pb(c);
  auto dev = DeviceAttnProblem::Create(pb);
  ASSERT_TRUE(dev.ok());
  const absl::Status st = Launch((*dev)->params(), 0);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("head sizes up to"));
}

}  // namespace
}  // namespace kvstream
