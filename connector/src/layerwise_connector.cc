// LayerwiseConnector (layerwise_connector.h): push-mode, layer-by-layer KV streaming.
#include "kvstream/connector/layerwise_connector.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <xxhash.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/connector/block_copy_plan.h"
#include "kvstream/connector/layer_name.h"
#include "kvstream/connector/layer_routing.h"
#include "kvstream/transfer/control_channel.h"
#include "kvstream/transfer/wire.h"

namespace kvstream {
namespace {

// ---- Layer notifications: "KVN1" | u16 id_len | id | u32 layer | u64 bytes | u8 has_sum |
// u64 checksum | u64 post time (ns, CLOCK_MONOTONIC: comparable between processes of one
// host), little-endian. Decoded strictly; an undecodable one is logged and dropped.

constexpr char kNoticeMagic[4] = {'K', 'V', 'N', '1'};

struct LayerNotice {
  std::string request_id;
  uint32_t layer = 0;
  uint64_t bytes = 0;
  bool has_checksum = false;
  uint64_t checksum = 0;
  uint64_t post_ns = 0;
};

uint64_t MonotonicNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

void PutLe(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLe(const char* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

std::string EncodeNotice(const LayerNotice& n) {
  std::string out(kNoticeMagic, 4);
  PutLe(out, n.request_id.size(), 2);
  out += n.request_id;
  PutLe(out, n.layer, 4);
  PutLe(out, n.bytes, 8);
  PutLe(out, n.has_checksum ? 1 : 0, 1);
  PutLe(out, n.checksum, 8);
  PutLe(out, n.post_ns, 8);
  return out;
}

absl::StatusOr<LayerNotice> DecodeNotice(absl::string_view in) {
  if (in.size() < 6 || std::memcmp(in.data(), kNoticeMagic, 4) != 0) {
    return absl::InvalidArgumentError("layer notification: bad magic or truncated");
  }
  const size_t id_len = GetLe(in.data() + 4, 2);
  if (id_len > kMaxIdBytes || in.size() != 6 + id_len + 4 + 8 + 1 + 8 + 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer notification: size ", in.size(), " does not match id length ", id_len));
  }
  LayerNotice n;
  const char* p = in.data() + 6;
  n.request_id.assign(p, id_len);
  p += id_len;
  n.layer = static_cast<uint32_t>(GetLe(p, 4));
  n.bytes = GetLe(p + 4, 8);
  const uint64_t flag = GetLe(p + 12, 1);
  if (flag > 1) return absl::InvalidArgumentError("layer notification: bad checksum flag");
  n.has_checksum = flag == 1;
  n.checksum = GetLe(p + 13, 8);
  n.post_ns = GetLe(p + 21, 8);
  return n;
}

absl::Status StatusFromCode(int32_t code, absl::string_view message) {
  if (code <= 0 || code > 16) return absl::UnknownError(message);
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

// One registered layer (only layers that own their cache; sharing layers are not sent).
struct LayerEntry {
  std::string name;
  int32_t index = 0;
  KvCache* cache = nullptr;
  std::unique_ptr<MemoryRegistration> k_reg;
  std::unique_ptr<MemoryRegistration> v_reg;
};

// Producer side: one connected consumer.
struct ConsumerLink {
  std::string engine_id;
  PeerId peer = 0;
  int64_t remote_num_blocks = 0;
  // The layers it registered, which are the layers it receives: all of ours, or one
  // pipeline stage's range of them.
  std::set<int32_t> layers;
  // By layer index: the consumer's K and V regions.
  std::map<int32_t, std::pair<std::unique_ptr<RemoteMemory>, std::unique_ptr<RemoteMemory>>>
      regions;
  std::atomic<bool> alive{true};
};

// Consumer side: one producer we hand requests to.
struct ProducerLink {
  std::unique_ptr<ControlConnection> conn;
  std::string address;
  std::string engine_id;  // from its hello
  std::atomic<bool> alive{true};
};

// Consumer-side state of a request whose KV comes from a producer.
struct RecvRequest {
  std::string id;
  std::vector<int32_t> prompt;
  std::vector<int32_t> blocks;
  int32_t num_tokens = 0;
  std::string producer;     // address key of the ProducerLink
  std::string producer_id;  // its engine id once handed off (metrics label)
  std::vector<uint8_t> arrived;
  int arrived_count = 0;
  bool handed_off = false;
  bool failed = false;
  absl::Status error;
  bool error_reported = false;
  bool producer_stopped = false;  // no write can land any more
  absl::Time abort_deadline = absl::InfiniteFuture();
  bool engine_finished = false;
  absl::Time handoff_time;
  std::vector<double> layer_ms;
  double transfer_ms = 0;  // sum over layers of (arrival - post), same-host clocks
  std::vector<uint64_t> post_ns;     // per layer: when the producer posted it
  std::vector<uint64_t> arrival_ns;  // per layer: when it was verified here
  double exposed_ms = 0;
  uint64_t bytes = 0;
  double wait_ms = 0;
  bool stats_reported = false;
};

// Producer side: one consumer that handed a request over, and where its blocks are.
struct SendDestination {
  std::shared_ptr<ConsumerLink> link;
  std::vector<int32_t> dest_blocks;
};

// Producer-side state of a request handed over by a consumer, or by every stage of a
// pipeline-parallel decode group (each stage hands the request over for its own layers).
struct SendRequest {
  std::string id;
  std::vector<SendDestination> dests;
  std::map<int32_t, size_t> route;  // layer index -> index in dests
  // Every layer has a destination, so the request was given to the engine to prefill.
  bool released = false;
  absl::Time gather_deadline = absl::InfiniteFuture();  // for the hand-offs still missing
  std::vector<int32_t> prompt;
  int32_t num_tokens = 0;
  std::vector<int32_t> local_blocks;
  bool save_scheduled = false;
  std::set<int32_t> layers_posted;
  std::vector<TransferId> pending;
  bool failed = false;
  std::string stop_reason;
  bool stop_notified = false;
  absl::Time deadline = absl::InfiniteFuture();
  bool engine_finished = false;
};

class LayerwiseConnectorImpl final : public KvConnector {
 public:
  LayerwiseConnectorImpl(KvTransferConfig config, std::unique_ptr<Transport> transport)
      : config_(std::move(config)), transport_(std::move(transport)) {}
  ~LayerwiseConnectorImpl() override { Shutdown(); }

  absl::Status Start() {
    if (is_producer()) {
      ASSIGN_OR_RETURN(listener_, ControlListener::Listen(config_.kv_ip,
                                                          static_cast<uint16_t>(config_.kv_port)));
      accept_thread_ = std::thread([this] { AcceptLoop(); });
    }
    progress_thread_ = std::thread([this] { ProgressLoop(); });
    return absl::OkStatus();
  }

  KvRole role() const override { return config_.kv_role; }
  const KvTransferConfig& config() const override { return config_; }
  ConnectorStats stats() const override {
    absl::MutexLock lock(&mu_);
    ConnectorStats s = stats_;
    s.blocks_in_flight = 0;
    for (const auto& [id, r] : recv_) {
      if (!r.producer_stopped) s.blocks_in_flight += static_cast<int64_t>(r.blocks.size());
    }
    for (const auto& [id, snd] : send_) {
      if (!SendDone(snd)) s.blocks_in_flight += static_cast<int64_t>(snd.local_blocks.size());
    }
    return s;
  }

  std::vector<PeerConnectorStats> peer_stats() const override {
    absl::MutexLock lock(&mu_);
    std::map<std::string, ConnectorStats> by_peer = peer_stats_;
    for (auto& [peer, st] : by_peer) st.blocks_in_flight = 0;
    for (const auto& [id, r] : recv_) {
      if (!r.producer_stopped) {
        by_peer[RecvPeer(r)].blocks_in_flight += static_cast<int64_t>(r.blocks.size());
      }
    }
    for (const auto& [id, snd] : send_) {
      if (SendDone(snd)) continue;
      // Every stage of a pipeline receives some layers of all the request's blocks.
      for (const SendDestination& d : snd.dests) {
        by_peer[d.link->engine_id].blocks_in_flight +=
            static_cast<int64_t>(snd.local_blocks.size());
      }
    }
    std::vector<PeerConnectorStats> out;
    for (auto& [peer, st] : by_peer) out.push_back({peer, st});
    return out;
  }

  std::vector<RequestTransferStats> TakeRequestStats() override {
    absl::MutexLock lock(&mu_);
    return std::move(finished_stats_);
  }

  std::string control_address() const override {
    return listener_ ? absl::StrCat(config_.kv_ip, ":", listener_->port()) : std::string();
  }

  // ---- scheduler side ----

  absl::StatusOr<MatchedTokens> GetNumNewMatchedTokens(const KvRequest& request,
                                                       int32_t num_computed_tokens) override {
    MatchedTokens m;
    if (!is_consumer() || !request.remote_prefill) return m;
    // All prompt tokens but the last come from the producer; the consumer computes the last
    // one itself to produce the first token.
    const int32_t remote = static_cast<int32_t>(request.prompt_token_ids.size()) - 1;
    m.num_tokens = std::max(0, remote - num_computed_tokens);
    m.load_async = false;
    return m;
  }

  absl::Status UpdateStateAfterAlloc(const KvRequest& request, absl::Span<const int32_t> block_ids,
                                     int32_t num_external_tokens) override {
    absl::MutexLock lock(&mu_);
    if (is_consumer() && request.remote_prefill && num_external_tokens > 0) {
      const int64_t need = (num_external_tokens + block_size_ - 1) / std::max(1, block_size_);
      if (static_cast<int64_t>(block_ids.size()) < need) {
        return absl::InvalidArgumentError(absl::StrCat(
            "request ", request.request_id, ": ", block_ids.size(), " blocks for ",
            num_external_tokens, " remote tokens of block size ", block_size_));
      }
      if (recv_.count(request.request_id) != 0) {
        return absl::AlreadyExistsError(
            absl::StrCat("request ", request.request_id, " is already loading"));
      }
      RecvRequest r;
      r.id = request.request_id;
      r.prompt = request.prompt_token_ids;
      r.blocks.assign(block_ids.begin(), block_ids.end());
      r.num_tokens = num_external_tokens;
      r.producer = absl::StrCat(request.remote_prefill->host, ":", request.remote_prefill->port);
      r.arrived.assign(layer_slots_, 0);
      recv_.emplace(r.id, std::move(r));
      pending_loads_.push_back(KvConnectorMetadata::Load{
          request.request_id, request.prompt_token_ids,
          std::vector<int32_t>(block_ids.begin(), block_ids.end()), num_external_tokens,
          *request.remote_prefill});
      return absl::OkStatus();
    }
    auto it = send_.find(request.request_id);
    if (it != send_.end()) {
      SendRequest& s = it->second;
      const int64_t need = (s.num_tokens + block_size_ - 1) / std::max(1, block_size_);
      if (static_cast<int64_t>(block_ids.size()) < need) {
        return absl::InvalidArgumentError(absl::StrCat("request ", s.id, ": ", block_ids.size(),
                                                       " local blocks for ", s.num_tokens,
                                                       " tokens to send"));
      }
      s.local_blocks.assign(block_ids.begin(), block_ids.end());
    }
    return absl::OkStatus();
  }

  absl::StatusOr<KvConnectorMetadata> BuildConnectorMeta(
      absl::Span<const ScheduledRequest> scheduled) override {
    absl::MutexLock lock(&mu_);
    KvConnectorMetadata meta;
    meta.loads = std::move(pending_loads_);
    pending_loads_.clear();
    for (const ScheduledRequest& sr : scheduled) {
      auto r = recv_.find(sr.request_id);
      if (r != recv_.end() && r->second.arrived_count < layer_count_ && !r->second.failed) {
        meta.waits.push_back(sr.request_id);
      }
      auto s = send_.find(sr.request_id);
      if (s != send_.end() && !s->second.save_scheduled && !s->second.failed &&
          !s->second.local_blocks.empty() &&
          sr.num_computed_tokens + sr.num_scheduled_tokens >= s->second.num_tokens) {
        s->second.save_scheduled = true;
        s->second.deadline = absl::Now() + absl::Milliseconds(config_.kvstream.send_timeout_ms);
        meta.saves.push_back({s->second.id, s->second.local_blocks, s->second.num_tokens});
      }
    }
    return meta;
  }

  absl::StatusOr<bool> RequestFinished(const std::string& request_id) override {
    std::vector<std::pair<std::shared_ptr<ProducerLink>, AbortMsg>> aborts;
    bool delay = false;
    {
      absl::MutexLock lock(&mu_);
      auto s = send_.find(request_id);
      if (s != send_.end()) {
        if (Forgettable(s->second)) {
          send_.erase(s);
        } else {
          s->second.engine_finished = true;
          delay = true;
        }
      }
      auto r = recv_.find(request_id);
      if (r != recv_.end()) {
        RecvRequest& rr = r->second;
        if (rr.arrived_count == layer_count_ || rr.producer_stopped || !rr.handed_off) {
          recv_.erase(r);
        } else {
          rr.engine_finished = true;
          if (!rr.failed) FailRecv(rr, absl::CancelledError("the request finished before its KV arrived"));
          QueueAbort(rr, aborts);
          delay = true;
        }
      }
    }
    SendAborts(aborts);
    return delay;
  }

  std::vector<KvRequest> TakeIncomingRequests() override {
    absl::MutexLock lock(&mu_);
    std::vector<KvRequest> out = std::move(incoming_);
    incoming_.clear();
    return out;
  }

  // ---- worker side ----

  absl::StatusOr<std::shared_ptr<void>> AllocateCacheMemory(size_t bytes) override {
    ASSIGN_OR_RETURN(std::unique_ptr<MemoryRegistration> reg,
                     transport_->AllocateMemory(bytes, MemoryKind::kHost));
    void* base = reg->base();
    // The registration owns the memory; the pointer's deleter releases it.
    std::shared_ptr<MemoryRegistration> owner(std::move(reg));
    return std::shared_ptr<void>(base, [owner](void*) mutable { owner.reset(); });
  }

  absl::Status RegisterKvCaches(const std::map<std::string, KvCache*>& caches) override {
    absl::MutexLock lock(&mu_);
    if (registered_) return absl::FailedPreconditionError("KV caches already registered");
    absl::Status status = RegisterLocked(caches);
    if (!status.ok()) {
      // Nothing of a failed registration stays: a handshake must never see layers without
      // their memory registrations, and the caller may register again.
      layers_.clear();
      layer_set_.clear();
      layer_by_name_.clear();
      layer_by_index_.clear();
      compat_hash_ = 0;
      compat_description_.clear();
      block_size_ = 0;
      layer_count_ = 0;
      layer_slots_ = 0;
    }
    return status;
  }

  absl::Status RegisterLocked(const std::map<std::string, KvCache*>& caches)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (caches.empty()) return absl::InvalidArgumentError("no KV caches to register");
    std::string description;
    uint64_t hash = XXH3_64bits_withSeed("kvstream-layerwise", 18, kLayerwiseProtocolVersion);
    const KvCacheSpec* first = nullptr;
    int32_t max_index = -1;
    std::set<int32_t> seen;
    for (const auto& [name, cache] : caches) {
      if (cache == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("null KV cache for layer '", name, "'"));
      }
      ASSIGN_OR_RETURN(int32_t index, ParseLayerIndex(name));
      if (!seen.insert(index).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("two layers map to index ", index, " (second: '", name, "')"));
      }
      const KvCacheSpec& spec = cache->spec();
      if (first == nullptr) {
        first = &spec;
      } else if (spec != *first || cache->num_blocks() != layers_[0].cache->num_blocks()) {
        return absl::InvalidArgumentError(absl::StrCat("layer '", name, "' has cache ",
                                                       spec.DebugString(), ", layer '",
                                                       layers_[0].name, "' has ",
                                                       first->DebugString()));
      }
      if (cache->view().memory != MemoryKind::kHost) {
        return absl::UnimplementedError(absl::StrCat("layer '", name, "': only host caches for now"));
      }
      LayerEntry e;
      e.name = name;
      e.index = index;
      e.cache = cache;
      layers_.push_back(std::move(e));
      max_index = std::max(max_index, index);
    }
    std::sort(layers_.begin(), layers_.end(),
              [](const LayerEntry& a, const LayerEntry& b) { return a.index < b.index; });
    // A pipeline stage with an explicit partition knows its range now; with the even split
    // it learns the model's layer count from the producer at handshake (CheckLayers).
    if (config_.kvstream.pipeline_parallel_size > 1 && !config_.kvstream.pipeline_layers.empty()) {
      const LayerRange own = config_.kvstream.pipeline_layers[config_.kvstream.pipeline_rank];
      for (const LayerEntry& e : layers_) {
        if (!own.Contains(e.index)) {
          const std::string name = e.name;
          layers_.clear();
          return absl::InvalidArgumentError(absl::StrCat(
              "pipeline rank ", config_.kvstream.pipeline_rank, " owns layers ",
              FormatLayerRange(own), " (pipeline_layers ",
              FormatLayerRanges(config_.kvstream.pipeline_layers),
              ") but a cache was registered for layer ", e.index, " ('", name, "')"));
        }
      }
    }
    const KvCacheView v = layers_[0].cache->view();
    block_size_ = v.spec.block_size;
    layer_count_ = static_cast<int>(layers_.size());
    layer_slots_ = max_index + 1;
    for (const LayerEntry& e : layers_) layer_set_.insert(e.index);
    // Which layers each side has is checked separately (CheckLayers), so that a pipeline
    // stage, which has only some of the producer's layers, is compatible with it.
    description = absl::StrCat(
        "protocol ", kLayerwiseProtocolVersion, ", ", v.spec.DebugString(), ", K strides ",
        v.k_strides.block, "/", v.k_strides.token, "/", v.k_strides.head, "/", v.k_strides.dim,
        ", V strides ", v.v_strides.block, "/", v.v_strides.token, "/", v.v_strides.head, "/",
        v.v_strides.dim);
    hash = XXH3_64bits_withSeed(description.data(), description.size(), hash);
    compat_hash_ = hash;
    compat_description_ = description;
    for (LayerEntry& e : layers_) {
      const KvCacheView cv = e.cache->view();
      const size_t es = DTypeSize(cv.spec.dtype);
      const uint64_t kb = TensorExtentBytes(cv.k_strides, cv.num_blocks, cv.spec.block_size,
                                            cv.spec.num_kv_heads, cv.spec.head_size, es);
      const uint64_t vb = TensorExtentBytes(cv.v_strides, cv.num_blocks, cv.spec.block_size,
                                            cv.spec.num_kv_heads, cv.spec.head_size_v, es);
      ASSIGN_OR_RETURN(e.k_reg, transport_->RegisterMemory(cv.k, kb, cv.memory));
      ASSIGN_OR_RETURN(e.v_reg, transport_->RegisterMemory(cv.v, vb, cv.memory));
      layer_by_name_[e.name] = static_cast<int>(&e - layers_.data());
      layer_by_index_[e.index] = static_cast<int>(&e - layers_.data());
    }
    registered_ = true;
    return absl::OkStatus();
  }

  absl::Status BindConnectorMetadata(const KvConnectorMetadata& metadata) override {
    absl::MutexLock lock(&mu_);
    meta_ = metadata;
    step_error_ = absl::OkStatus();
    return absl::OkStatus();
  }

  absl::Status StartLoadKv() override {
    std::vector<KvConnectorMetadata::Load> loads;
    {
      absl::MutexLock lock(&mu_);
      if (!registered_) return absl::FailedPreconditionError("StartLoadKv before RegisterKvCaches");
      loads = meta_.loads;
    }
    for (const KvConnectorMetadata::Load& load : loads) {
      absl::Status s = HandOff(load);
      if (!s.ok()) {
        absl::MutexLock lock(&mu_);
        auto it = recv_.find(load.request_id);
        if (it != recv_.end()) {
          FailRecv(it->second, s);
          it->second.producer_stopped = true;  // nothing was handed over: nothing can land
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status BeforeAttention(absl::string_view layer_name, void* stream) override {
    absl::MutexLock lock(&mu_);
    if (meta_.waits.empty()) return absl::OkStatus();
    auto li = layer_by_name_.find(std::string(layer_name));
    if (li == layer_by_name_.end()) return absl::OkStatus();  // a layer that shares KV
    const int32_t index = layers_[li->second].index;
    const absl::Time deadline = absl::Now() + absl::Milliseconds(config_.kvstream.load_timeout_ms);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const std::string& id : meta_.waits) {
        auto r = recv_.find(id);
        if (r == recv_.end() || r->second.failed) continue;
        if (!r->second.arrived[index]) return false;
      }
      return true;
    };
    // The producers still owing this layer when the wait starts share its time.
    std::set<std::string> owing;
    for (const std::string& id : meta_.waits) {
      auto r = recv_.find(id);
      if (r != recv_.end() && !r->second.failed && !r->second.arrived[index]) {
        owing.insert(RecvPeer(r->second));
      }
    }
    const absl::Time wait_start = absl::Now();
    const uint64_t wait_start_ns = MonotonicNs();
    mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
    const double waited = absl::ToDoubleMilliseconds(absl::Now() - wait_start);
    stats_.wait_ms += waited;
    for (const std::string& peer : owing) peer_stats_[peer].wait_ms += waited;
    const bool last_layer = index == layers_.back().index;
    for (const std::string& id : meta_.waits) {
      auto r = recv_.find(id);
      if (r == recv_.end()) continue;
      RecvRequest& rr = r->second;
      rr.wait_ms += waited;
      // Exposed transfer: the part of the wait when the layer was already posted and in
      // flight (the rest was the producer still computing it).
      if (rr.arrived[index] && static_cast<size_t>(index) < rr.arrival_ns.size()) {
        const uint64_t from = std::max(rr.post_ns[index], wait_start_ns);
        if (rr.arrival_ns[index] > from) {
          const double ms = static_cast<double>(rr.arrival_ns[index] - from) / 1e6;
          rr.exposed_ms += ms;
          stats_.exposed_ms += ms;
          peer_stats_[RecvPeer(rr)].exposed_ms += ms;
        }
      }
      if (last_layer && rr.arrived_count == layer_count_ && !rr.stats_reported) {
        rr.stats_reported = true;
        finished_stats_.push_back(
            {rr.id, rr.bytes, rr.layer_ms, rr.wait_ms, rr.transfer_ms, rr.exposed_ms});
      }
    }
    if (ready()) return absl::OkStatus();
    std::vector<std::pair<std::shared_ptr<ProducerLink>, AbortMsg>> aborts;
    for (const std::string& id : meta_.waits) {
      auto r = recv_.find(id);
      if (r == recv_.end() || r->second.failed || r->second.arrived[index]) continue;
      FailRecv(r->second,
               absl::DeadlineExceededError(absl::StrCat(
                   "layer '", layer_name, "' of request ", id, " did not arrive within ",
                   config_.kvstream.load_timeout_ms, " ms")));
      QueueAbort(r->second, aborts);
    }
    mu_.Unlock();
    SendAborts(aborts);
    mu_.Lock();
    // The failed requests are load errors; the layer runs for the rest of the batch.
    return absl::OkStatus();
  }

  absl::Status AfterAttention(absl::string_view layer_name, const KvCache& kv_cache,
                              const AttentionMetadata& metadata, void* stream) override {
    struct Job {
      std::string id;
      std::shared_ptr<ConsumerLink> link;
      std::vector<int32_t> local_blocks, dest_blocks;
      int32_t num_tokens;
    };
    std::vector<Job> jobs;
    const LayerEntry* layer = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (meta_.saves.empty()) return absl::OkStatus();
      auto li = layer_by_name_.find(std::string(layer_name));
      if (li == layer_by_name_.end()) return absl::OkStatus();  // shares another layer's KV
      layer = &layers_[li->second];
      if (&kv_cache != layer->cache) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer '", layer_name, "': the cache passed is not the one registered for it"));
      }
      for (const KvConnectorMetadata::Save& save : meta_.saves) {
        auto s = send_.find(save.request_id);
        if (s == send_.end() || s->second.failed) continue;
        // Routing by layer: the layer goes to the consumer (pipeline stage) that owns it.
        auto route = s->second.route.find(layer->index);
        if (route == s->second.route.end()) continue;
        const SendDestination& dest = s->second.dests[route->second];
        if (!dest.link->alive) continue;
        if (!s->second.layers_posted.insert(layer->index).second) continue;
        jobs.push_back({s->second.id, dest.link, save.block_ids, dest.dest_blocks,
                        save.num_tokens});
      }
    }
    const KvCacheView cv = kv_cache.view();
    const size_t es = DTypeSize(cv.spec.dtype);
    for (Job& job : jobs) {
      absl::Status status = PostLayer(*layer, cv, es, job.id, *job.link, job.local_blocks,
                                      job.dest_blocks, job.num_tokens);
      absl::MutexLock lock(&mu_);
      auto s = send_.find(job.id);
      if (!status.ok()) {
        if (s != send_.end()) FailSend(s->second, status);
        if (step_error_.ok()) step_error_ = status;
      } else if (s != send_.end()) {
        // The deadline measures the transfers, not the prefill: it restarts with every
        // layer posted, so a long prefill (a big model on a CPU) is not mistaken for a
        // consumer that stopped taking data.
        s->second.deadline = absl::Now() + absl::Milliseconds(config_.kvstream.send_timeout_ms);
      }
    }
    return absl::OkStatus();
  }

  absl::Status WaitForSave() override {
    absl::MutexLock lock(&mu_);
    return step_error_;
  }

  void ClearConnectorMetadata() override {
    absl::MutexLock lock(&mu_);
    meta_ = KvConnectorMetadata();
  }

  absl::StatusOr<FinishedRequests> GetFinished() override {
    absl::MutexLock lock(&mu_);
    FinishedRequests f;
    for (auto it = send_.begin(); it != send_.end();) {
      if (it->second.engine_finished && Forgettable(it->second)) {
        f.finished_sending.insert(it->first);
        it = send_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = recv_.begin(); it != recv_.end();) {
      RecvRequest& r = it->second;
      const bool complete = r.arrived_count == layer_count_ && !r.failed;
      const bool failed_safe = r.failed && r.producer_stopped;
      if (complete || failed_safe) {
        f.finished_recving.insert(it->first);
        if (r.engine_finished || failed_safe) {
          if (r.failed && !r.error_reported) {
            ++it;  // keep until its error has been taken
            continue;
          }
          it = recv_.erase(it);
          continue;
        }
        if (complete) {
          it = recv_.erase(it);
          continue;
        }
      }
      ++it;
    }
    return f;
  }

  std::set<int32_t> GetBlockIdsWithLoadErrors() override {
    absl::MutexLock lock(&mu_);
    std::set<int32_t> ids;
    for (const auto& [id, r] : recv_) {
      if (r.failed) ids.insert(r.blocks.begin(), r.blocks.end());
    }
    return ids;
  }

  std::vector<LoadError> TakeLoadErrors() override {
    absl::MutexLock lock(&mu_);
    std::vector<LoadError> out;
    for (auto& [id, r] : recv_) {
      if (r.failed && !r.error_reported) {
        r.error_reported = true;
        out.push_back({id, r.blocks, r.error});
      }
    }
    return out;
  }

 private:
  // Consumer: the metrics label of a request's producer.
  static const std::string& RecvPeer(const RecvRequest& r) {
    return r.producer_id.empty() ? r.producer : r.producer_id;
  }

  bool is_producer() const { return config_.kv_role != KvRole::kConsumer; }
  bool is_consumer() const { return config_.kv_role != KvRole::kProducer; }

  HelloMsg LocalHello() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    HelloMsg h;
    h.engine_id = config_.engine_id;
    h.protocol_version = kLayerwiseProtocolVersion;
    h.compat_hash = compat_hash_;
    h.compat_description = compat_description_;
    h.transport = std::string(transport_->name());
    auto info = transport_->LocalInfo();
    if (info.ok()) h.transport_info = *info;
    for (const LayerEntry& e : layers_) {
      h.regions.push_back({e.index, 0, e.k_reg->descriptor()});
      h.regions.push_back({e.index, 1, e.v_reg->descriptor()});
    }
    return h;
  }

  absl::Status CheckPeer(const HelloMsg& peer) {
    if (peer.protocol_version != kLayerwiseProtocolVersion) {
      return absl::FailedPreconditionError(absl::StrCat(
          "peer ", peer.engine_id, " speaks protocol ", peer.protocol_version, ", we speak ",
          kLayerwiseProtocolVersion));
    }
    if (peer.compat_hash != compat_hash_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "KV cache compatibility mismatch with peer ", peer.engine_id, ": ours is [",
          compat_description_, "], theirs is [", peer.compat_description, "]"));
    }
    if (peer.transport != transport_->name()) {
      return absl::FailedPreconditionError(absl::StrCat("peer ", peer.engine_id, " uses transport ",
                                                        peer.transport, ", we use ",
                                                        transport_->name()));
    }
    return absl::OkStatus();
  }

  // Consumer: whether the layers we registered are the ones this producer will send us: all
  // of its layers, or, as one stage of a pipeline-parallel decode group, the stage's range
  // of them (the partition must cover exactly the producer's layers).
  absl::Status CheckProducerLayers(const HelloMsg& peer) {
    std::set<int32_t> theirs;
    for (const RegionDescriptor& r : peer.regions) theirs.insert(r.layer);
    std::set<int32_t> mine;
    {
      absl::MutexLock lock(&mu_);
      mine = layer_set_;
    }
    const KvstreamSettings& k = config_.kvstream;
    if (k.pipeline_parallel_size <= 1) {
      if (mine == theirs) return absl::OkStatus();
      return absl::FailedPreconditionError(absl::StrCat(
          "KV cache compatibility mismatch with peer ", peer.engine_id, ": it has layers ",
          FormatLayerSet(theirs), ", we have layers ", FormatLayerSet(mine),
          " (a decode worker that is one stage of a pipeline sets pipeline_parallel_size, "
          "pipeline_rank and pipeline_layers)"));
    }
    const int32_t num_layers = theirs.empty() ? 0 : *theirs.rbegin() + 1;
    auto range = PipelineStageLayers(k, num_layers);
    if (!range.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("producer ", peer.engine_id,
                                                        " has layers ", FormatLayerSet(theirs),
                                                        ": ", range.status().message()));
    }
    std::set<int32_t> expected;
    for (int32_t l : theirs) {
      if (range->Contains(l)) expected.insert(l);
    }
    if (mine != expected) {
      return absl::FailedPreconditionError(absl::StrCat(
          "pipeline rank ", k.pipeline_rank, " of ", k.pipeline_parallel_size,
          " should receive layers ", FormatLayerSet(expected), " of producer ", peer.engine_id,
          " (which has layers ", FormatLayerSet(theirs), "), but registered layers ",
          FormatLayerSet(mine)));
    }
    return absl::OkStatus();
  }

  // ---- consumer: hand-off ----

  absl::StatusOr<std::shared_ptr<ProducerLink>> ProducerFor(const RemotePrefill& remote) {
    const std::string key = absl::StrCat(remote.host, ":", remote.port);
    HandshakeOptions hs;
    {
      absl::MutexLock lock(&mu_);
      auto it = producers_.find(key);
      if (it != producers_.end() && it->second->alive) return it->second;
      hs.local = LocalHello();
    }
    const absl::Time deadline =
        absl::Now() + absl::Milliseconds(config_.kvstream.handshake_timeout_ms);
    ASSIGN_OR_RETURN(auto conn, ConnectControl(remote.host, static_cast<uint16_t>(remote.port),
                                               deadline));
    hs.secret = config_.kvstream.secret;
    hs.deadline = deadline;
    hs.check = [this](const HelloMsg& peer) -> absl::Status {
      RETURN_IF_ERROR(CheckPeer(peer));
      return CheckProducerLayers(peer);
    };
    auto peer = HandshakeAsClient(*conn, hs);
    if (!peer.ok()) {
      return absl::Status(peer.status().code(), absl::StrCat("handshake with producer ", key,
                                                             ": ", peer.status().message()));
    }
    auto link = std::make_shared<ProducerLink>();
    link->conn = std::move(conn);
    link->address = key;
    link->engine_id = peer->engine_id;
    {
      absl::MutexLock lock(&mu_);
      producers_[key] = link;
    }
    absl::MutexLock lock(&threads_mu_);
    readers_.emplace_back([this, link] { ProducerReaderLoop(link); });
    return link;
  }

  absl::Status HandOff(const KvConnectorMetadata::Load& load) {
    ASSIGN_OR_RETURN(std::shared_ptr<ProducerLink> link, ProducerFor(load.remote));
    RequestMsg m;
    m.request_id = load.request_id;
    m.prompt_token_ids = load.prompt_token_ids;
    m.dest_block_ids = load.block_ids;
    m.num_tokens = static_cast<uint32_t>(load.num_tokens);
    {
      absl::MutexLock lock(&mu_);
      auto it = recv_.find(load.request_id);
      if (it == recv_.end()) return absl::OkStatus();  // finished meanwhile
      it->second.handed_off = true;
      it->second.handoff_time = absl::Now();
      outstanding_ = true;
      it->second.producer = link->address;
      it->second.producer_id = link->engine_id;
    }
    absl::Status s = link->conn->Send(m, absl::Now() + absl::Seconds(5));
    if (!s.ok()) {
      absl::MutexLock lock(&mu_);
      auto it = recv_.find(load.request_id);
      if (it != recv_.end()) it->second.handed_off = false;
      return absl::UnavailableError(absl::StrCat("sending request ", load.request_id,
                                                 " to producer ", link->address, ": ",
                                                 s.message()));
    }
    return absl::OkStatus();
  }

  void ProducerReaderLoop(std::shared_ptr<ProducerLink> link) {
    while (!stopping_) {
      auto msg = link->conn->Receive(absl::Now() + absl::Milliseconds(100));
      if (!msg.ok()) {
        if (absl::IsDeadlineExceeded(msg.status()) && !link->conn->closed()) continue;
        LinkLost(*link, msg.status());
        return;
      }
      absl::MutexLock lock(&mu_);
      if (auto* ack = std::get_if<RequestAckMsg>(&*msg)) {
        if (ack->status_code != 0) {
          auto it = recv_.find(ack->request_id);
          if (it != recv_.end()) {
            FailRecv(it->second, StatusFromCode(ack->status_code,
                                                absl::StrCat("producer ", link->address,
                                                             " rejected request ",
                                                             ack->request_id, ": ", ack->message)));
            it->second.producer_stopped = true;
          }
        }
      } else if (auto* abort = std::get_if<AbortMsg>(&*msg)) {
        auto it = recv_.find(abort->request_id);
        if (it != recv_.end()) {
          if (!it->second.failed) {
            FailRecv(it->second, absl::AbortedError(absl::StrCat(
                                     "producer ", link->address, " stopped sending request ",
                                     abort->request_id, ": ", abort->reason)));
          }
          it->second.producer_stopped = true;
        }
      } else {
        Log(LogLevel::kWarning, absl::StrCat("producer ", link->address, " sent an unexpected ",
                                             MessageTypeName(TypeOf(*msg)), " message"));
      }
    }
  }

  void LinkLost(ProducerLink& link, const absl::Status& why) {
    link.alive = false;
    link.conn->Close();
    absl::MutexLock lock(&mu_);
    for (auto& [id, r] : recv_) {
      if (r.producer != link.address || !r.handed_off) continue;
      if (r.arrived_count < layer_count_ && !r.failed) {
        FailRecv(r, absl::UnavailableError(absl::StrCat("lost producer ", link.address, ": ",
                                                        why.message())));
      }
      r.producer_stopped = true;
    }
  }

  void FailRecv(RecvRequest& r, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (r.failed) return;
    r.failed = true;
    ++stats_.load_errors;
    ++peer_stats_[RecvPeer(r)].load_errors;
    r.error = std::move(status);
    r.abort_deadline = absl::Now() + absl::Milliseconds(config_.kvstream.send_timeout_ms);
    Log(LogLevel::kWarning, absl::StrCat("load error: ", r.error.ToString()));
  }

  void QueueAbort(RecvRequest& r, std::vector<std::pair<std::shared_ptr<ProducerLink>, AbortMsg>>& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (r.producer_stopped || !r.handed_off) {
      r.producer_stopped = true;
      return;
    }
    auto it = producers_.find(r.producer);
    if (it == producers_.end() || !it->second->alive) {
      r.producer_stopped = true;
      return;
    }
    out.push_back({it->second, AbortMsg{r.id, r.error.ToString()}});
  }

  void SendAborts(const std::vector<std::pair<std::shared_ptr<ProducerLink>, AbortMsg>>& aborts) {
    for (const auto& [link, msg] : aborts) {
      absl::Status s = link->conn->Send(msg, absl::Now() + absl::Seconds(1));
      if (!s.ok()) LinkLost(*link, s);
    }
  }

  // ---- producer: control ----

  void AcceptLoop() {
    while (!stopping_) {
      auto conn = listener_->Accept(absl::Now() + absl::Milliseconds(100));
      if (!conn.ok()) continue;
      std::shared_ptr<ControlConnection> shared(std::move(*conn));
      absl::MutexLock lock(&threads_mu_);
      readers_.emplace_back([this, shared] { ConsumerLoop(shared); });
    }
  }

  void ConsumerLoop(std::shared_ptr<ControlConnection> shared) {
    auto link = std::make_shared<ConsumerLink>();
    HandshakeOptions hs;
    {
      absl::MutexLock lock(&mu_);
      hs.local = LocalHello();
    }
    hs.secret = config_.kvstream.secret;
    hs.deadline = absl::Now() + absl::Milliseconds(config_.kvstream.handshake_timeout_ms);
    hs.check = [this, &link](const HelloMsg& peer) -> absl::Status {
      RETURN_IF_ERROR(CheckPeer(peer));
      return ImportConsumer(peer, *link);
    };
    ControlConnection& conn = *shared;
    auto peer = HandshakeAsServer(conn, hs);
    if (!peer.ok()) {
      // A peer that closes before saying hello is a liveness probe, not an attack.
      Log(absl::IsUnavailable(peer.status()) ? LogLevel::kInfo : LogLevel::kWarning,
          absl::StrCat("rejected consumer ", conn.peer_address(), ": ", peer.status().ToString()));
      conn.Close();
      return;
    }
    link->engine_id = peer->engine_id;
    {
      absl::MutexLock lock(&mu_);
      link_conns_[link.get()] = shared;
    }
    while (!stopping_) {
      auto msg = conn.Receive(absl::Now() + absl::Milliseconds(100));
      if (!msg.ok()) {
        if (absl::IsDeadlineExceeded(msg.status()) && !conn.closed()) continue;
        ConsumerLost(link, msg.status());
        conn.Close();
        return;
      }
      if (auto* req = std::get_if<RequestMsg>(&*msg)) {
        absl::Status s = AcceptRequest(*req, link);
        RequestAckMsg ack;
        ack.request_id = req->request_id;
        ack.status_code = static_cast<int32_t>(s.code());
        ack.message = std::string(s.message());
        absl::Status sent = conn.Send(ack, absl::Now() + absl::Seconds(1));
        if (!sent.ok()) {
          ConsumerLost(link, sent);
          conn.Close();
          return;
        }
      } else if (auto* abort = std::get_if<AbortMsg>(&*msg)) {
        bool in_flight = false;
        {
          absl::MutexLock lock(&mu_);
          auto it = send_.find(abort->request_id);
          if (it != send_.end() && HasDestination(it->second, link)) {
            in_flight = true;  // CheckSends confirms once its transfers have ended
            FailSend(it->second, absl::CancelledError(absl::StrCat(
                                     "consumer aborted request ", abort->request_id, ": ",
                                     abort->reason)));
          }
        }
        if (!in_flight) {
          // Finished and forgotten, or never handed over on this link: nothing of it can
          // still land, so confirm at once (the consumer would otherwise close the link at
          // its deadline, failing every other request on it).
          AbortMsg confirm{abort->request_id, "no transfer of it is in flight"};
          absl::Status sent = conn.Send(confirm, absl::Now() + absl::Seconds(1));
          if (!sent.ok()) {
            ConsumerLost(link, sent);
            conn.Close();
            return;
          }
        }
      } else {
        Log(LogLevel::kWarning, absl::StrCat("consumer ", link->engine_id, " sent an unexpected ",
                                             MessageTypeName(TypeOf(*msg)), " message"));
      }
    }
  }

  // Producer: the consumer's cache regions. It may have all of our layers or, as one stage
  // of a pipeline-parallel decode group, some of them (which the consumer checks against
  // its pipeline configuration); a layer we do not have is refused here.
  absl::Status ImportConsumer(const HelloMsg& peer, ConsumerLink& link) {
    std::set<std::pair<int32_t, int>> seen;
    {
      absl::MutexLock lock(&mu_);
      for (const RegionDescriptor& r : peer.regions) {
        if (r.tensor > 1 || !seen.insert({r.layer, r.tensor}).second) {
          return absl::InvalidArgumentError(absl::StrCat("consumer ", peer.engine_id,
                                                         " sent an unexpected region for layer ",
                                                         r.layer, " tensor ", int(r.tensor)));
        }
        if (layer_by_index_.count(r.layer) == 0) {
          return absl::FailedPreconditionError(absl::StrCat(
              "KV cache compatibility mismatch with peer ", peer.engine_id,
              ": it registered layer ", r.layer, ", which this producer does not have (it has "
              "layers ", FormatLayerSet(layer_set_), ")"));
        }
        link.layers.insert(r.layer);
      }
      if (link.layers.empty() || seen.size() != 2 * link.layers.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("consumer ", peer.engine_id, " registered ", seen.size(),
                         " regions for layers ", FormatLayerSet(link.layers),
                         "; expected a K and a V region for each"));
      }
    }
    ASSIGN_OR_RETURN(link.peer, transport_->Connect(peer.transport_info));
    absl::MutexLock lock(&mu_);
    for (const RegionDescriptor& r : peer.regions) {
      ASSIGN_OR_RETURN(auto remote, transport_->ImportRemote(link.peer, r.descriptor));
      auto& slot = link.regions[r.layer];
      (r.tensor == 0 ? slot.first : slot.second) = std::move(remote);
    }
    // Same layout (the compatibility hash says so): the K region's size gives its blocks.
    const KvCacheView cv = layers_[0].cache->view();
    const size_t es = DTypeSize(cv.spec.dtype);
    const uint64_t block_bytes = static_cast<uint64_t>(cv.k_strides.block) * es;
    link.remote_num_blocks =
        block_bytes == 0 ? 0 : static_cast<int64_t>(link.regions.begin()->second.first->length() / block_bytes);
    return absl::OkStatus();
  }

  absl::Status AcceptRequest(const RequestMsg& req, const std::shared_ptr<ConsumerLink>& link) {
    if (req.request_id.empty()) return absl::InvalidArgumentError("empty request id");
    absl::MutexLock lock(&mu_);
    auto existing = send_.find(req.request_id);
    if (existing != send_.end()) {
      SendRequest& s = existing->second;
      for (const SendDestination& d : s.dests) {
        if (d.link == link) {
          return absl::AlreadyExistsError(
              absl::StrCat("request ", req.request_id, " already handed over"));
        }
      }
      if (s.failed) {
        return absl::AbortedError(absl::StrCat("request ", req.request_id,
                                               " was already stopped: ", s.stop_reason));
      }
      if (s.released) {
        return absl::AlreadyExistsError(absl::StrCat(
            "request ", req.request_id, " already handed over by ", DestinationNames(s),
            ", which receive all its layers"));
      }
    }
    const bool pipeline_stage = link->layers.size() < layer_set_.size();
    auto rejected = rejected_stages_.find(req.request_id);
    if (rejected != rejected_stages_.end() && pipeline_stage) {
      return absl::AbortedError(absl::StrCat("request ", req.request_id,
                                             ": the hand-off from another pipeline stage was "
                                             "rejected: ",
                                             rejected->second.why));
    }
    absl::Status verdict =
        CheckHandOff(req, *link, existing == send_.end() ? nullptr : &existing->second);
    if (!verdict.ok()) {
      // The other stages of a pipeline must not wait for the gather deadline: the request
      // fails for those already here, and is refused to those still to come.
      if (existing != send_.end()) {
        FailSend(existing->second,
                 absl::AbortedError(absl::StrCat("the hand-off from ", link->engine_id,
                                                 " was rejected: ", verdict.message())));
      } else if (pipeline_stage) {
        rejected_stages_[req.request_id] = RejectedStage{
            absl::StrCat(link->engine_id, ": ", verdict.message()),
            absl::Now() + absl::Milliseconds(config_.kvstream.send_timeout_ms)};
      }
      return verdict;
    }
    if (existing == send_.end()) {
      SendRequest s;
      s.id = req.request_id;
      s.prompt = req.prompt_token_ids;
      s.num_tokens = static_cast<int32_t>(req.num_tokens);
      // The other stages of a pipeline hand the request over independently; wait for them
      // no longer than a send may take.
      s.gather_deadline = absl::Now() + absl::Milliseconds(config_.kvstream.send_timeout_ms);
      existing = send_.emplace(s.id, std::move(s)).first;
    }
    SendRequest& s = existing->second;
    s.dests.push_back({link, req.dest_block_ids});
    for (int32_t l : link->layers) s.route[l] = s.dests.size() - 1;
    if (s.route.size() == layer_set_.size()) {
      s.released = true;
      KvRequest incoming;
      incoming.request_id = req.request_id;
      incoming.prompt_token_ids = req.prompt_token_ids;
      incoming_.push_back(std::move(incoming));
    }
    return absl::OkStatus();
  }

  // What a consumer's hand-off must satisfy: enough destination blocks, all inside its
  // cache, and, where another stage handed the request over already (`other`), the same
  // prompt and layers that no other stage owns.
  absl::Status CheckHandOff(const RequestMsg& req, const ConsumerLink& link,
                            const SendRequest* other) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (req.num_tokens == 0 || req.num_tokens > req.prompt_token_ids.size()) {
      return absl::InvalidArgumentError(absl::StrCat("request ", req.request_id, " asks for ",
                                                     req.num_tokens, " tokens of a ",
                                                     req.prompt_token_ids.size(),
                                                     "-token prompt"));
    }
    const int64_t need = (static_cast<int64_t>(req.num_tokens) + block_size_ - 1) / block_size_;
    if (static_cast<int64_t>(req.dest_block_ids.size()) < need) {
      return absl::InvalidArgumentError(absl::StrCat("request ", req.request_id, ": ",
                                                     req.dest_block_ids.size(),
                                                     " destination blocks for ", req.num_tokens,
                                                     " tokens of block size ", block_size_));
    }
    for (int64_t i = 0; i < need; ++i) {
      const int32_t b = req.dest_block_ids[i];
      if (b < 0 || b >= link.remote_num_blocks) {
        return absl::OutOfRangeError(absl::StrCat("request ", req.request_id,
                                                  ": destination block ", b, " outside [0, ",
                                                  link.remote_num_blocks, ")"));
      }
    }
    if (other == nullptr) return absl::OkStatus();
    if (other->prompt != req.prompt_token_ids ||
        other->num_tokens != static_cast<int32_t>(req.num_tokens)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", req.request_id, " handed over by ", link.engine_id,
          " has another prompt or token count than the same request handed over by ",
          DestinationNames(*other)));
    }
    for (int32_t l : link.layers) {
      auto owner = other->route.find(l);
      if (owner != other->route.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "request ", req.request_id, ": consumer ", link.engine_id, " asks for layers ",
            FormatLayerSet(link.layers), " but layer ", l, " already goes to consumer ",
            other->dests[owner->second].link->engine_id,
            " (the pipeline stages' layer ranges overlap)"));
      }
    }
    return absl::OkStatus();
  }

  static std::string DestinationNames(const SendRequest& s) {
    return absl::StrJoin(s.dests, ", ", [](std::string* out, const SendDestination& d) {
      absl::StrAppend(out, d.link->engine_id, " (layers ", FormatLayerSet(d.link->layers), ")");
    });
  }

  void ConsumerLost(const std::shared_ptr<ConsumerLink>& link, const absl::Status& why) {
    link->alive = false;
    absl::MutexLock lock(&mu_);
    for (auto& [id, s] : send_) {
      if (HasDestination(s, link)) {
        FailSend(s, absl::UnavailableError(absl::StrCat("lost consumer ", link->engine_id, ": ",
                                                        why.message())));
      }
    }
    link_conns_.erase(link.get());
  }

  static bool HasDestination(const SendRequest& s, const std::shared_ptr<ConsumerLink>& link) {
    for (const SendDestination& d : s.dests) {
      if (d.link == link) return true;
    }
    return false;
  }

  // Stops a request's sends; CheckSends tells the consumer once its transfers have ended.
  void FailSend(SendRequest& s, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (s.failed) return;
    s.failed = true;
    ++stats_.send_failures;
    for (const SendDestination& d : s.dests) ++peer_stats_[d.link->engine_id].send_failures;
    s.stop_reason = why.ToString();
    Log(LogLevel::kWarning, absl::StrCat("send of request ", s.id, " failed: ", s.stop_reason));
    for (TransferId t : s.pending) (void)transport_->Cancel(t);
  }

  bool SendDone(const SendRequest& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!s.pending.empty()) return false;
    if (s.failed || !s.save_scheduled) return true;
    return static_cast<int>(s.layers_posted.size()) == layer_count_;
  }

  // Whether the producer may drop a request: its sends are done and, if it failed, its
  // consumers have been told (CheckSends): a consumer that never hears it closes the link.
  bool Forgettable(const SendRequest& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return SendDone(s) && (!s.failed || s.stop_notified);
  }

  // Posts one layer of one request: K runs, then V runs with the notification.
  absl::Status PostLayer(const LayerEntry& layer, const KvCacheView& cv, size_t es,
                         const std::string& id, ConsumerLink& link,
                         const std::vector<int32_t>& local_blocks,
                         const std::vector<int32_t>& dest_blocks, int32_t num_tokens) {
    auto region = link.regions.find(layer.index);
    if (region == link.regions.end()) {
      return absl::InternalError(absl::StrCat("no consumer region for layer ", layer.index));
    }
    ASSIGN_OR_RETURN(std::vector<ByteRun> k_runs,
                     PlanBlockCopy(cv.k_strides, cv.spec.block_size, cv.spec.num_kv_heads,
                                   cv.spec.head_size, es, local_blocks, dest_blocks, num_tokens));
    ASSIGN_OR_RETURN(std::vector<ByteRun> v_runs,
                     PlanBlockCopy(cv.v_strides, cv.spec.block_size, cv.spec.num_kv_heads,
                                   cv.spec.head_size_v, es, local_blocks, dest_blocks,
                                   num_tokens));
    LayerNotice notice;
    notice.request_id = id;
    notice.layer = static_cast<uint32_t>(layer.index);
    XXH3_state_t* state = nullptr;
    if (config_.kvstream.verify_checksum) {
      state = XXH3_createState();
      XXH3_64bits_reset(state);
    }
    auto to_segments = [&](const std::vector<ByteRun>& runs, const void* base) {
      std::vector<Segment> segs;
      segs.reserve(runs.size());
      for (const ByteRun& r : runs) {
        segs.push_back({r.src_offset, r.dst_offset, r.length});
        notice.bytes += r.length;
        if (state != nullptr) {
          XXH3_64bits_update(state, static_cast<const char*>(base) + r.src_offset, r.length);
        }
      }
      return segs;
    };
    std::vector<Segment> k_segs = to_segments(k_runs, cv.k);
    std::vector<Segment> v_segs = to_segments(v_runs, cv.v);
    if (state != nullptr) {
      notice.has_checksum = true;
      notice.checksum = XXH3_64bits_digest(state);
      XXH3_freeState(state);
    }
    notice.post_ns = MonotonicNs();
    ASSIGN_OR_RETURN(TransferId k_id, transport_->PostWrite(link.peer, *layer.k_reg,
                                                            *region->second.first, k_segs, ""));
    TrackTransfer(id, k_id);
    ASSIGN_OR_RETURN(TransferId v_id,
                     transport_->PostWrite(link.peer, *layer.v_reg, *region->second.second,
                                           v_segs, EncodeNotice(notice)));
    TrackTransfer(id, v_id);
    {
      absl::MutexLock lock(&mu_);
      layer_bytes_[v_id] = {notice.bytes, notice.post_ns, link.engine_id};
    }
    return absl::OkStatus();
  }

  void TrackTransfer(const std::string& id, TransferId t) {
    outstanding_ = true;
    absl::MutexLock lock(&mu_);
    auto s = send_.find(id);
    if (s == send_.end() || s->second.failed) {
      (void)transport_->Cancel(t);
      orphans_.push_back(t);
      return;
    }
    s->second.pending.push_back(t);
  }

  // ---- progress ----

  void ProgressLoop() {
    while (!stopping_) {
      absl::Status s = transport_->Progress();
      if (!s.ok()) Log(LogLevel::kWarning, absl::StrCat("transport progress: ", s.ToString()));
      bool busy = false;
      for (Notification& n : transport_->PollNotifications()) {
        busy = true;
        HandleNotice(n);
      }
      CheckSends();
      CheckRecvDeadlines();
      if (busy) continue;
      // Idle: short naps while transfers are outstanding; otherwise up to 1 ms, cut short as
      // soon as something is posted or handed off (they set outstanding_).
      for (int i = 0; i < 50 && !stopping_; ++i) {
        absl::SleepFor(absl::Microseconds(20));
        if (outstanding_.load()) break;
      }
    }
  }

  void HandleNotice(const Notification& n) {
    auto notice = DecodeNotice(n.payload);
    if (!notice.ok()) {
      Log(LogLevel::kWarning, absl::StrCat("dropping a notification from peer ", n.peer, ": ",
                                           notice.status().message()));
      return;
    }
    std::vector<int32_t> blocks;
    int32_t num_tokens = 0;
    const LayerEntry* layer = nullptr;
    {
      absl::MutexLock lock(&mu_);
      auto r = recv_.find(notice->request_id);
      auto li = layer_by_index_.find(static_cast<int32_t>(notice->layer));
      if (r == recv_.end() || li == layer_by_index_.end() || r->second.failed ||
          r->second.arrived[notice->layer]) {
        return;  // late (aborted) or duplicate; nothing to do
      }
      blocks = r->second.blocks;
      num_tokens = r->second.num_tokens;
      layer = &layers_[li->second];
    }
    absl::Status verdict = VerifyLayer(*layer, blocks, num_tokens, *notice);
    if (!verdict.ok()) {
      // A corrupt layer fails the request; the producer is told to stop (its confirmation
      // lets the blocks go without waiting for the deadline that closes the whole link).
      std::vector<std::pair<std::shared_ptr<ProducerLink>, AbortMsg>> aborts;
      {
        absl::MutexLock lock(&mu_);
        auto r = recv_.find(notice->request_id);
        if (r == recv_.end() || r->second.failed) return;
        FailRecv(r->second, verdict);
        QueueAbort(r->second, aborts);
      }
      SendAborts(aborts);
      return;
    }
    absl::MutexLock lock(&mu_);
    auto r = recv_.find(notice->request_id);
    if (r == recv_.end() || r->second.failed) return;
    r->second.arrived[notice->layer] = 1;
    ++r->second.arrived_count;
    r->second.bytes += notice->bytes;
    ConnectorStats& peer = peer_stats_[RecvPeer(r->second)];
    const uint64_t now_ns = MonotonicNs();
    if (notice->post_ns != 0 && now_ns > notice->post_ns) {
      const double ms = static_cast<double>(now_ns - notice->post_ns) / 1e6;
      r->second.transfer_ms += ms;
      stats_.ObserveLatency(ms);
      peer.ObserveLatency(ms);
    }
    if (r->second.post_ns.size() < r->second.arrived.size()) {
      r->second.post_ns.assign(r->second.arrived.size(), 0);
      r->second.arrival_ns.assign(r->second.arrived.size(), 0);
    }
    r->second.post_ns[notice->layer] = notice->post_ns;
    r->second.arrival_ns[notice->layer] = now_ns;
    if (r->second.layer_ms.size() < r->second.arrived.size()) {
      r->second.layer_ms.assign(r->second.arrived.size(), 0.0);
    }
    r->second.layer_ms[notice->layer] =
        absl::ToDoubleMilliseconds(absl::Now() - r->second.handoff_time);
    stats_.bytes_received += notice->bytes;
    ++stats_.layers_received;
    peer.bytes_received += notice->bytes;
    ++peer.layers_received;
    if (r->second.arrived_count == layer_count_) r->second.producer_stopped = true;
  }

  absl::Status VerifyLayer(const LayerEntry& layer, const std::vector<int32_t>& blocks,
                           int32_t num_tokens, const LayerNotice& notice) {
    const KvCacheView cv = layer.cache->view();
    const size_t es = DTypeSize(cv.spec.dtype);
    ASSIGN_OR_RETURN(std::vector<ByteRun> k_runs,
                     PlanBlockCopy(cv.k_strides, cv.spec.block_size, cv.spec.num_kv_heads,
                                   cv.spec.head_size, es, blocks, blocks, num_tokens));
    ASSIGN_OR_RETURN(std::vector<ByteRun> v_runs,
                     PlanBlockCopy(cv.v_strides, cv.spec.block_size, cv.spec.num_kv_heads,
                                   cv.spec.head_size_v, es, blocks, blocks, num_tokens));
    uint64_t bytes = 0;
    for (const ByteRun& r : k_runs) bytes += r.length;
    for (const ByteRun& r : v_runs) bytes += r.length;
    if (bytes != notice.bytes) {
      return absl::DataLossError(absl::StrCat("request ", notice.request_id, " layer ",
                                              notice.layer, ": producer sent ", notice.bytes,
                                              " bytes, expected ", bytes));
    }
    if (!config_.kvstream.verify_checksum || !notice.has_checksum) return absl::OkStatus();
    XXH3_state_t* state = XXH3_createState();
    XXH3_64bits_reset(state);
    for (const ByteRun& r : k_runs) {
      XXH3_64bits_update(state, static_cast<const char*>(cv.k) + r.dst_offset, r.length);
    }
    for (const ByteRun& r : v_runs) {
      XXH3_64bits_update(state, static_cast<const char*>(cv.v) + r.dst_offset, r.length);
    }
    const uint64_t sum = XXH3_64bits_digest(state);
    XXH3_freeState(state);
    if (sum != notice.checksum) {
      return absl::DataLossError(absl::StrCat("request ", notice.request_id, " layer ",
                                              notice.layer, ": checksum mismatch (got ",
                                              absl::Hex(sum), ", producer sent ",
                                              absl::Hex(notice.checksum), ")"));
    }
    return absl::OkStatus();
  }

  // Completes, fails and times out producer transfers; notes whether work remains.
  void CheckSends() {
    std::vector<std::pair<std::shared_ptr<ConsumerLink>, AbortMsg>> notify;
    bool outstanding = false;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      for (auto si = send_.begin(); si != send_.end();) {
        const std::string& id = si->first;
        SendRequest& s = si->second;
        for (auto it = s.pending.begin(); it != s.pending.end();) {
          auto state = transport_->Test(*it);
          if (state.ok() && *state == TransferState::kInProgress) {
            ++it;
            continue;
          }
          auto lb = layer_bytes_.find(*it);
          if (lb != layer_bytes_.end()) {
            if (state.ok()) {
              const double ms = static_cast<double>(MonotonicNs() - lb->second.post_ns) / 1e6;
              ConnectorStats& peer = peer_stats_[lb->second.peer];
              for (ConnectorStats* st : {&stats_, &peer}) {
                st->bytes_sent += lb->second.bytes;
                ++st->layers_sent;
                st->ObserveLatency(ms);
              }
            }
            layer_bytes_.erase(lb);
          }
          if (!state.ok() && !s.failed) {
            s.failed = true;
            s.stop_reason = state.status().ToString();
            for (TransferId t : s.pending) {
              if (t != *it) (void)transport_->Cancel(t);
            }
          }
          transport_->Release(*it);
          it = s.pending.erase(it);
        }
        // Only transfers in flight can be late: while none is, the engine is still computing
        // the next layer (the consumer's own deadlines cover a producer that stops).
        if (!s.failed && s.save_scheduled && !s.pending.empty() && now > s.deadline &&
            !SendDone(s)) {
          s.failed = true;
          s.stop_reason = absl::StrCat("sends did not finish within ",
                                       config_.kvstream.send_timeout_ms, " ms");
          for (TransferId t : s.pending) (void)transport_->Cancel(t);
        }
        // A request split over pipeline stages whose other stages never handed it over.
        if (!s.failed && !s.released && now > s.gather_deadline) {
          std::set<int32_t> missing;
          for (int32_t l : layer_set_) {
            if (s.route.count(l) == 0) missing.insert(l);
          }
          FailSend(s, absl::DeadlineExceededError(absl::StrCat(
                          "request ", id, " was handed over by ", DestinationNames(s),
                          " but no consumer asked for layers ", FormatLayerSet(missing),
                          " within ", config_.kvstream.send_timeout_ms,
                          " ms (a pipeline stage is missing, or the stages' layer ranges "
                          "leave a gap)")));
        }
        // A failed request whose transfers all ended: tell its consumers once.
        if (s.failed && s.pending.empty() && !s.stop_notified) {
          s.stop_notified = true;
          for (const SendDestination& d : s.dests) {
            if (d.link->alive) notify.push_back({d.link, AbortMsg{id, s.stop_reason}});
          }
        }
        if (!s.pending.empty() || (s.save_scheduled && !SendDone(s))) outstanding = true;
        // Never given to the engine, so the engine will not finish it: forget it here.
        if (!s.released && s.stop_notified) {
          si = send_.erase(si);
        } else {
          ++si;
        }
      }
      for (auto it = rejected_stages_.begin(); it != rejected_stages_.end();) {
        it = now > it->second.until ? rejected_stages_.erase(it) : std::next(it);
      }
      for (auto it = orphans_.begin(); it != orphans_.end();) {
        auto state = transport_->Test(*it);
        if (state.ok() && *state == TransferState::kInProgress) {
          ++it;
          outstanding = true;
        } else {
          transport_->Release(*it);
          it = orphans_.erase(it);
        }
      }
      for (const auto& [id, r] : recv_) {
        if (r.handed_off && !r.producer_stopped) outstanding = true;
      }
      outstanding_ = outstanding;
    }
    for (const auto& [link, msg] : notify) {
      std::shared_ptr<ControlConnection> conn;
      {
        absl::MutexLock lock(&mu_);
        auto c = link_conns_.find(link.get());
        if (c != link_conns_.end()) conn = c->second;
      }
      if (conn) (void)conn->Send(msg, absl::Now() + absl::Seconds(1));
    }
  }

  // Consumer: a failed request whose producer never confirmed it stopped. After the send
  // deadline the link is closed, so the producer stops every request of ours.
  void CheckRecvDeadlines() {
    std::vector<std::shared_ptr<ProducerLink>> close;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      for (auto& [id, r] : recv_) {
        if (r.failed && !r.producer_stopped && now > r.abort_deadline) {
          auto it = producers_.find(r.producer);
          if (it != producers_.end()) close.push_back(it->second);
          r.producer_stopped = true;
        }
      }
    }
    for (auto& link : close) {
      Log(LogLevel::kWarning, absl::StrCat("producer ", link->address,
                                           " did not confirm an abort; closing the link"));
      LinkLost(*link, absl::DeadlineExceededError("abort not confirmed"));
    }
  }

  void Shutdown() {
    stopping_ = true;
    if (progress_thread_.joinable()) progress_thread_.join();
    if (accept_thread_.joinable()) accept_thread_.join();
    std::vector<std::thread> readers;
    {
      absl::MutexLock lock(&threads_mu_);
      readers = std::move(readers_);
    }
    for (std::thread& t : readers) t.join();
    absl::MutexLock lock(&mu_);
    for (auto& [id, s] : send_) {
      for (TransferId t : s.pending) transport_->Release(t);
    }
    for (TransferId t : orphans_) transport_->Release(t);
    send_.clear();
    recv_.clear();
    producers_.clear();
    link_conns_.clear();
    for (LayerEntry& e : layers_) {
      e.k_reg.reset();
      e.v_reg.reset();
    }
  }

  const KvTransferConfig config_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<ControlListener> listener_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> outstanding_{false};
  std::thread progress_thread_;
  std::thread accept_thread_;
  absl::Mutex threads_mu_;
  std::vector<std::thread> readers_ ABSL_GUARDED_BY(threads_mu_);

  mutable absl::Mutex mu_;
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<LayerEntry> layers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> layer_by_name_ ABSL_GUARDED_BY(mu_);
  std::map<int32_t, int> layer_by_index_ ABSL_GUARDED_BY(mu_);
  int block_size_ ABSL_GUARDED_BY(mu_) = 1;
  int layer_count_ ABSL_GUARDED_BY(mu_) = 0;
  int layer_slots_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t compat_hash_ ABSL_GUARDED_BY(mu_) = 0;
  std::string compat_description_ ABSL_GUARDED_BY(mu_);
  KvConnectorMetadata meta_ ABSL_GUARDED_BY(mu_);
  absl::Status step_error_ ABSL_GUARDED_BY(mu_);
  std::vector<KvConnectorMetadata::Load> pending_loads_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, RecvRequest> recv_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, SendRequest> send_ ABSL_GUARDED_BY(mu_);
  // Requests a pipeline stage's hand-off was rejected for before any other stage handed
  // them over: the other stages' hand-offs are refused until `until` (then forgotten).
  struct RejectedStage {
    std::string why;
    absl::Time until;
  };
  std::map<std::string, RejectedStage> rejected_stages_ ABSL_GUARDED_BY(mu_);
  std::vector<TransferId> orphans_ ABSL_GUARDED_BY(mu_);
  // V transfer -> (layer bytes, post time ns)
  struct LayerSend {
    uint64_t bytes = 0;
    uint64_t post_ns = 0;
    std::string peer;  // the consumer's engine id
  };
  std::map<TransferId, LayerSend> layer_bytes_ ABSL_GUARDED_BY(mu_);
  ConnectorStats stats_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, ConnectorStats> peer_stats_ ABSL_GUARDED_BY(mu_);  // by peer engine id
  std::set<int32_t> layer_set_ ABSL_GUARDED_BY(mu_);  // indices of the registered layers
  std::vector<RequestTransferStats> finished_stats_ ABSL_GUARDED_BY(mu_);
  std::vector<KvRequest> incoming_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<ProducerLink>> producers_ ABSL_GUARDED_BY(mu_);
  std::map<const ConsumerLink*, std::shared_ptr<ControlConnection>> link_conns_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvConnector>> CreateLayerwiseConnector(
    const KvTransferConfig& config, std::unique_ptr<Transport> transport) {
  if (transport == nullptr) return absl::InvalidArgumentError("LayerwiseConnector: null transport");
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
  if (config.kvstream.pipeline_parallel_size > 1 && config.kv_role != KvRole::kConsumer) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LayerwiseConnector: pipeline_parallel_size ", config.kvstream.pipeline_parallel_size,
        " needs kv_role kv_consumer (pipeline-parallel decode); this worker is ",
        KvRoleName(config.kv_role)));
  }
  auto c = std::make_unique<LayerwiseConnectorImpl>(config, std::move(transport));
  RETURN_IF_ERROR(c->Start());
  return c;
}

}  // namespace kvstream
