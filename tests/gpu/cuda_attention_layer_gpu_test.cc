// The Attention layer end to end on the GPU: a layer with backend "cuda" over a device cache,
// fed device tensors and the step's device metadata, against the same layer with backend
// "cpu" over a host cache. The cache contents must be identical bytes (the cache updates are
// bit-exact) and the outputs close; a missing device metadata is a clear error.
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "gpu_test_util.h"
#include "kvstream/attention/attention.h"
#include "kvstream/attention/layer_registry.h"
#include "kvstream/attention/metadata.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/tensor.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;

Tensor Random(std::vector<int64_t> shape, DType dtype, uint32_t seed) {
  Tensor t = Tensor::Zeros(std::move(shape), dtype);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.SetFloat(i, dist(rng));
  return t;
}

struct LayerCase {
  std::string name;
  DType dtype;
  std::string cache_dtype;
  int block_size;
  bool alibi;
};

class CudaAttentionLayerTest : public ::testing::TestWithParam<LayerCase> {};

TEST_P(CudaAttentionLayerTest, MatchesTheCpuLayer) {
  KVSTREAM_SKIP_WITHOUT_GPU();
  const LayerCase& c = GetParam();
  AttentionOptions o;
  o.num_heads = 8;
  o.num_kv_heads = 2;
  o.head_size = 128;
  o.scale = 1.0f / std::sqrt(128.0f);
  o.dtype = c.dtype;
  o.kv_cache_dtype = c.cache_dtype;
  o.block_size = c.block_size;
  o.prefix = "model.layers.0.self_attn.attn";
  if (c.alibi) {
    for (int h = 0; h < o.num_heads; ++h) o.alibi_slopes.push_back(0.05f * (h + 1));
  }
  LayerRegistry cpu_registry, gpu_registry;
  AttentionOptions cpu_options = o, gpu_options = o;
  cpu_options.backend = "cpu";
  gpu_options.backend = "cuda";
  auto cpu_layer = Attention::Create(cpu_options, &cpu_registry);
  ASSERT_TRUE(cpu_layer.ok()) << cpu_layer.status();
  auto gpu_layer = Attention::Create(gpu_options, &gpu_registry);
  ASSERT_TRUE(gpu_layer.ok()) << gpu_layer.status();
  const KvCacheSpec spec = (*cpu_layer)->kv_cache_spec();

  const int64_t num_blocks = 64;
  KvCache::Options host_cache_options;
  host_cache_options.spec = spec;
  host_cache_options.num_blocks = num_blocks;
  KvCache::Options device_cache_options = host_cache_options;
  device_cache_options.memory = MemoryKind::kDevice;
  auto host_cache = KvCache::Create(host_cache_options);
  ASSERT_TRUE(host_cache.ok()) << host_cache.status();
  auto device_cache = KvCache::Create(device_cache_options);
  ASSERT_TRUE(device_cache.ok()) << device_cache.status();
  if (IsFp8(spec.dtype)) {
    ASSERT_TRUE((*host_cache)->SetScales({0.01f}, {0.02f}).ok());
    ASSERT_TRUE((*device_cache)->SetScales({0.01f}, {0.02f}).ok());
  }
  ASSERT_TRUE(cpu_registry.BindKvCache(o.prefix, host_cache->get()).ok());
  ASSERT_TRUE(gpu_registry.BindKvCache(o.prefix, device_cache->get()).ok());

  // Two steps: a prefill of two prompts (block ids scattered), then a mixed step with a
  // decode row and a chunk of new tokens after a cached prefix.
  const std::vector<std::vector<SequenceSchedule>> steps = {
      {{0, 37, {5, 9, 2}}, {0, 20, {11, 3}}},
      {{37, 1, {5, 9, 2}}, {20, 13, {11, 3, 40}}},
  };
  for (size_t step = 0; step < steps.size(); ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    // Block ids must cover seq_len for this block size; the rows above assume 16-token
    // blocks, so scale the tables for smaller blocks.
    std::vector<SequenceSchedule> seqs = steps[step];
    for (SequenceSchedule& s : seqs) {
      const int needed = (s.context_len + s.query_len + c.block_size - 1) / c.block_size;
      std::vector<int32_t> ids;
      for (int b = 0; b < needed; ++b) ids.push_back((s.block_ids[0] + 7 * b) % num_blocks);
      s.block_ids = ids;
    }
    auto md = BuildAttentionMetadata(seqs, c.block_size);
    ASSERT_TRUE(md.ok()) << md.status();
    const int64_t tokens = md->num_actual_tokens;
    Tensor q = Random({tokens, 8 * 128}, c.dtype, 11 + step);
    Tensor k = Random({tokens, 2 * 128}, c.dtype, 21 + step);
    Tensor v = Random({tokens, 2 * 128}, c.dtype, 31 + step);
    Tensor cpu_out = Tensor::Zeros({tokens, 8 * 128}, c.dtype);

    cpu_registry.SetForwardContext({&*md});
    ASSERT_TRUE((*cpu_layer)->Forward(q.view(), k.view(), v.view(), cpu_out.view()).ok());

    const size_t es = DTypeSize(c.dtype);
    absl::StatusOr<DeviceBuffer> dq = gpu_test::ToDevice(q.view().data(), q.numel() * es);
    absl::StatusOr<DeviceBuffer> dk = gpu_test::ToDevice(k.view().data(), k.numel() * es);
    absl::StatusOr<DeviceBuffer> dv = gpu_test::ToDevice(v.view().data(), v.numel() * es);
    ASSERT_TRUE(dq.ok() && dk.ok() && dv.ok());
    absl::StatusOr<DeviceBuffer> dout =
        DeviceBuffer::CreateZeroed(cpu_out.numel() * es, MemoryKind::kDevice);
    ASSERT_TRUE(dout.ok()) << dout.status();
    absl::StatusOr<DeviceBuffer> qsl = gpu_test::ToDevice(md->query_start_loc);
    absl::StatusOr<DeviceBuffer> lens = gpu_test::ToDevice(md->seq_lens);
    absl::StatusOr<DeviceBuffer> table = gpu_test::ToDevice(md->block_table);
    absl::StatusOr<DeviceBuffer> slots = gpu_test::ToDevice(md->slot_mapping);
    ASSERT_TRUE(qsl.ok() && lens.ok() && table.ok() && slots.ok());
    DeviceAttentionMetadata dmd;
    dmd.query_start_loc = qsl->data_as<int32_t>();
    dmd.seq_lens = lens->data_as<int32_t>();
    dmd.block_table = table->data_as<int32_t>();
    dmd.slot_mapping = slots->data_as<int64_t>();

    TensorView gq(dq->data(), c.dtype, {tokens, 8 * 128}, MemoryKind::kDevice);
    TensorView gk(dk->data(), c.dtype, {tokens, 2 * 128}, MemoryKind::kDevice);
    TensorView gv(dv->data(), c.dtype, {tokens, 2 * 128}, MemoryKind::kDevice);
    TensorView gout(dout->data(), c.dtype, {tokens, 8 * 128}, MemoryKind::kDevice);

    // Without the device metadata the layer refuses, naming what is missing.
    gpu_registry.SetForwardContext({&*md});
    absl::Status missing = (*gpu_layer)->Forward(gq, gk, gv, gout);
    EXPECT_EQ(missing.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(missing.message()), HasSubstr("ForwardContext::device"));

    ForwardContext context;
    context.metadata = &*md;
    context.device = &dmd;
    gpu_registry.SetForwardContext(context);
    absl::Status st = (*gpu_layer)->Forward(gq, gk, gv, gout);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    // The caches hold the same bytes.
    const KvCacheView hv = (*host_cache)->view(), dvw = (*device_cache)->view();
    const size_t k_bytes = static_cast<size_t>(num_blocks) * spec.KBytesPerBlock();
    const size_t v_bytes = static_cast<size_t>(num_blocks) * spec.VBytesPerBlock();
    std::vector<char> k_back(k_bytes), v_back(v_bytes);
    ASSERT_TRUE(gpu_test::ToHost(dvw.k, k_bytes, k_back.data()).ok());
    ASSERT_TRUE(gpu_test::ToHost(dvw.v, v_bytes, v_back.data()).ok());
    EXPECT_EQ(std::memcmp(k_back.data(), hv.k, k_bytes), 0) << "K cache differs";
    EXPECT_EQ(std::memcmp(v_back.data(), hv.v, v_bytes), 0) << "V cache differs";

    // The outputs agree within the tolerance of 16-bit arithmetic.
    Tensor got = Tensor::Zeros({tokens, 8 * 128}, c.dtype);
    ASSERT_TRUE(gpu_test::ToHost(dout->data(), got.nbytes(), got.view().data()).ok());
    double worst = 0;
    for (int64_t i = 0; i < cpu_out.numel(); ++i) {
      const double a = got.GetFloat(i), b = cpu_out.GetFloat(i);
      ASSERT_FALSE(std::isnan(a)) << "NaN at " << i;
      worst = std::max(worst, std::abs(a - b));
    }
    EXPECT_LE(worst, c.dtype == DType::kFloat16 ? 4e-3 : 1.6e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layers, CudaAttentionLayerTest,
    ::testing::Values(LayerCase{"bf16", DType::kBFloat16, "auto", 16, false},
                      LayerCase{"fp16_block5_alibi", DType::kFloat16, "auto", 5, true},
                      LayerCase{"bf16_fp8", DType::kBFloat16, "fp8_e4m3", 16, false}),
    [](const ::testing::TestParamInfo<LayerCase>& p) { return p.param.name; });

}  // namespace
}  // namespace kvstream
