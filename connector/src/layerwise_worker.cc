// The layerwise connector's worker side (layerwise_connector.h): a producer side and/or a
// consumer side over one transport, the registered layers, the stats, and the progress
// thread that drives the transport for both.
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "consumer.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/connector/layer_routing.h"
#include "kvstream/connector/layerwise_connector.h"
#include "producer.h"
#include "worker_shared.h"

namespace kvstream {
namespace {

using internal::ConsumerSide;
using internal::LayerTable;
using internal::ProducerSide;
using internal::WorkerShared;

class LayerwiseWorker final : public KvConnectorWorker {
 public:
  LayerwiseWorker(KvTransferConfig config, std::unique_ptr<Transport> transport)
      : shared_(std::move(config), std::move(transport)) {
    if (shared_.config.kv_role != KvRole::kConsumer) {
      producer_ = std::make_unique<ProducerSide>(shared_);
    }
    if (shared_.config.kv_role != KvRole::kProducer) {
      consumer_ = std::make_unique<ConsumerSide>(shared_);
    }
  }

  ~LayerwiseWorker() override {
    shared_.stopping = true;
    if (progress_thread_.joinable()) progress_thread_.join();
    if (producer_) producer_->Stop();
    if (consumer_) consumer_->Stop();
    shared_.PublishLayers(nullptr);  // registrations go before the transport
  }

  absl::Status Start() {
    if (producer_) RETURN_IF_ERROR(producer_->Start());
    progress_thread_ = std::thread([this] { ProgressLoop(); });
    return absl::OkStatus();
  }

  KvRole role() const override { return shared_.config.kv_role; }
  const KvTransferConfig& config() const override { return shared_.config; }

  absl::StatusOr<std::shared_ptr<void>> AllocateCacheMemory(size_t bytes,
                                                            MemoryKind kind) override {
    ASSIGN_OR_RETURN(std::unique_ptr<MemoryRegistration> reg,
                     shared_.transport->AllocateMemory(bytes, kind));
    void* base = reg->base();
    // The registration owns the memory; the pointer's deleter releases it.
    std::shared_ptr<MemoryRegistration> owner(std::move(reg));
    return std::shared_ptr<void>(base, [owner](void*) mutable { owner.reset(); });
  }

  absl::Status SetModelInfo(const KvModelInfo& info) override {
    absl::MutexLock lock(&register_mu_);
    if (shared_.layers() != nullptr) {
      return absl::FailedPreconditionError(
          "SetModelInfo after RegisterKvCaches: the model goes into the compatibility hash");
    }
    if (info.vocab_size < 0 || info.max_model_len < 0) {
      return absl::InvalidArgumentError(absl::StrCat("model info: vocab_size ", info.vocab_size,
                                                     " and max_model_len ", info.max_model_len,
                                                     " must not be negative"));
    }
    if (info.fingerprint.size() > kMaxModelFingerprintBytes) {
      return absl::InvalidArgumentError(absl::StrCat("model info: the fingerprint is ",
                                                     info.fingerprint.size(),
                                                     " bytes, more than the limit of ",
                                                     kMaxModelFingerprintBytes));
    }
    model_ = info;
    return absl::OkStatus();
  }

  absl::Status RegisterKvCaches(const std::map<std::string, KvCache*>& caches) override {
    absl::MutexLock lock(&register_mu_);
    if (shared_.layers() != nullptr) {
      return absl::FailedPreconditionError("KV caches already registered");
    }
    ASSIGN_OR_RETURN(std::unique_ptr<LayerTable> table,
                     LayerTable::Create(caches, shared_.config.kvstream, model_,
                                        *shared_.transport));
    if (producer_) RETURN_IF_ERROR(producer_->Prepare(*table));
    if (consumer_) RETURN_IF_ERROR(consumer_->Prepare(*table));
    shared_.PublishLayers(std::move(table));
    return absl::OkStatus();
  }

  absl::Status BindConnectorMetadata(const KvConnectorMetadata& metadata) override {
    absl::Status status;
    if (consumer_) status.Update(consumer_->Bind(metadata));
    if (producer_) status.Update(producer_->Bind(metadata));
    return status;
  }

  absl::Status StartLoadKv() override {
    return consumer_ ? consumer_->StartLoads() : absl::OkStatus();
  }

  absl::Status BeforeAttention(absl::string_view layer_name, void* stream) override {
    // The transport delivers a layer's notice after its data is in place (for device
    // memory: after the copy completed on the device), so once the host has it, work the
    // stream runs from now on sees the data: nothing to enqueue on `stream`.
    return consumer_ ? consumer_->WaitForLayer(layer_name) : absl::OkStatus();
  }

  absl::Status AfterAttention(absl::string_view layer_name, const KvCache& kv_cache,
                              const AttentionMetadata& metadata, void* stream) override {
    return producer_ ? producer_->PostLayer(layer_name, kv_cache, stream) : absl::OkStatus();
  }

  absl::Status WaitForSave() override {
    return producer_ ? producer_->StepError() : absl::OkStatus();
  }

  void ClearConnectorMetadata() override {
    if (producer_) producer_->ClearStep();
    if (consumer_) consumer_->ClearStep();
  }

  absl::StatusOr<KvConnectorOutput> TakeOutput() override {
    KvConnectorOutput out;
    if (producer_) producer_->TakeOutput(out);
    if (consumer_) consumer_->TakeOutput(out);
    return out;
  }

  std::string control_address() const override {
    return producer_ ? producer_->control_address() : std::string();
  }

  ConnectorStats stats() const override {
    ConnectorStats s = shared_.stats.Totals();
    s.blocks_in_flight = 0;
    if (producer_) s.blocks_in_flight += producer_->BlocksInFlight(nullptr);
    if (consumer_) s.blocks_in_flight += consumer_->BlocksInFlight(nullptr);
    s.control_connections = 0;
    if (producer_) s.control_connections += producer_->connections();
    if (consumer_) s.control_connections += consumer_->connections();
    s.connections_refused = producer_ ? producer_->connections_refused() : 0;
    return s;
  }

  std::vector<PeerConnectorStats> peer_stats() const override {
    std::map<std::string, ConnectorStats> by_peer = shared_.stats.ByPeer();
    std::map<std::string, int64_t> blocks;
    if (producer_) producer_->BlocksInFlight(&blocks);
    if (consumer_) consumer_->BlocksInFlight(&blocks);
    for (auto& [peer, st] : by_peer) st.blocks_in_flight = 0;
    for (const auto& [peer, n] : blocks) by_peer[peer].blocks_in_flight += n;
    std::vector<PeerConnectorStats> out;
    for (auto& [peer, st] : by_peer) out.push_back({peer, st});
    return out;
  }

  std::vector<RequestTransferStats> TakeRequestStats() override {
    return consumer_ ? consumer_->TakeRequestStats() : std::vector<RequestTransferStats>();
  }
  std::vector<RequestSendStats> TakeSendStats() override {
    return producer_ ? producer_->TakeSendStats() : std::vector<RequestSendStats>();
  }

 private:
  void ProgressLoop() {
    Transport& transport = *shared_.transport;
    while (!shared_.stopping) {
      absl::Status s = transport.Progress();
      if (!s.ok()) Log(LogLevel::kWarning, absl::StrCat("transport progress: ", s.ToString()));
      bool busy = false;
      for (Notification& n : transport.PollNotifications()) {
        busy = true;
        if (consumer_) consumer_->OnNotice(n);
      }
      bool outstanding = false;
      if (producer_ && producer_->Poll()) outstanding = true;
      if (consumer_ && consumer_->Poll()) outstanding = true;
      shared_.outstanding = outstanding;
      if (busy) continue;
      // Idle: short naps while transfers are outstanding; otherwise up to 1 ms, cut short as
      // soon as something is posted or handed off (they set outstanding).
      for (int i = 0; i < 50 && !shared_.stopping; ++i) {
        absl::SleepFor(absl::Microseconds(20));
        if (shared_.outstanding.load()) break;
      }
    }
  }

  WorkerShared shared_;
  std::unique_ptr<ProducerSide> producer_;
  std::unique_ptr<ConsumerSide> consumer_;
  std::thread progress_thread_;
  absl::Mutex register_mu_;
  KvModelInfo model_ ABSL_GUARDED_BY(register_mu_);
};

}  // namespace

absl::Status ValidateLayerwiseConfig(const KvTransferConfig& config) {
  // The pipeline settings as ParseKvTransferConfig checks them, for configs built in code.
  const KvstreamSettings& k = config.kvstream;
  if (k.pipeline_parallel_size < 1 || k.pipeline_rank < 0 ||
      k.pipeline_rank >= k.pipeline_parallel_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LayerwiseConnector: pipeline_rank ", k.pipeline_rank,
        " must be in [0, pipeline_parallel_size) with pipeline_parallel_size >= 1, got size ",
        k.pipeline_parallel_size));
  }
  if (!k.pipeline_layers.empty()) {
    if (static_cast<int32_t>(k.pipeline_layers.size()) != k.pipeline_parallel_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "LayerwiseConnector: pipeline_layers ", FormatLayerRanges(k.pipeline_layers), " has ",
          k.pipeline_layers.size(), " stages but pipeline_parallel_size is ",
          k.pipeline_parallel_size));
    }
    RETURN_IF_ERROR(ValidatePipelinePartition(k.pipeline_layers));
  }
  if (k.max_connections < 1 || k.max_requests_per_consumer < 1 ||
      k.max_tokens_per_consumer < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LayerwiseConnector: max_connections ", k.max_connections,
        ", max_requests_per_consumer ", k.max_requests_per_consumer,
        " and max_tokens_per_consumer ", k.max_tokens_per_consumer, " must be at least 1"));
  }
  if (k.reconnect_backoff_ms < 0 || k.reconnect_backoff_max_ms < k.reconnect_backoff_ms) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LayerwiseConnector: reconnect_backoff_ms ", k.reconnect_backoff_ms,
        " must be at least 0 and reconnect_backoff_max_ms ", k.reconnect_backoff_max_ms,
        " at least that"));
  }
  if (k.pipeline_parallel_size > 1 && config.kv_role != KvRole::kConsumer) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LayerwiseConnector: pipeline_parallel_size ", k.pipeline_parallel_size,
        " needs kv_role kv_consumer (pipeline-parallel decode); this worker is ",
        KvRoleName(config.kv_role)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<KvConnectorWorker>> CreateLayerwiseWorker(
    const KvTransferConfig& config, std::unique_ptr<Transport> transport) {
  if (transport == nullptr) return absl::InvalidArgumentError("LayerwiseConnector: null transport");
  RETURN_IF_ERROR(ValidateLayerwiseConfig(config));
  auto w = std::make_unique<LayerwiseWorker>(config, std::move(transport));
  RETURN_IF_ERROR(w->Start());
  return w;
}

}  // namespace kvstream
