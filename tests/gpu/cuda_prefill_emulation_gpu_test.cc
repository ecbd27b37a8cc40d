// The CUDA prefill attention kernel (attention/src/cuda/prefill_attention.cuh) compiled by
// the host compiler and run under the warp emulator (warp_emulator.h), against the golden CPU reference.
// Needs no GPU: it checks the kernel's index math (packed GQA rows, page-table walks,
// swizzled shared memory, the ldmatrix / mma fragment layouts as the PTX ISA defines them,
// masks, online softmax, the copy pipeline's stages) wherever the CUDA headers exist.
//
// The emulator runs one CTA at a time; each CUDA thread is a fiber (ucontext) with its own
// stack, and every warp-collective operation (ldmatrix, mma, shuffle, __syncwarp) and
// __syncthreads is a barrier among the fibers concerned. cp.async copies land only at
// cp.async.wait_group, so a read of a tile before its wait sees stale data. Misaligned
// cp.async / ldmatrix addresses, out-of-bounds shared memory and divergent barriers
// (deadlock) are reported as failures.
#define KVSTREAM_CUDA_EMULATION 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention_test_util.h"
#include "cuda/kernel_params.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/common/dtype.h"
#include "warp_emulator.h"


#include "cuda/prefill_attention.cuh"  // NOLINT(build/include_order): after the emulation

#undef threadIdx
#undef blockIdx

namespace kvstream {
namespace {

using ::kvstream::testing_util::AttnCase;
using ::kvstream::testing_util::AttnProblem;
using ::kvstream::testing_util::ForEachQueryOutput;
using ::kvstream::testing_util::QueryOutput;
using ::kvstream::testing_util::SeqSpec;
using ::kvstream::testing_util::TestLayout;

// Runs the kernel for padded head size D and query type T over the whole grid.
using EmulationMode = ::kvstream::gpu_test::emulation::Cta::Mode;

template <int D, typename T, int Variant = internal::cuda::kPrefillBaseline>
absl::Status EmulateTyped(const internal::PagedKernelParams& kp,
                          const internal::cuda::PrefillOptions& options, EmulationMode mode) {
  using Traits = internal::cuda::PrefillTraits<D, Variant>;
  const bool fp8_async = options.load_mode == internal::cuda::kPrefillAsyncFp8;
  ::kvstream::gpu_test::emulation::Cta cta(Traits::kThreads,
                                     static_cast<size_t>(Traits::SmemBytes(fp8_async)));
  cta.set_mode(mode);
  const std::function<void()> body = [&] {
    internal::cuda::PrefillAttentionKernel<D, T, Variant>(kp, options);
  };
  for (unsigned y = 0; y < static_cast<unsigned>(kp.num_seqs); ++y) {
    for (unsigned x = 0; x < static_cast<unsigned>(kp.num_kv_heads * options.num_m_tiles);
         ++x) {
      if (!cta.Run(dim3(x, y), body)) {
        return absl::InternalError(absl::StrCat("block (", x, ", ", y, "): ", cta.error()));
      }
    }
  }
  return absl::OkStatus();
}

// The launcher's dispatch, with host memory standing in for device memory. `fast`: the
// fast variant, which must apply (PrefillFastApplies), as LaunchPrefillAttention's kFast.
absl::Status Emulate(const PagedAttentionParams& host, EmulationMode mode, bool fast) {
  PagedAttentionParams dev = host;
  dev.cache.memory = MemoryKind::kDevice;  // host pointers play the device's
  dev.host.query_start_loc = host.query_start_loc;
  dev.host.seq_lens = host.seq_lens;
  dev.host.block_table = host.block_table;
  dev.host.alibi_slopes = host.alibi_slopes;
  absl::StatusOr<internal::PagedKernelParams> kp = internal::MakePagedKernelParams(dev);
  if (!kp.ok()) return kp.status();
  const internal::cuda::PrefillOptions options =
      internal::cuda::ChoosePrefillOptions(*kp, host.cache.spec.dtype);
  const bool bf16 = host.q_dtype == DType::kBFloat16;
  if (fast) {
    constexpr int kFast = internal::cuda::kPrefillFast;
    if (!internal::cuda::PrefillFastApplies(*kp, options)) {
      return absl::InvalidArgumentError("the fast variant does not apply to this case");
    }
    if (internal::PaddedHeadDim(kp->head_size, kp->head_size_v) == 64) {
      return bf16 ? EmulateTyped<64, __nv_bfloat16, kFast>(*kp, options, mode)
                  : EmulateTyped<64, __half, kFast>(*kp, options, mode);
    }
    return bf16 ? EmulateTyped<128, __nv_bfloat16, kFast>(*kp, options, mode)
                : EmulateTyped<128, __half, kFast>(*kp, options, mode);
  }
  switch (internal::PaddedHeadDim(kp->head_size, kp->head_size_v)) {
    case 64:
      return bf16 ? EmulateTyped<64, __nv_bfloat16>(*kp, options, mode)
                  : EmulateTyped<64, __half>(*kp, options, mode);
    case 128:
      return bf16 ? EmulateTyped<128, __nv_bfloat16>(*kp, options, mode)
                  : EmulateTyped<128, __half>(*kp, options, mode);
    default:
      return bf16 ? EmulateTyped<256, __nv_bfloat16>(*kp, options, mode)
                  : EmulateTyped<256, __half>(*kp, options, mode);
  }
}

void ExpectEmulationMatchesReference(AttnProblem& pb, bool dense, EmulationMode mode,
                                     bool fast) {
  const AttnCase& c = pb.config();
  std::vector<uint8_t> ref_out = pb.NewOut();
  ASSERT_TRUE(RunAttentionReference(pb.params(ref_out)).ok());
  std::vector<uint8_t> out = pb.NewOut();
  PagedAttentionParams p = pb.params(out);
  const size_t e = DTypeSize(c.q_dtype);
  const int64_t q_row = int64_t{p.num_heads} * c.head_size;
  const int64_t o_row = int64_t{p.num_heads} * c.head_size_v;
  std::vector<uint8_t> dense_q, dense_out;
  if (dense) {
    // 16-byte aligned copies (vector storage is at least 16-byte aligned from operator new).
    dense_q.resize(static_cast<size_t>(p.num_tokens * q_row) * e);
    for (int64_t t = 0; t < p.num_tokens; ++t) {
      std::memcpy(dense_q.data() + t * q_row * e,
                  static_cast<const uint8_t*>(p.q) + t * p.q_token_stride * e,
                  static_cast<size_t>(q_row) * e);
    }
    dense_out.assign(static_cast<size_t>(p.num_tokens * o_row) * e, AttnProblem::kSentinel);
    p.q = dense_q.data();
    p.q_token_stride = q_row;
    p.out = dense_out.data();
    p.o_token_stride = o_row;
  }
  const absl::Status st = Emulate(p, mode, fast);
  ASSERT_TRUE(st.ok()) << st;
  if (dense) {
    for (int64_t t = 0; t < p.num_tokens; ++t) {
      std::memcpy(out.data() + t * pb.params(ref_out).o_token_stride * e,
                  dense_out.data() + t * o_row * e, static_cast<size_t>(o_row) * e);
    }
  }
  EXPECT_EQ(pb.CountStrayWrites(out), 0);
  const float tol = c.out_dtype == DType::kFloat16 ? 4e-3f : 1.2e-2f;
  int failures = 0;
  ForEachQueryOutput(pb, [&](const QueryOutput& o) {
    const auto [s, t, row, h, d] = o;
    const float want = pb.Out(ref_out, row, h, d);
    const float got = pb.Out(out, row, h, d);
    if (!(std::fabs(want - got) <= tol + 1e-2f * std::fabs(want)) && ++failures <= 5) {
      ADD_FAILURE() << "seq " << s << " token " << t << " head " << h << " d " << d
                    << ": reference " << want << " emulated kernel " << got;
    }
  });
  EXPECT_EQ(failures, 0);
}

struct EmuCase {
  const char* name;
  int head_size, head_size_v, kv_heads, group, block_size;
  DType q_dtype, cache_dtype;
  KvQuantMode quant;
  TestLayout layout;
  bool causal;
  int window;
  bool alibi;
  float cap;
  bool dense;
  bool long_batch = false;  // many query and key tiles
  bool fast = false;        // the fast variant (PrefillVariant::kFast) instead of the baseline
};

class CudaPrefillEmulationTest : public ::testing::TestWithParam<EmuCase> {};

TEST_P(CudaPrefillEmulationTest, KernelMatchesReference) {
  const EmuCase& ec = GetParam();
  AttnCase c;
  c.head_size = ec.head_size;
  c.head_size_v = ec.head_size_v;
  c.num_kv_heads = ec.kv_heads;
  c.group = ec.group;
  c.block_size = ec.block_size;
  c.q_dtype = ec.q_dtype;
  c.out_dtype = ec.q_dtype;
  c.cache_dtype = ec.cache_dtype;
  c.quant = ec.quant;
  c.layout = ec.layout;
  c.causal = ec.causal;
  c.sliding_window = ec.window;
  c.alibi = ec.alibi;
  c.soft_cap = ec.cap;
  c.scale = 0.3f;
  // Prefill across two query tiles and three key tiles, chunked prefill, decode rows, an
  // empty query.
  c.seqs = {{0, 70}, {75, 9}, {130, 1}, {0, 1}, {12, 0}};
  if (ec.long_batch) c.seqs = {{0, 300}, {100, 77}, {400, 1}, {3, 1}, {0, 5}};
  c.pad_tokens = 2;
  c.seed = 5;
  AttnProblem pb(c);
  for (EmulationMode mode : {EmulationMode{false, false}, EmulationMode{true, true}}) {
    SCOPED_TRACE(mode.copies_land_at_issue ? "copies land at issue, reverse order"
                                           : "copies land at wait, thread order");
    ExpectEmulationMatchesReference(pb, ec.dense, mode, ec.fast);
  }
}

constexpr DType kBf16 = DType::kBFloat16;
constexpr DType kF16 = DType::kFloat16;
INSTANTIATE_TEST_SUITE_P(
    Cases, CudaPrefillEmulationTest,
    ::testing::Values(
        EmuCase{"d128_bf16_gqa4_dense", 128, 128, 2, 4, 16, kBf16, kBf16, KvQuantMode::kNone,
                TestLayout::kNHD, true, 0, false, 0, true},
        EmuCase{"d128_f16_mha_strided_hnd_bs5", 128, 128, 2, 1, 5, kF16, kF16,
                KvQuantMode::kNone, TestLayout::kHND, true, 0, false, 0, false},
        EmuCase{"d64_bf16_window_alibi_cap_bs1", 64, 64, 1, 3, 1, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, true, 20, true, 2.0f, true},
        EmuCase{"d64_48_f16_bidir_window", 64, 48, 2, 2, 16, kF16, kF16, KvQuantMode::kNone,
                TestLayout::kHND, false, 30, false, 0, true},
        EmuCase{"d256_192_128_bf16_bidir", 192, 128, 1, 2, 16, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, false, 0, false, 0, true},
        EmuCase{"d128_e4m3_perhead_async", 128, 128, 2, 2, 16, kBf16, DType::kFloat8E4M3,
                KvQuantMode::kPerHead, TestLayout::kNHD, true, 0, true, 0, true},
        EmuCase{"d128_80_e5m2_element_path", 80, 80, 2, 2, 16, kF16, DType::kFloat8E5M2,
                KvQuantMode::kPerTensor, TestLayout::kHND, true, 0, false, 0, false},
        EmuCase{"d128_96_48_e4m3_padded_async", 96, 48, 2, 2, 16, kF16, DType::kFloat8E4M3,
                KvQuantMode::kPerTensor, TestLayout::kNHD, true, 0, false, 0, true},
        EmuCase{"d128_bf16_padded_layout", 128, 128, 2, 2, 16, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kPadded, true, 0, false, 0, false},
        EmuCase{"long_d128_bf16_gqa4_causal", 128, 128, 1, 4, 16, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, true, 0, false, 0, true, true},
        EmuCase{"long_d128_f16_causal_window5_alibi_cap", 128, 128, 1, 2, 16, kF16, kF16,
                KvQuantMode::kNone, TestLayout::kHND, true, 5, true, 30.0f, true, true},
        EmuCase{"long_d64_bf16_bidir_window70_mqa8_bs5", 64, 64, 1, 8, 5, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, false, 70, false, 0, false, true},
        EmuCase{"long_d256_f16_e5m2_perhead_bidir", 256, 256, 2, 1, 16, kF16,
                DType::kFloat8E5M2, KvQuantMode::kPerHead, TestLayout::kNHD, false, 0, false, 0,
                true, true},
        // The fast variant (compile-time steps; unmasked blocks computed and masked).
        EmuCase{"fast_d128_bf16_gqa4_causal", 128, 128, 2, 4, 16, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, true, 0, false, 0, true, false, true},
        EmuCase{"fast_d128_f16_gqa4_window_alibi_cap_bs5", 128, 128, 1, 4, 5, kF16, kF16,
                KvQuantMode::kNone, TestLayout::kHND, true, 20, true, 2.0f, false, false, true},
        EmuCase{"fast_long_d128_bf16_gqa4_causal_window70_alibi_cap", 128, 128, 1, 4, 16,
                kBf16, kBf16, KvQuantMode::kNone, TestLayout::kNHD, true, 70, true, 30.0f, true,
                true, true},
        EmuCase{"fast_d64_bf16_bidir_window_mqa8_bs5", 64, 64, 1, 8, 5, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, false, 30, false, 0, true, false, true}),
    [](const auto& test_info) { return std::string(test_info.param.name); });

}  // namespace
}  // namespace kvstream
