// ConsumerSide (consumer.h): its links to producers. Dialing and the handshake, hand-offs,
// what a producer answers on the control channel (acks, aborts) and through the transport
// (stop notices), a link's end, and the aborts a consumer sends.
#include <random>
#include <set>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "consumer.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

absl::Status StatusFromCode(int32_t code, absl::string_view message) {
  if (code <= 0 || code > 16) return absl::UnknownError(message);
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

// The layer indices a producer's hello registered.
std::set<int32_t> HelloLayers(const ConnectorHello& hello) {
  std::set<int32_t> layers;
  for (const RegionDescriptor& r : hello.regions) layers.insert(r.layer);
  return layers;
}

// The load error of a request its producer stopped (its AbortMsg or its stop notice).
absl::Status StoppedByProducer(absl::string_view address, absl::string_view request_id,
                               absl::string_view reason) {
  return absl::AbortedError(absl::StrCat("producer ", absl::CHexEscape(address),
                                         " stopped sending request ",
                                         absl::CHexEscape(request_id), ": ",
                                         absl::CHexEscape(reason)));
}

}  // namespace

absl::StatusOr<ProducerPeers::Dialed> ConsumerSide::Dial(const std::string& host, int port) {
  const std::string key = absl::StrCat(host, ":", port);
  std::shared_ptr<const LayerTable> table = shared_.layers();
  ASSIGN_OR_RETURN(HandshakeOptions hs, shared_.Handshake(table.get()));
  auto connected = ConnectControl(host, static_cast<uint16_t>(port), hs.deadline);
  if (!connected.ok()) {
    shared_.stats.Handshake(key, false);
    return absl::Status(connected.status().code(),
                        absl::StrCat("cannot reach producer ", absl::CHexEscape(key), ": ",
                                     connected.status().message()));
  }
  ProducerPeers::Dialed out;
  out.conn = std::move(*connected);
  const KvTransferConfig& config = shared_.config;
  const std::string transport(shared_.transport->name());
  std::string transport_info;
  hs.check = [&](const HelloMsg& peer) -> absl::Status {
    ASSIGN_OR_RETURN(ConnectorHello theirs, DecodeConnectorHello(peer.payload));
    RETURN_IF_ERROR(
        CheckCompatible(*table, config.engine_id, transport, theirs, peer.engine_id));
    transport_info = theirs.transport_info;
    return CheckStageLayers(config.kvstream, table->indices(), HelloLayers(theirs),
                            absl::StrCat("'", absl::CHexEscape(peer.engine_id), "'"));
  };
  auto peer = HandshakeAsClient(*out.conn, hs);
  shared_.stats.Handshake(peer.ok() ? peer->engine_id : key, peer.ok());
  if (!peer.ok()) {
    // The message may quote the producer's own words: escaped, as every peer string.
    return absl::Status(peer.status().code(),
                        absl::StrCat("handshake with producer ", absl::CHexEscape(key), ": ",
                                     absl::CHexEscape(peer.status().message())));
  }
  out.engine_id = peer->engine_id;
  // Its writes are accepted from now on (lifting the fence of an earlier link's end).
  absl::StatusOr<PeerId> accepted = shared_.transport->Accept(transport_info);
  if (!accepted.ok()) {
    return absl::Status(accepted.status().code(),
                        absl::StrCat("producer ", absl::CHexEscape(key), "'s transport: ",
                                     absl::CHexEscape(accepted.status().message())));
  }
  out.transport_peer = *accepted;
  return out;
}

void ConsumerSide::FenceOff(ProducerLink& link) {
  if (!link.transport_peer.has_value()) return;
  absl::Status s = shared_.transport->Disconnect(*link.transport_peer);
  // NotFound: the transport had already forgotten it (it failed and was closed).
  if (!s.ok() && !absl::IsNotFound(s)) {
    Log(LogLevel::kWarning, absl::StrCat("fencing off producer ", absl::CHexEscape(link.address),
                                         "'s transport: ", s.ToString()));
  }
}

int64_t ConsumerSide::connections() const { return peers_.connections(); }

std::shared_ptr<ConsumerSide::ProducerLink> ConsumerSide::LinkOf(const RecvRequest& r) const {
  std::shared_ptr<ProducerLink> link = peers_.Find(r.producer);
  return link != nullptr && link->serial == r.link && link->alive ? link : nullptr;
}

absl::Status ConsumerSide::HandOff(const KvConnectorMetadata::Load& load) {
  ASSIGN_OR_RETURN(std::shared_ptr<ProducerLink> link,
                   peers_.LinkFor(load.remote.host, load.remote.port));
  HandOffMsg m;
  m.request_id = load.request_id;
  m.prompt_token_ids = load.prompt_token_ids;
  m.dest_block_ids = load.block_ids;
  m.num_tokens = static_cast<uint32_t>(load.num_tokens);
  {
    absl::MutexLock lock(&mu_);
    auto it = recv_.find(load.request_id);
    if (it == recv_.end() || it->second.state != RecvState::kPending) {
      return absl::OkStatus();  // finished meanwhile
    }
    RecvRequest& r = it->second;
    if (next_attempt_ == 0) {
      std::random_device rd;
      next_attempt_ = (static_cast<uint64_t>(rd()) << 32 | rd()) | 1;
    }
    m.attempt = r.attempt = next_attempt_++;
    r.state = RecvState::kLoading;
    r.handoff_time = absl::Now();
    r.handoff_ns = MonotonicNs();
    r.producer = link->address;
    r.producer_id = link->engine_id;
    r.link = link->serial;
  }
  shared_.Wake();
  absl::Status s = SendConnectorMessage(*link->conn, m, absl::Now() + absl::Seconds(5));
  if (!s.ok()) {
    return absl::UnavailableError(absl::StrCat("sending request ",
                                               absl::CHexEscape(load.request_id),
                                               " to producer ", absl::CHexEscape(link->address),
                                               ": ", s.message()));
  }
  return absl::OkStatus();
}

void ConsumerSide::OnMessage(ProducerLink& link, const ConnectorMessage& msg) {
  absl::MutexLock lock(&mu_);
  if (auto* ack = std::get_if<HandOffAckMsg>(&msg)) {
    if (ack->status_code == 0) return;
    auto it = recv_.find(ack->request_id);
    if (it == recv_.end() || it->second.link != link.serial) return;
    Fail(it->second,
         StatusFromCode(ack->status_code,
                        absl::StrCat("producer ", absl::CHexEscape(link.address),
                                     " rejected request ", absl::CHexEscape(ack->request_id),
                                     ": ", absl::CHexEscape(ack->message))));
    MarkStopped(it->second);  // refused: nothing of it is written
  } else if (auto* abort = std::get_if<AbortMsg>(&msg)) {
    auto it = recv_.find(abort->request_id);
    if (it == recv_.end() || it->second.link != link.serial ||
        it->second.attempt != abort->attempt) {
      return;
    }
    Fail(it->second, StoppedByProducer(link.address, abort->request_id, abort->reason));
    // The producer sends this once its transfers of the request completed. Where that
    // means delivered, nothing of it is on its way; elsewhere (UCX over TCP: in the socket)
    // this channel can overtake the writes, and the request stops at the producer's stop
    // notice, which comes behind them (OnStopNotice), or when the link is given up.
    if (shared_.transport->capabilities().delivered_at_completion) MarkStopped(it->second);
  } else {
    Log(LogLevel::kWarning, absl::StrCat("producer ", absl::CHexEscape(link.address),
                                         " sent an unexpected ", ConnectorMessageName(msg),
                                         " message"));
  }
}

void ConsumerSide::LinkLost(ProducerLink& link, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, r] : recv_) {
    if (r.link != link.serial) continue;
    if (r.state == RecvState::kLoading) {
      Fail(r, absl::UnavailableError(
                  absl::StrCat("lost producer ", absl::CHexEscape(link.address), ": ",
                               why.message())));
    }
    MarkStopped(r);
  }
}

void ConsumerSide::QueueAbort(RecvRequest& r, std::vector<Abort>& out) {
  if (r.state != RecvState::kFailed) return;
  std::shared_ptr<ProducerLink> link = LinkOf(r);
  if (link == nullptr) {
    MarkStopped(r);
    return;
  }
  out.push_back({std::move(link), AbortMsg{r.load.request_id, r.error.ToString(), r.attempt}});
}

void ConsumerSide::SendAborts(const std::vector<Abort>& aborts) {
  for (const auto& [link, msg] : aborts) {
    absl::Status s = SendConnectorMessage(*link->conn, msg, absl::Now() + absl::Seconds(1));
    if (!s.ok()) peers_.Lose(*link, s);
  }
}

void ConsumerSide::OnStopNotice(const Notification& n) {
  absl::StatusOr<StopNotice> stop = DecodeStopNotice(n.payload);
  if (!stop.ok()) {
    Log(LogLevel::kWarning, absl::StrCat("dropping a notification from peer ", n.peer, ": ",
                                         stop.status().message()));
    return;
  }
  absl::MutexLock lock(&mu_);
  auto it = recv_.find(stop->request_id);
  if (it == recv_.end() || it->second.attempt != stop->attempt) return;  // late, or another's
  RecvRequest& r = it->second;
  std::shared_ptr<ProducerLink> link = LinkOf(r);
  // Only the producer it was handed to can stop it (another peer's notice is ignored).
  if (link == nullptr || link->transport_peer != n.peer) return;
  if (r.state == RecvState::kLoading) {
    Fail(r, StoppedByProducer(link->address, stop->request_id, stop->reason));
  }
  MarkStopped(r);  // nothing of it is on its way any more
}

}  // namespace internal
}  // namespace kvstream
