// ConsumerSide (consumer.h): the step's loads, layer arrivals and their verification, waits
// with deadlines, and what the engine is told (consumer_links.cc: the links to producers).
#include "consumer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvstream/common/int_math.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {

ConsumerSide::ConsumerSide(WorkerShared& shared)
    : shared_(shared), peers_([this] {
        const KvstreamSettings& k = shared_.config.kvstream;
        ProducerPeers::Options o;
        o.reconnect.initial = absl::Milliseconds(k.reconnect_backoff_ms);
        o.reconnect.max = absl::Milliseconds(k.reconnect_backoff_max_ms);
        o.max_connections = static_cast<size_t>(k.max_connections);
        o.dial = [this](const std::string& host, int port) { return Dial(host, port); };
        o.on_message = [this](ProducerLink& link, ConnectorMessage m) { OnMessage(link, m); };
        o.on_end = [this](ProducerLink& link) { FenceOff(link); };
        o.on_lost = [this](ProducerLink& link, const absl::Status& why) { LinkLost(link, why); };
        o.stopping = &shared_.stopping;
        return o;
      }()) {}

void ConsumerSide::Stop() {
  peers_.Stop();
  absl::MutexLock lock(&mu_);
  recv_.clear();
}

absl::Status ConsumerSide::Prepare(const LayerTable& table) {
  if (table.memory() != MemoryKind::kDevice || !shared_.config.kvstream.verify_checksum) {
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(device_verifier_, DeviceVerifier::Create(shared_.config.kvstream.cuda_device));
  return absl::OkStatus();
}

absl::Status ConsumerSide::Bind(const KvConnectorMetadata& meta) {
  std::shared_ptr<const LayerTable> table = shared_.layers();
  if (table == nullptr && (!meta.loads.empty() || !meta.waits.empty())) {
    return absl::FailedPreconditionError("connector metadata with loads before RegisterKvCaches");
  }
  std::vector<Abort> aborts;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    for (const KvConnectorMetadata::Load& load : meta.loads) {
      if (recv_.count(load.request_id) != 0) {
        if (status.ok()) {
          status = absl::AlreadyExistsError(absl::StrCat(
              "request ", absl::CHexEscape(load.request_id), " is already loading; its second load is ignored"));
        }
        continue;
      }
      const int64_t need = CeilDiv(load.num_tokens, table->block_size());
      if (load.num_tokens <= 0 || static_cast<int64_t>(load.block_ids.size()) < need) {
        if (status.ok()) {
          status = absl::InvalidArgumentError(absl::StrCat(
              "request ", absl::CHexEscape(load.request_id), ": ", load.block_ids.size(), " blocks for ",
              load.num_tokens, " remote tokens of block size ", table->block_size()));
        }
        continue;
      }
      RecvRequest& r = recv_[load.request_id];
      r.load = load;
      r.producer = absl::StrCat(load.remote.host, ":", load.remote.port);
      r.layers.assign(table->slots(), LayerState::kMissing);
      r.landed.assign(table->slots(), LayerNotice());
      step_loads_.push_back(load);
    }
    waits_ = meta.waits;
    for (const std::string& id : meta.finished) {
      auto it = recv_.find(id);
      if (it == recv_.end()) continue;
      RecvRequest& r = it->second;
      if (r.state == RecvState::kPending) {
        r.state = RecvState::kStopped;  // never handed over: nothing can land
      } else if (r.state == RecvState::kLoading) {
        Fail(r, absl::CancelledError("the request finished before its KV arrived"));
        QueueAbort(r, aborts);
      }
    }
  }
  SendAborts(aborts);
  return status;
}

absl::Status ConsumerSide::StartLoads() {
  if (shared_.layers() == nullptr) {
    return absl::FailedPreconditionError("StartLoadKv before RegisterKvCaches");
  }
  std::vector<KvConnectorMetadata::Load> loads;
  {
    absl::MutexLock lock(&mu_);
    loads = std::move(step_loads_);
    step_loads_.clear();
  }
  for (const KvConnectorMetadata::Load& load : loads) {
    absl::Status s = HandOff(load);
    if (s.ok()) continue;
    // A producer known from an earlier link is charged by its engine id, as while it was up.
    const std::string known =
        peers_.engine_id(absl::StrCat(load.remote.host, ":", load.remote.port));
    absl::MutexLock lock(&mu_);
    auto it = recv_.find(load.request_id);
    if (it == recv_.end()) continue;
    if (it->second.producer_id.empty()) it->second.producer_id = known;
    Fail(it->second, s);
    MarkStopped(it->second);  // the producer never accepted it: nothing can land
  }
  return absl::OkStatus();
}

void ConsumerSide::Fail(RecvRequest& r, absl::Status status) {
  if (r.state != RecvState::kPending && r.state != RecvState::kLoading) return;
  r.state = RecvState::kFailed;
  shared_.stats.LoadError(PeerOf(r));
  r.error = std::move(status);
  r.abort_deadline = absl::Now() + absl::Milliseconds(shared_.config.kvstream.send_timeout_ms);
  errors_.push_back({r.load.request_id, r.load.block_ids, r.error});
  Log(LogLevel::kWarning, absl::StrCat("load error: ", r.error.ToString()));
}

void ConsumerSide::MarkStopped(RecvRequest& r) {
  if (r.state == RecvState::kFailed) r.state = RecvState::kStopped;
}

absl::Status ConsumerSide::WaitForLayer(absl::string_view layer_name) {
  std::shared_ptr<const LayerTable> table = shared_.layers();
  if (table == nullptr) return absl::OkStatus();
  const LayerEntry* layer = table->ByName(layer_name);
  if (layer == nullptr) return absl::OkStatus();  // a layer that shares another's KV
  const int32_t index = layer->index;
  const int64_t timeout_ms = shared_.config.kvstream.load_timeout_ms;
  std::vector<Abort> aborts;
  std::vector<Verification> verifications;
  {
    absl::MutexLock lock(&mu_);
    if (waits_.empty()) return absl::OkStatus();
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const std::string& id : waits_) {
        auto r = recv_.find(id);
        if (r == recv_.end() || r->second.state != RecvState::kLoading) continue;
        if (!InPlace(r->second.layers[index])) return false;
      }
      return true;
    };
    // The producers still owing this layer when the wait starts share its time.
    std::set<std::string> owing;
    for (const std::string& id : waits_) {
      auto r = recv_.find(id);
      if (r != recv_.end() && r->second.state == RecvState::kLoading &&
          !InPlace(r->second.layers[index])) {
        owing.insert(PeerOf(r->second));
      }
    }
    const absl::Time wait_start = absl::Now();
    const uint64_t wait_start_ns = MonotonicNs();
    mu_.AwaitWithDeadline(absl::Condition(&ready), wait_start + absl::Milliseconds(timeout_ms));
    const double waited = absl::ToDoubleMilliseconds(absl::Now() - wait_start);
    shared_.stats.Waited(owing, waited);
    for (const std::string& id : waits_) {
      auto it = recv_.find(id);
      if (it == recv_.end()) continue;
      RecvRequest& r = it->second;
      r.wait_ms += waited;
      // Exposed transfer: the part of the wait when the layer was already posted and in
      // flight (the rest was the producer still computing it).
      // Unknown for device caches (post_ns 0: the host posts ahead of the GPU).
      if (InPlace(r.layers[index]) && r.arrival_ns.size() > static_cast<size_t>(index) &&
          r.arrival_ns[index] != 0 &&
          r.post_ns[index] != 0) {
        const uint64_t from = std::max(r.post_ns[index], wait_start_ns);
        if (r.arrival_ns[index] > from) {
          const double ms = static_cast<double>(r.arrival_ns[index] - from) / 1e6;
          r.exposed_ms += ms;
          shared_.stats.Exposed(PeerOf(r), ms);
        }
      }
    }
    // The layer's deferred verifications start now, just before its own kernels.
    for (const std::string& id : waits_) {
      auto it = recv_.find(id);
      if (it != recv_.end() && it->second.state == RecvState::kLoading) {
        TakeLanded(it->second, index, verifications);
      }
    }
    for (const std::string& id : waits_) {
      auto it = recv_.find(id);
      if (it == recv_.end() || it->second.state != RecvState::kLoading ||
          InPlace(it->second.layers[index])) {
        continue;
      }
      Fail(it->second, absl::DeadlineExceededError(absl::StrCat(
                           "layer '", layer_name, "' of request ", absl::CHexEscape(id),
                           " did not arrive within ",
                           timeout_ms, " ms")));
      QueueAbort(it->second, aborts);
    }
  }
  SendAborts(aborts);
  StartVerifications(std::move(verifications));
  // The failed requests are load errors; the layer runs for the rest of the batch.
  return absl::OkStatus();
}

void ConsumerSide::TakeLanded(RecvRequest& r, int32_t layer, std::vector<Verification>& out) {
  const int32_t begin = layer < 0 ? 0 : layer;
  const int32_t end = layer < 0 ? static_cast<int32_t>(r.layers.size()) : layer + 1;
  for (int32_t l = begin; l < end; ++l) {
    if (r.layers[l] != LayerState::kLanded) continue;
    r.layers[l] = LayerState::kVerifying;
    out.push_back({std::move(r.landed[l]), r.load.block_ids, r.load.num_tokens});
    r.landed[l] = LayerNotice();
  }
}

void ConsumerSide::StartVerifications(std::vector<Verification> verifications) {
  if (verifications.empty()) return;
  std::shared_ptr<const LayerTable> table = shared_.layers();
  for (Verification& v : verifications) {
    const KvCacheView view = table->ByIndex(static_cast<int32_t>(v.notice.layer))->cache->view();
    absl::StatusOr<LayerRuns> runs = PlanLayerRuns(view, v.block_ids, v.block_ids, v.num_tokens);
    absl::Status s = runs.status();
    if (s.ok()) {
      absl::MutexLock lock(&verifier_mu_);
      s = device_verifier_->Start(view, *runs, v.notice);
    }
    if (!s.ok()) Arrived(v.notice.request_id, v.notice, s);
  }
  shared_.Wake();  // the progress thread polls for the verdicts
}

bool ConsumerSide::StepVerified() const {
  for (const std::string& id : waits_) {
    auto it = recv_.find(id);
    if (it == recv_.end() || it->second.state != RecvState::kLoading) continue;
    for (LayerState l : it->second.layers) {
      if (l == LayerState::kLanded || l == LayerState::kVerifying) return false;
    }
  }
  return true;
}

void ConsumerSide::ClearStep() {
  // The step's outputs are read once this returns: its requests' verdicts come first.
  std::vector<Verification> verifications;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& id : waits_) {
      auto it = recv_.find(id);
      if (it != recv_.end() && it->second.state == RecvState::kLoading) {
        TakeLanded(it->second, -1, verifications);
      }
    }
  }
  StartVerifications(std::move(verifications));
  std::vector<Abort> aborts;
  {
  absl::MutexLock lock(&mu_);
  const int64_t timeout_ms = shared_.config.kvstream.load_timeout_ms;
  if (!mu_.AwaitWithDeadline(absl::Condition(this, &ConsumerSide::StepVerified),
                             absl::Now() + absl::Milliseconds(timeout_ms))) {
    for (const std::string& id : waits_) {
      auto it = recv_.find(id);
      if (it == recv_.end() || it->second.state != RecvState::kLoading) continue;
      Fail(it->second, absl::DeadlineExceededError(absl::StrCat(
                           "the GPU did not verify the checksums of request ",
                           absl::CHexEscape(id), " within ", timeout_ms, " ms")));
      QueueAbort(it->second, aborts);
    }
  }
  waits_.clear();
  step_loads_.clear();
  for (auto it = recv_.begin(); it != recv_.end();) {
    const RecvRequest& r = it->second;
    if (r.state != RecvState::kReported) {
      ++it;
      continue;
    }
    finished_stats_.push_back(
        {it->first, r.bytes, r.layer_ms, r.wait_ms, r.transfer_ms, r.exposed_ms,
         r.in_flight_ms, r.handoff_ns, r.complete_ms});
    it = recv_.erase(it);
  }
  }
  SendAborts(aborts);
}

void ConsumerSide::OnNotice(const Notification& n) {
  if (IsStopNotice(n.payload)) {
    OnStopNotice(n);
    return;
  }
  absl::StatusOr<LayerNotice> notice = DecodeLayerNotice(n.payload);
  if (!notice.ok()) {
    Log(LogLevel::kWarning, absl::StrCat("dropping a notification from peer ", n.peer, ": ",
                                         notice.status().message()));
    return;
  }
  std::shared_ptr<const LayerTable> table = shared_.layers();
  if (table == nullptr || table->ByIndex(static_cast<int32_t>(notice->layer)) == nullptr) return;
  KvConnectorMetadata::Load load;
  {
    absl::MutexLock lock(&mu_);
    auto r = recv_.find(notice->request_id);
    if (r == recv_.end() || r->second.state != RecvState::kLoading ||
        r->second.attempt != notice->attempt ||
        r->second.layers[notice->layer] != LayerState::kMissing) {
      return;  // late (aborted, or of an earlier attempt of this id) or duplicate
    }
    r->second.layers[notice->layer] = LayerState::kChecking;
    load = r->second.load;
  }
  const KvCacheView view = table->ByIndex(static_cast<int32_t>(notice->layer))->cache->view();
  absl::Status verdict;
  absl::StatusOr<LayerRuns> runs =
      PlanLayerRuns(view, load.block_ids, load.block_ids, load.num_tokens);
  if (!runs.ok()) {
    verdict = runs.status();
  } else if (runs->bytes != notice->bytes) {
    verdict = absl::DataLossError(absl::StrCat("request ", absl::CHexEscape(notice->request_id), " layer ",
                                               notice->layer, ": producer sent ", notice->bytes,
                                               " bytes, expected ", runs->bytes));
  } else if (shared_.config.kvstream.verify_checksum &&
             notice->checksum_kind != ChecksumKind::kNone) {
    const bool device = view.memory == MemoryKind::kDevice;
    if (device && notice->checksum_kind == ChecksumKind::kKvsum64 && device_verifier_ != nullptr) {
      // In place; verified on the GPU later (see the header), Arrived then completes it.
      absl::MutexLock lock(&mu_);
      auto it = recv_.find(notice->request_id);
      if (it == recv_.end() || it->second.state != RecvState::kLoading ||
          it->second.attempt != notice->attempt ||
          it->second.layers[notice->layer] != LayerState::kChecking) {
        return;
      }
      RecvRequest& r = it->second;
      r.layers[notice->layer] = LayerState::kLanded;
      r.landed[notice->layer] = *notice;
      RecordLanding(r, *notice);
      return;
    } else if (!device) {
      uint64_t sum = 0;
      if (notice->checksum_kind == ChecksumKind::kXxh3) {
        sum = HostLayerChecksum(view, *runs, /*destination=*/true);
      } else {
        sum = Kvsum64Host(LayerSpans(view, *runs, /*destination=*/true));
      }
      if (sum != notice->checksum) {
        verdict = absl::DataLossError(absl::StrCat(
            "request ", absl::CHexEscape(notice->request_id), " layer ", notice->layer, ": checksum mismatch (got ",
            absl::Hex(sum), ", producer sent ", absl::Hex(notice->checksum), ")"));
      }
    } else {
      verdict = absl::DataLossError(absl::StrCat(
          "request ", absl::CHexEscape(notice->request_id), " layer ", notice->layer,
          ": a device cache cannot check a checksum of kind ",
          static_cast<int>(notice->checksum_kind)));
    }
  }
  Arrived(notice->request_id, *notice, verdict);
}

void ConsumerSide::Arrived(const std::string& id, const LayerNotice& notice,
                           const absl::Status& verdict) {
  if (!verdict.ok()) {
    // A corrupt layer fails the request (this attempt of it); the producer is told to stop
    // (its confirmation lets the blocks go without waiting for the deadline that closes the
    // whole link).
    std::vector<Abort> aborts;
    {
      absl::MutexLock lock(&mu_);
      auto it = recv_.find(id);
      if (it == recv_.end() || it->second.attempt != notice.attempt) return;
      Fail(it->second, verdict);
      QueueAbort(it->second, aborts);
    }
    SendAborts(aborts);
    return;
  }
  std::shared_ptr<const LayerTable> table = shared_.layers();
  absl::MutexLock lock(&mu_);
  auto it = recv_.find(id);
  if (it == recv_.end() || it->second.state != RecvState::kLoading ||
      it->second.attempt != notice.attempt) {
    return;
  }
  RecvRequest& r = it->second;
  const size_t l = notice.layer;
  if (r.layers[l] == LayerState::kChecking) RecordLanding(r, notice);
  r.layers[l] = LayerState::kArrived;
  ++r.arrived;
  r.bytes += notice.bytes;
  const double latency_ms = r.in_flight_ms[l] > 0 ? r.in_flight_ms[l] : -1;
  shared_.stats.LayerReceived(PeerOf(r), notice.bytes, latency_ms);
  if (r.arrived == table->count()) {
    r.state = RecvState::kComplete;
    r.complete_ms = static_cast<double>(MonotonicNs() - r.handoff_ns) / 1e6;
  }
}

void ConsumerSide::RecordLanding(RecvRequest& r, const LayerNotice& notice) {
  const size_t l = notice.layer;
  ++r.in_place;
  const uint64_t now_ns = MonotonicNs();
  if (r.post_ns.size() < r.layers.size()) {
    r.post_ns.assign(r.layers.size(), 0);
    r.arrival_ns.assign(r.layers.size(), 0);
    r.layer_ms.assign(r.layers.size(), 0.0);
    r.in_flight_ms.assign(r.layers.size(), 0.0);
  }
  if (notice.post_ns != 0 && now_ns > notice.post_ns) {
    const double latency_ms = static_cast<double>(now_ns - notice.post_ns) / 1e6;
    r.transfer_ms += latency_ms;
    r.in_flight_ms[l] = latency_ms;
  }
  r.post_ns[l] = notice.post_ns;
  r.arrival_ns[l] = now_ns;
  r.layer_ms[l] = static_cast<double>(now_ns - r.handoff_ns) / 1e6;
}

bool ConsumerSide::Poll() {
  std::vector<std::shared_ptr<ProducerLink>> close;
  bool outstanding = false;
  std::vector<Verification> verifications;
  if (device_verifier_ != nullptr) {
    std::vector<DeviceVerifier::Verdict> verdicts;
    {
      absl::MutexLock lock(&verifier_mu_);
      verdicts = device_verifier_->Poll();
      outstanding = device_verifier_->busy();
    }
    for (DeviceVerifier::Verdict& v : verdicts) {
      Arrived(v.notice.request_id, v.notice, v.status);
    }
  }
  {
    std::shared_ptr<const LayerTable> table = shared_.layers();
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (auto& [id, r] : recv_) {
      if (r.state == RecvState::kLoading) outstanding = true;
      // A request no step waits for: all its layers verified together once all landed.
      if (r.state == RecvState::kLoading && table != nullptr && r.in_place == table->count() &&
          r.arrived < r.in_place &&
          std::find(waits_.begin(), waits_.end(), id) == waits_.end()) {
        TakeLanded(r, -1, verifications);
      }
      // A failed request whose producer never confirmed it stopped: after the send
      // deadline the link is closed, so the producer stops every request of ours.
      if (r.state == RecvState::kFailed) {
        outstanding = true;
        if (now > r.abort_deadline) {
          // Stopped by the link's end (LinkLost), after FenceOff: not before, or its blocks
          // could be reused while the producer's writes still land.
          std::shared_ptr<ProducerLink> link = LinkOf(r);
          if (link != nullptr) {
            close.push_back(std::move(link));
          } else {
            MarkStopped(r);  // its link already ended, and fenced the producer off
          }
        }
      }
    }
  }
  StartVerifications(std::move(verifications));
  for (auto& link : close) {
    Log(LogLevel::kWarning, absl::StrCat("producer ", absl::CHexEscape(link->address),
                                         " did not confirm an abort; closing the link"));
    peers_.Lose(*link, absl::DeadlineExceededError("abort not confirmed"));
  }
  return outstanding;
}

void ConsumerSide::TakeOutput(KvConnectorOutput& out) {
  absl::MutexLock lock(&mu_);
  for (LoadError& e : errors_) out.load_errors.push_back(std::move(e));
  errors_.clear();
  for (auto it = recv_.begin(); it != recv_.end();) {
    RecvRequest& r = it->second;
    if (r.state == RecvState::kComplete) {
      out.finished_recving.insert(it->first);
      if (std::find(waits_.begin(), waits_.end(), it->first) != waits_.end()) {
        r.state = RecvState::kReported;  // the step's remaining waits still count
        ++it;
      } else {
        finished_stats_.push_back(
            {it->first, r.bytes, r.layer_ms, r.wait_ms, r.transfer_ms, r.exposed_ms,
         r.in_flight_ms, r.handoff_ns, r.complete_ms});
        it = recv_.erase(it);
      }
    } else if (r.state == RecvState::kStopped) {
      out.finished_recving.insert(it->first);
      it = recv_.erase(it);
    } else {
      ++it;
    }
  }
}

int64_t ConsumerSide::BlocksInFlight(std::map<std::string, int64_t>* by_peer) const {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  for (const auto& [id, r] : recv_) {
    if (r.state != RecvState::kLoading && r.state != RecvState::kFailed) continue;
    const int64_t n = static_cast<int64_t>(r.load.block_ids.size());
    total += n;
    if (by_peer != nullptr) (*by_peer)[PeerOf(r)] += n;
  }
  return total;
}

std::vector<RequestTransferStats> ConsumerSide::TakeRequestStats() {
  absl::MutexLock lock(&mu_);
  return std::move(finished_stats_);
}

}  // namespace internal
}  // namespace kvstream
