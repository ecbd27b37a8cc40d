// ProducerSide (producer.h): consumers' connections, the step's saves, layer posts and
// their completion (producer_handoff.cc: what hand-offs must satisfy).
#include "producer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "kvstream/common/int_math.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/connector/layer_routing.h"
#include "layer_notice.h"

namespace kvstream {
namespace internal {

absl::Status ProducerSide::Start() {
  ASSIGN_OR_RETURN(listener_, ControlListener::Listen(
                                  shared_.config.kv_ip,
                                  static_cast<uint16_t>(shared_.config.kv_port)));
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  return absl::OkStatus();
}

void ProducerSide::Stop() {
  if (accept_thread_.joinable()) accept_thread_.join();
  std::vector<ConnectionThread> readers;
  {
    absl::MutexLock lock(&threads_mu_);
    readers = std::move(readers_);
  }
  for (ConnectionThread& t : readers) t.thread.join();
  absl::MutexLock lock(&mu_);
  for (auto& [id, s] : send_) {
    for (TransferId t : s.pending) shared_.transport->Release(t);
  }
  send_.clear();
  links_.clear();  // remote regions go before the transport
}

std::string ProducerSide::control_address() const {
  return listener_ ? absl::StrCat(shared_.config.kv_ip, ":", listener_->port()) : std::string();
}

absl::Status ProducerSide::Prepare(const LayerTable& table) {
  ASSIGN_OR_RETURN(std::unique_ptr<LayerSender> sender,
                   LayerSender::Create(table, *shared_.transport,
                                       shared_.config.kvstream.verify_checksum,
                                       shared_.config.kvstream.cuda_device));
  absl::MutexLock lock(&mu_);
  sender_ = std::move(sender);
  return absl::OkStatus();
}

// ---- control ----

void ProducerSide::JoinFinished() {
  for (auto it = readers_.begin(); it != readers_.end();) {
    if (it->done->load()) {
      it->thread.join();  // it has returned from its work: at most a moment
      it = readers_.erase(it);
    } else {
      ++it;
    }
  }
}

int64_t ProducerSide::connections() const {
  absl::MutexLock lock(&threads_mu_);
  return static_cast<int64_t>(readers_.size());
}

void ProducerSide::AcceptLoop() {
  const size_t max_connections = static_cast<size_t>(shared_.config.kvstream.max_connections);
  // Refusals are logged at most once a second (with the count since), so that a flood of
  // connections cannot flood the log too.
  absl::Time last_report = absl::InfinitePast();
  uint64_t unreported = 0;
  while (!shared_.stopping) {
    {
      absl::MutexLock lock(&threads_mu_);
      JoinFinished();
    }
    auto conn = listener_->Accept(absl::Now() + absl::Milliseconds(100));
    if (!conn.ok()) continue;
    std::shared_ptr<ControlConnection> shared(std::move(*conn));
    absl::MutexLock lock(&threads_mu_);
    JoinFinished();
    if (readers_.size() >= max_connections) {
      shared->Close();
      refused_.fetch_add(1);
      ++unreported;
      if (absl::Now() - last_report >= absl::Seconds(1)) {
        Log(LogLevel::kWarning,
            absl::StrCat("refused control connection from ",
                         absl::CHexEscape(shared->peer_address()), ": ", readers_.size(),
                         " connections are being served (max_connections ", max_connections,
                         "); ", unreported, " refused since the last report"));
        last_report = absl::Now();
        unreported = 0;
      }
      continue;
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    readers_.push_back({std::thread([this, shared, done] {
                          ConsumerLoop(shared);
                          done->store(true);
                        }),
                        done});
  }
}

void ProducerSide::ConsumerLoop(std::shared_ptr<ControlConnection> conn) {
  auto link = std::make_shared<ConsumerLink>();
  link->conn = conn;
  std::shared_ptr<const LayerTable> table = shared_.layers();
  absl::StatusOr<HandshakeOptions> hs = shared_.Handshake(table.get());
  if (!hs.ok()) {
    Log(LogLevel::kWarning, absl::StrCat("cannot answer consumer ",
                                         absl::CHexEscape(conn->peer_address()), ": ",
                                         hs.status().ToString()));
    conn->Close();
    return;
  }
  const std::string transport(shared_.transport->name());
  hs->check = [&](const HelloMsg& peer) -> absl::Status {
    if (table == nullptr) {
      return absl::UnavailableError(absl::StrCat("producer '", shared_.config.engine_id,
                                                 "' has not registered its KV caches yet"));
    }
    ASSIGN_OR_RETURN(ConnectorHello theirs, DecodeConnectorHello(peer.payload));
    RETURN_IF_ERROR(
        CheckCompatible(*table, shared_.config.engine_id, transport, theirs, peer.engine_id));
    link->engine_id = peer.engine_id;
    link->name = absl::StrCat("'", absl::CHexEscape(peer.engine_id), "'");
    RETURN_IF_ERROR(ImportConsumer(peer, *link));
    // A group is a pipeline stage's: a consumer of every layer keeps its own namespace.
    if (link->layers.size() < table->indices().size()) link->group = theirs.group;
    return absl::OkStatus();
  };
  auto peer = HandshakeAsServer(*conn, *hs);
  if (!peer.ok()) {
    // A peer that closes before saying hello is a liveness probe, not an attack.
    Log(absl::IsUnavailable(peer.status()) ? LogLevel::kInfo : LogLevel::kWarning,
        absl::StrCat("rejected consumer ", absl::CHexEscape(conn->peer_address()), ": ",
                     peer.status().ToString()));
    conn->Close();
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    link->scope = ScopeFor(*link);
    links_.push_back(link);
  }
  while (!shared_.stopping) {
    auto msg = ReceiveConnectorMessage(*conn, absl::Now() + absl::Milliseconds(100));
    if (!msg.ok()) {
      if (absl::IsDeadlineExceeded(msg.status()) && !conn->closed()) continue;
      ConsumerLost(link, msg.status());
      conn->Close();
      return;
    }
    absl::Status sent;
    if (auto* m = std::get_if<HandOffMsg>(&*msg)) {
      absl::Status s = AcceptHandOff(*m, link);
      HandOffAckMsg ack;
      ack.request_id = m->request_id;
      ack.status_code = static_cast<int32_t>(s.code());
      ack.message = std::string(s.message().substr(0, kMaxMessageBytes));
      sent = SendConnectorMessage(*conn, ack, absl::Now() + absl::Seconds(1));
    } else if (auto* abort = std::get_if<AbortMsg>(&*msg)) {
      if (!HandleAbort(*abort, link)) {
        // Finished and forgotten, or never handed over on this link: nothing of it is in
        // flight here, so confirm at once (the consumer would otherwise close the link at
        // its deadline, failing every other request on it), with a stop notice behind
        // whatever of it the transport may still carry.
        {
          absl::MutexLock lock(&mu_);
          PostStopNotice(*link, abort->request_id, abort->attempt,
                         "no transfer of it is in flight");
        }
        AbortMsg confirm{abort->request_id, "no transfer of it is in flight", abort->attempt};
        sent = SendConnectorMessage(*conn, confirm, absl::Now() + absl::Seconds(1));
      }
    } else {
      Log(LogLevel::kWarning, absl::StrCat("consumer ", link->name, " sent an unexpected ",
                                           ConnectorMessageName(*msg), " message"));
    }
    if (!sent.ok()) {
      ConsumerLost(link, sent);
      conn->Close();
      return;
    }
  }
}

bool ProducerSide::HandleAbort(const AbortMsg& m, const std::shared_ptr<ConsumerLink>& link) {
  const std::string rid = absl::CHexEscape(m.request_id);
  absl::MutexLock lock(&mu_);
  auto it = send_.find(ScopedRequestId(link->scope, m.request_id));
  if (it == send_.end() || !HasDestination(it->second, link)) return false;
  if (it->second.state == SendState::kDone || it->second.state == SendState::kStopped) {
    return false;
  }
  // Poll confirms once its transfers have ended.
  Fail(it->second, absl::CancelledError(absl::StrCat("consumer aborted request ", rid,
                                                     ": ", absl::CHexEscape(m.reason))));
  return true;
}

void ProducerSide::ConsumerLost(const std::shared_ptr<ConsumerLink>& link,
                                const absl::Status& why) {
  link->alive = false;
  absl::MutexLock lock(&mu_);
  for (auto& [id, s] : send_) {
    if (HasDestination(s, link)) {
      Fail(s, absl::UnavailableError(
                  absl::StrCat("lost consumer ", link->name, ": ", why.message())));
    }
  }
  links_.erase(std::remove(links_.begin(), links_.end(), link), links_.end());
}

std::string ProducerSide::DestinationNames(const SendRequest& s) {
  return absl::StrJoin(s.dests, ", ", [](std::string* out, const Destination& d) {
    absl::StrAppend(out, d.link->name, " (layers ", FormatLayerSet(d.link->layers), ")");
  });
}

bool ProducerSide::HasDestination(const SendRequest& s, const std::shared_ptr<ConsumerLink>& link) {
  for (const Destination& d : s.dests) {
    if (d.link == link) return true;
  }
  return false;
}

// Stops a request's sends; Poll tells the consumers once its transfers have ended.
void ProducerSide::Fail(SendRequest& s, const absl::Status& why) {
  if (s.state == SendState::kFailed || s.state == SendState::kStopped ||
      s.state == SendState::kDone) {
    return;
  }
  s.state = SendState::kFailed;
  std::set<std::string> peers;
  for (const Destination& d : s.dests) peers.insert(d.link->engine_id);
  shared_.stats.SendFailure(peers);
  s.stop_reason = why.ToString();
  Log(LogLevel::kWarning, absl::StrCat("send of request ", s.id, " failed: ", s.stop_reason));
  for (TransferId t : s.pending) (void)shared_.transport->Cancel(t);
}

void ProducerSide::PostStopNotice(const ConsumerLink& link, const std::string& request_id,
                                  uint64_t attempt, absl::string_view reason) {
  absl::StatusOr<std::string> notice = EncodeStopNotice(
      StopNotice{request_id, attempt, std::string(reason.substr(0, kMaxStopReasonBytes))});
  absl::StatusOr<TransferId> id =
      notice.ok() ? shared_.transport->PostNotification(link.peer, *notice)
                  : absl::StatusOr<TransferId>(notice.status());
  if (!id.ok()) {
    Log(LogLevel::kWarning, absl::StrCat("stop notice of request ", absl::CHexEscape(request_id),
                                         " to consumer ", link.name, ": ",
                                         id.status().ToString()));
    return;
  }
  stop_notices_.push_back(*id);
}

void ProducerSide::Settle(SendRequest& s) {
  if (s.settled) return;
  s.settled = true;
  for (const Destination& d : s.dests) {
    --d.link->active_requests;
    d.link->active_tokens -= static_cast<int64_t>(s.prompt.size());
  }
  if (s.layers_posted.empty()) return;  // nothing was sent: no timeline
  if (send_stats_.size() >= KvConnectorWorker::kMaxSendStatsKept) send_stats_.pop_front();
  send_stats_.push_back({s.id, s.consumer_id, s.state == SendState::kDone, s.bytes_sent,
                         std::move(s.ready_ns), std::move(s.sent_ns)});
}

std::vector<RequestSendStats> ProducerSide::TakeSendStats() {
  absl::MutexLock lock(&mu_);
  std::vector<RequestSendStats> out(std::make_move_iterator(send_stats_.begin()),
                                    std::make_move_iterator(send_stats_.end()));
  send_stats_.clear();
  return out;
}

// ---- the step ----

absl::Status ProducerSide::Bind(const KvConnectorMetadata& meta) {
  std::shared_ptr<const LayerTable> table = shared_.layers();
  if (table == nullptr && !meta.saves.empty()) {
    return absl::FailedPreconditionError("connector metadata with saves before RegisterKvCaches");
  }
  absl::Status status;
  absl::MutexLock lock(&mu_);
  step_error_ = absl::OkStatus();
  step_saves_.clear();
  for (const KvConnectorMetadata::Save& save : meta.saves) {
    auto it = send_.find(save.request_id);
    if (it == send_.end() || it->second.state != SendState::kQueued) continue;  // failed meanwhile
    SendRequest& s = it->second;
    const int64_t need = CeilDiv(s.num_tokens, table->block_size());
    if (save.num_tokens != s.num_tokens || static_cast<int64_t>(save.block_ids.size()) < need) {
      const absl::Status bad = absl::InvalidArgumentError(absl::StrCat(
          "request ", s.id, ": a save of ", save.num_tokens, " tokens into ",
          save.block_ids.size(), " blocks, but ", s.num_tokens, " tokens were handed over"));
      Fail(s, bad);
      if (status.ok()) status = bad;
      continue;
    }
    s.local_blocks = save.block_ids;
    s.state = SendState::kSending;
    s.deadline = absl::Now() + absl::Milliseconds(shared_.config.kvstream.send_timeout_ms);
    step_saves_.push_back(s.id);
  }
  for (const std::string& id : meta.finished) {
    auto it = send_.find(id);
    if (it == send_.end() || it->second.state != SendState::kQueued) continue;
    Fail(it->second, absl::AbortedError(absl::StrCat(
                         "the prefill worker finished request ", id, " without sending its KV")));
  }
  return status;
}

absl::Status ProducerSide::PostLayer(absl::string_view layer_name, const KvCache& cache,
                                     void* stream) {
  std::shared_ptr<const LayerTable> table = shared_.layers();
  if (table == nullptr) return absl::OkStatus();
  const LayerEntry* layer = table->ByName(layer_name);
  absl::MutexLock lock(&mu_);
  if (step_saves_.empty() || layer == nullptr) return absl::OkStatus();  // nothing, or shared KV
  if (&cache != layer->cache) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer '", layer_name, "': the cache passed is not the one registered for it"));
  }
  for (const std::string& id : step_saves_) {
    auto it = send_.find(id);
    if (it == send_.end() || it->second.state != SendState::kSending) continue;
    SendRequest& s = it->second;
    // Routing by layer: the layer goes to the consumer (pipeline stage) that owns it.
    auto route = s.route.find(layer->index);
    if (route == s.route.end()) continue;
    const Destination& dest = s.dests[route->second];
    if (!dest.link->alive || !s.layers_posted.insert(layer->index).second) continue;
    auto region = dest.link->regions.find(layer->index);
    TransferId posted_k = 0;
    absl::StatusOr<LayerPost> post =
        region == dest.link->regions.end()
            ? absl::InternalError(absl::StrCat("no consumer region for layer ", layer->index))
            : sender_->Post(*layer, s.consumer_id, dest.attempt, dest.link->peer, *region->second.first,
                            *region->second.second, s.local_blocks, dest.dest_blocks,
                            s.num_tokens, stream, &posted_k);
    if (posted_k != 0) s.pending.push_back(posted_k);
    if (!post.ok()) {
      Fail(s, post.status());
      if (step_error_.ok()) step_error_ = post.status();
      continue;
    }
    s.pending.push_back(post->v);
    layer_sends_[post->v] = {layer->index, post->bytes, post->post_ns, dest.link->engine_id};
    // The deadline measures the transfers, not the prefill: it restarts with every layer
    // posted, so a long prefill is not mistaken for a consumer that stopped taking data.
    s.deadline = absl::Now() + absl::Milliseconds(shared_.config.kvstream.send_timeout_ms);
  }
  shared_.Wake();
  return absl::OkStatus();
}

absl::Status ProducerSide::StepError() const {
  absl::MutexLock lock(&mu_);
  return step_error_;
}

void ProducerSide::ClearStep() {
  absl::MutexLock lock(&mu_);
  step_saves_.clear();
}

// ---- progress ----

bool ProducerSide::Poll() {
  struct Notify {
    std::shared_ptr<ConsumerLink> link;
    AbortMsg msg;
  };
  std::vector<Notify> notify;
  bool outstanding = false;
  std::shared_ptr<const LayerTable> table = shared_.layers();
  const int32_t layer_count = table == nullptr ? 0 : table->count();
  const int64_t send_timeout_ms = shared_.config.kvstream.send_timeout_ms;
  Transport& transport = *shared_.transport;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (sender_ != nullptr) sender_->PollReady();
    for (auto it = stop_notices_.begin(); it != stop_notices_.end();) {
      absl::StatusOr<TransferState> state = transport.Test(*it);
      if (state.ok() && *state == TransferState::kInProgress) {
        outstanding = true;
        ++it;
        continue;
      }
      transport.Release(*it);
      it = stop_notices_.erase(it);
    }
    for (auto si = send_.begin(); si != send_.end();) {
      SendRequest& s = si->second;
      for (auto it = s.pending.begin(); it != s.pending.end();) {
        auto state = transport.Test(*it);
        if (state.ok() && *state == TransferState::kInProgress) {
          ++it;
          continue;
        }
        // A device cache's layer was ready when the GPU got there, not at the host's post.
        const uint64_t gpu_ready_ns = sender_->Done(*it);
        auto ls = layer_sends_.find(*it);
        if (ls != layer_sends_.end()) {
          if (state.ok()) {
            const uint64_t now_ns = MonotonicNs();
            const uint64_t ready_ns = gpu_ready_ns != 0 ? gpu_ready_ns : ls->second.post_ns;
            shared_.stats.LayerSent(
                ls->second.peer, ls->second.bytes,
                now_ns > ready_ns ? static_cast<double>(now_ns - ready_ns) / 1e6 : 0.0);
            if (s.ready_ns.empty()) {
              s.ready_ns.assign(layer_count, 0);
              s.sent_ns.assign(layer_count, 0);
            }
            const int32_t l = ls->second.layer;
            if (l >= 0 && l < layer_count) {
              s.ready_ns[l] = ready_ns;
              s.sent_ns[l] = now_ns;
            }
            s.bytes_sent += ls->second.bytes;
          }
          layer_sends_.erase(ls);
        }
        if (!state.ok()) Fail(s, state.status());
        transport.Release(*it);
        it = s.pending.erase(it);
      }
      if (s.state == SendState::kSending) {
        if (s.pending.empty() && static_cast<int32_t>(s.layers_posted.size()) == layer_count) {
          s.state = SendState::kDone;
          Settle(s);
        } else if (!s.pending.empty() && now > s.deadline) {
          // Only transfers in flight can be late: while none is, the engine is still
          // computing the next layer (the consumer's own deadlines cover a producer that
          // stops).
          Fail(s, absl::DeadlineExceededError(absl::StrCat(
                      "sends did not finish within ", send_timeout_ms, " ms")));
        }
      }
      // A request split over pipeline stages whose other stages never handed it over.
      if (s.state == SendState::kGathering && now > s.gather_deadline) {
        std::set<int32_t> missing;
        for (int32_t l : table->indices()) {
          if (s.route.count(l) == 0) missing.insert(l);
        }
        Fail(s, absl::DeadlineExceededError(absl::StrCat(
                    "request ", s.id, " was handed over by ", DestinationNames(s),
                    " but no consumer asked for layers ", FormatLayerSet(missing), " within ",
                    send_timeout_ms,
                    " ms (a pipeline stage is missing, or the stages' layer ranges leave a "
                    "gap)")));
      }
      // A failed request whose transfers all ended: tell its consumers once.
      if (s.state == SendState::kFailed && s.pending.empty()) {
        s.state = SendState::kStopped;
        Settle(s);
        for (const Destination& d : s.dests) {
          if (!d.link->alive) continue;
          PostStopNotice(*d.link, s.consumer_id, d.attempt, s.stop_reason);
          outstanding = true;
          notify.push_back({d.link, AbortMsg{s.consumer_id, s.stop_reason, d.attempt}});
        }
      }
      if (!s.pending.empty() || s.state == SendState::kSending) outstanding = true;
      // Never given to the engine, so the engine will not finish it: forget it here.
      if (!s.released && s.state == SendState::kStopped) {
        si = send_.erase(si);
      } else {
        ++si;
      }
    }
    for (auto it = rejected_stages_.begin(); it != rejected_stages_.end();) {
      it = now > it->second.until ? rejected_stages_.erase(it) : std::next(it);
    }
  }
  for (const Notify& n : notify) {
    (void)SendConnectorMessage(*n.link->conn, n.msg, absl::Now() + absl::Seconds(1));
  }
  return outstanding;
}

void ProducerSide::TakeOutput(KvConnectorOutput& out) {
  absl::MutexLock lock(&mu_);
  for (IncomingRequest& in : incoming_) out.incoming.push_back(std::move(in));
  incoming_.clear();
  for (auto it = send_.begin(); it != send_.end();) {
    const SendState st = it->second.state;
    if (it->second.released && (st == SendState::kDone || st == SendState::kStopped)) {
      out.finished_sending.insert(it->first);
      it = send_.erase(it);
    } else {
      ++it;
    }
  }
}

int64_t ProducerSide::BlocksInFlight(std::map<std::string, int64_t>* by_peer) const {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  for (const auto& [id, s] : send_) {
    if (s.state != SendState::kSending && s.state != SendState::kFailed) continue;
    const int64_t n = static_cast<int64_t>(s.local_blocks.size());
    total += n;
    // Every stage of a pipeline receives some layers of all the request's blocks.
    if (by_peer != nullptr) {
      for (const Destination& d : s.dests) (*by_peer)[d.link->engine_id] += n;
    }
  }
  return total;
}

}  // namespace internal
}  // namespace kvstream
