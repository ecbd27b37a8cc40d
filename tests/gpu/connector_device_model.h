// Shared by the connector's device-cache GPU test and its producer program
// (connector_device_gpu_peer_main.cc): a stack of CUDA attention layers over device caches,
// fed inputs both processes derive from a request's seed, and the step driving one batch
// through every layer (cache update, the hook, attention) the way an engine's forward pass
// does. Layers have independent inputs: the test is about the KV that moves, not a model.
#ifndef KVSTREAM_TESTS_GPU_CONNECTOR_DEVICE_MODEL_H_
#define KVSTREAM_TESTS_GPU_CONNECTOR_DEVICE_MODEL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvstream/attention/attention.h"
#include "kvstream/attention/layer_registry.h"
#include "kvstream/attention/metadata.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/common/tensor.h"

namespace kvstream {
namespace test {

inline constexpr int kDeviceLayers = 4;
inline constexpr int kDeviceHeads = 8;
inline constexpr int kDeviceKvHeads = 2;
inline constexpr int kDeviceHeadSize = 128;
inline constexpr int kDeviceBlock = 16;
inline constexpr int64_t kDeviceBlocks = 64;

inline std::string DeviceLayerName(int l) {
  return absl::StrCat("model.layers.", l, ".self_attn.attn");
}

// One sequence of a step: its schedule and the seed its inputs come from (the request's
// first prompt token).
struct DeviceSeq {
  SequenceSchedule schedule;
  uint32_t seed = 0;
};

inline absl::Status CudaCheck(cudaError_t e, absl::string_view what) {
  return e == cudaSuccess ? absl::OkStatus()
                          : absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

class DeviceModel {
 public:
  // Layers with the CUDA backend over device caches of kDeviceBlocks blocks: one
  // cudaMalloc per cache, or (`one_allocation`) all of them borrowed from a single
  // allocation, as an engine such as PyTorch hands out sub-ranges of its pool.
  absl::Status Init(bool one_allocation) {
    for (int l = 0; l < kDeviceLayers; ++l) {
      AttentionOptions o;
      o.num_heads = kDeviceHeads;
      o.num_kv_heads = kDeviceKvHeads;
      o.head_size = kDeviceHeadSize;
      o.scale = 1.0f / std::sqrt(static_cast<float>(kDeviceHeadSize));
      o.dtype = DType::kBFloat16;
      o.block_size = kDeviceBlock;
      o.prefix = DeviceLayerName(l);
      o.backend = "cuda";
      ASSIGN_OR_RETURN(std::unique_ptr<Attention> layer, Attention::Create(o, &registry_));
      spec_ = layer->kv_cache_spec();
      layers_.push_back(std::move(layer));
    }
    const size_t k_bytes = kDeviceBlocks * spec_.KBytesPerBlock();
    const size_t v_bytes = kDeviceBlocks * spec_.VBytesPerBlock();
    if (one_allocation) {
      // 4 KiB apart so that every region starts at its own offset inside the allocation.
      const size_t stride = (k_bytes + v_bytes + 8192) & ~size_t{4095};
      ASSIGN_OR_RETURN(arena_, DeviceBuffer::CreateZeroed(stride * kDeviceLayers + 4096,
                                                          MemoryKind::kDevice));
      for (int l = 0; l < kDeviceLayers; ++l) {
        char* base = arena_.data_as<char>() + 4096 + l * stride;
        const std::vector<int64_t> shape = {kDeviceBlocks, kDeviceBlock, kDeviceKvHeads,
                                            kDeviceHeadSize};
        TensorView k(base, DType::kBFloat16, shape, MemoryKind::kDevice);
        TensorView v(base + k_bytes, DType::kBFloat16, shape, MemoryKind::kDevice);
        ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Borrow(spec_, k, v));
        caches_.push_back(std::move(cache));
      }
    } else {
      for (int l = 0; l < kDeviceLayers; ++l) {
        KvCache::Options co;
        co.spec = spec_;
        co.num_blocks = kDeviceBlocks;
        co.memory = MemoryKind::kDevice;
        ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, KvCache::Create(co));
        caches_.push_back(std::move(cache));
      }
    }
    for (int l = 0; l < kDeviceLayers; ++l) {
      RETURN_IF_ERROR(registry_.BindKvCache(DeviceLayerName(l), caches_[l].get()));
    }
    return absl::OkStatus();
  }

  std::map<std::string, KvCache*> Caches() const {
    std::map<std::string, KvCache*> m;
    for (int l = 0; l < kDeviceLayers; ++l) m[DeviceLayerName(l)] = caches_[l].get();
    return m;
  }
  KvCache& cache(int l) { return *caches_[l]; }
  LayerRegistry& registry() { return registry_; }

  // Runs the batch through every layer (cache update, hook, attention); `after_layer(l)`
  // runs after layer l. Returns each layer's output rows, on the host, in batch order.
  absl::StatusOr<std::vector<std::vector<uint16_t>>> Step(
      const std::vector<DeviceSeq>& seqs, const std::function<void(int)>& after_layer = {}) {
    std::vector<SequenceSchedule> schedules;
    for (const DeviceSeq& s : seqs) schedules.push_back(s.schedule);
    ASSIGN_OR_RETURN(AttentionMetadata md, BuildAttentionMetadata(schedules, kDeviceBlock));
    const int64_t tokens = md.num_actual_tokens;
    ASSIGN_OR_RETURN(DeviceBuffer qsl, Upload(md.query_start_loc));
    ASSIGN_OR_RETURN(DeviceBuffer lens, Upload(md.seq_lens));
    ASSIGN_OR_RETURN(DeviceBuffer table, Upload(md.block_table));
    ASSIGN_OR_RETURN(DeviceBuffer slots, Upload(md.slot_mapping));
    DeviceAttentionMetadata dmd;
    dmd.query_start_loc = qsl.data_as<int32_t>();
    dmd.seq_lens = lens.data_as<int32_t>();
    dmd.block_table = table.data_as<int32_t>();
    dmd.slot_mapping = slots.data_as<int64_t>();
    ForwardContext context;
    context.metadata = &md;
    context.device = &dmd;
    registry_.SetForwardContext(context);
    std::vector<std::vector<uint16_t>> outputs;
    absl::Status status;
    for (int l = 0; l < kDeviceLayers && status.ok(); ++l) {
      std::vector<uint16_t> q, k, v;
      for (const DeviceSeq& s : seqs) {
        for (int32_t p = s.schedule.context_len; p < s.schedule.context_len + s.schedule.query_len;
             ++p) {
          AppendRow(s.seed, l, p, 0, kDeviceHeads * kDeviceHeadSize, q);
          AppendRow(s.seed, l, p, 1, kDeviceKvHeads * kDeviceHeadSize, k);
          AppendRow(s.seed, l, p, 2, kDeviceKvHeads * kDeviceHeadSize, v);
        }
      }
      absl::StatusOr<DeviceBuffer> dq = Upload(q), dk = Upload(k), dv = Upload(v);
      absl::StatusOr<DeviceBuffer> dout = DeviceBuffer::CreateZeroed(q.size() * 2, MemoryKind::kDevice);
      if (!dq.ok() || !dk.ok() || !dv.ok() || !dout.ok()) {
        status = absl::InternalError("uploading a layer's inputs");
        break;
      }
      TensorView gq(dq->data(), DType::kBFloat16, {tokens, kDeviceHeads * kDeviceHeadSize},
                    MemoryKind::kDevice);
      TensorView gk(dk->data(), DType::kBFloat16, {tokens, kDeviceKvHeads * kDeviceHeadSize},
                    MemoryKind::kDevice);
      TensorView gv(dv->data(), DType::kBFloat16, {tokens, kDeviceKvHeads * kDeviceHeadSize},
                    MemoryKind::kDevice);
      TensorView gout(dout->data(), DType::kBFloat16, {tokens, kDeviceHeads * kDeviceHeadSize},
                      MemoryKind::kDevice);
      status = layers_[l]->Forward(gq, gk, gv, gout);
      if (!status.ok()) break;
      if (after_layer) after_layer(l);
      // The inputs must outlive the layer's work on its stream.
      status = CudaCheck(cudaDeviceSynchronize(), "layer synchronize");
      std::vector<uint16_t> host(q.size());
      if (status.ok()) {
        status = CudaCheck(cudaMemcpy(host.data(), dout->data(), host.size() * 2,
                                      cudaMemcpyDeviceToHost),
                           "output download");
      }
      outputs.push_back(std::move(host));
    }
    registry_.SetForwardContext({});
    RETURN_IF_ERROR(status);
    return outputs;
  }

  // The K and V bytes of one token of one layer (every head), from the device.
  absl::StatusOr<std::vector<char>> TokenBytes(int layer, int32_t block, int32_t offset) {
    const KvCacheView v = caches_[layer]->view();
    const size_t es = 2;
    std::vector<char> out;
    for (int h = 0; h < kDeviceKvHeads; ++h) {
      for (int t = 0; t < 2; ++t) {
        const CacheStrides& s = t == 0 ? v.k_strides : v.v_strides;
        const char* base = static_cast<const char*>(t == 0 ? v.k : v.v) +
                           s.Offset(block, offset, h, 0) * es;
        std::vector<char> row(kDeviceHeadSize * es);
        RETURN_IF_ERROR(CudaCheck(cudaMemcpy(row.data(), base, row.size(), cudaMemcpyDeviceToHost),
                                  "token download"));
        out.insert(out.end(), row.begin(), row.end());
      }
    }
    return out;
  }

 private:
  template <typename T>
  static absl::StatusOr<DeviceBuffer> Upload(const std::vector<T>& v) {
    ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Create(std::max<size_t>(v.size() * sizeof(T), 16),
                                                          MemoryKind::kDevice));
    if (!v.empty()) {
      RETURN_IF_ERROR(CudaCheck(cudaMemcpy(b.data(), v.data(), v.size() * sizeof(T),
                                           cudaMemcpyHostToDevice),
                                "upload"));
    }
    return b;
  }

  // bf16 values in [-1, 1) for (seed, layer, position, tensor), independent of the batch.
  static void AppendRow(uint32_t seed, int layer, int32_t position, int tensor, int width,
                        std::vector<uint16_t>& out) {
    std::mt19937 rng(seed * 1000003u + static_cast<uint32_t>(layer) * 7919u +
                     static_cast<uint32_t>(position) * 31u + static_cast<uint32_t>(tensor));
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (int i = 0; i < width; ++i) {
      float f = dist(rng);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      out.push_back(static_cast<uint16_t>(u >> 16));  // truncation is fine for test inputs
    }
  }

  DeviceBuffer arena_;  // first: freed after the caches borrowed from it
  LayerRegistry registry_;
  std::vector<std::unique_ptr<Attention>> layers_;
  std::vector<std::unique_ptr<KvCache>> caches_;
  KvCacheSpec spec_;
};

}  // namespace test
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_GPU_CONNECTOR_DEVICE_MODEL_H_
