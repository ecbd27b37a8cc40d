// UcxCore's transitions and the UCX callbacks that drive them (see ucx_core.h).
//
// A transfer: every segment is posted with ucp_put_nbx, or as write pieces over TCP
// (ucx/am_writes.h) (no callback; a returned request is freed at once, since the flush
// below covers it), then one ucp_ep_flush_nbx; when the flush
// completes - all puts are then complete at the target - the notification is sent as an
// eager active message whose header carries the sender's uid, so the receiver can name the
// sender even if it never connected back. The transfer is kDone when that send completes.
//
// Copy threads: a transfer whose segments a CopyPool copies starts in kCopying and waits in
// its peer's `waiting` queue, in post order, until its copies are done and every earlier
// one has moved on, so that a notification still follows the data of every write posted
// before it (a put transfer or a notification posted behind a copying transfer waits there
// too). A transfer that fails or is cancelled while copying abandons its job, which returns
// once no piece of it is being copied.
#include "ucx/ucx_core.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "ucx/am_writes.h"
#include "ucx/staged_engine.h"
#include "ucx/ucx_status.h"

namespace kvstream {
namespace internal {
namespace {

// --- UCX callbacks (run inside UCX calls made with UcxCore::mu held) ---

void OnAmSent(void* request, ucs_status_t status, void* user_data)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto* t = static_cast<UcxTransfer*>(user_data);
  UcxCore* core = t->core;
  if (!core->RequestDone(t, request) || t->phase != Phase::kNotifying) return;
  if (status == UCS_OK) {
    core->CompleteTransfer(t);
  } else {
    core->FailTransfer(t, UcxStatusToStatus(status, "am_send_nbx", t->peer->label));
  }
}

void OnFlushed(void* request, ucs_status_t status, void* user_data)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto* t = static_cast<UcxTransfer*>(user_data);
  UcxCore* core = t->core;
  if (!core->RequestDone(t, request)) return;
  t->write_headers = {};  // every piece before the flush has left: UCX is done with them
  if (t->phase != Phase::kFlushing) return;
  if (status == UCS_OK) {
    core->SendNotification(t);
  } else {
    core->FailTransfer(t, UcxStatusToStatus(status, "ep_flush_nbx", t->peer->label));
  }
}

ucs_status_t OnNotification(void* arg, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto* core = static_cast<UcxCore*>(arg);
  absl::StatusOr<NotificationHeaderFields> sender = DecodeNotificationHeader(
      absl::string_view(static_cast<const char*>(header), header_length));
  if (!sender.ok()) {
    Log(LogLevel::kWarning, absl::StrCat("UCX: dropped a malformed notification: ",
                                         sender.status().message()));
    return UCS_OK;
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // Senders force eager; a rendezvous message is not from this version of kvstream.
    Log(LogLevel::kWarning, "UCX: dropped a rendezvous notification");
    return UCS_OK;
  }
  // From a sender this side fenced off: a notice of writes it refused too.
  if (core->Fenced(sender->sender_uid, sender->stamp)) return UCS_OK;
  UcxPeer* peer = core->PeerForUid(sender->sender_uid);
  Notification n;
  n.peer = peer->id;
  n.payload.assign(static_cast<const char*>(data), length);
  DeliverNotification(core, peer, sender->watermark, std::move(n));
  return UCS_OK;
}

void OnControlSent(void* request, ucs_status_t status, void* user_data)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto* send = static_cast<ControlSend*>(user_data);
  ucp_request_free(request);
  // A failed send fails the endpoint, whose error callback reports it.
  send->core->control_sends.erase(send);
}

}  // namespace

UcxTransfer::UcxTransfer() = default;
UcxTransfer::~UcxTransfer() = default;

bool UcxTransfer::copying() const {
  if (job != nullptr && !job->finished()) return true;
  return staged != nullptr && !StagedSendFinished(*staged);
}

UcxPeer::UcxPeer() = default;
UcxPeer::~UcxPeer() = default;

UcxCore::UcxCore() = default;

void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto* peer = static_cast<UcxPeer*>(arg);
  peer->core->FailPeer(peer, UcxStatusToStatus(status, "endpoint error", peer->label));
}

UcxCore::~UcxCore() {
  // Handles (registrations, remote keys) are gone by now: each holds a reference.
  allocations.clear();
  peers.clear();
  transfers.clear();
  zombies.clear();
}

absl::Status UcxCore::InstallHandlers() {
  ucp_am_handler_param_t am;
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = kNotificationAmId;
  am.flags = UCP_AM_FLAG_WHOLE_MSG;
  am.cb = OnNotification;
  am.arg = this;
  RETURN_IF_ERROR(UcxStatusToStatus(ucp_worker_set_am_recv_handler(worker.get(), &am),
                                    "set_am_recv_handler"));
  am.id = kWriteAmId;
  am.cb = OnWritePiece;
  RETURN_IF_ERROR(UcxStatusToStatus(ucp_worker_set_am_recv_handler(worker.get(), &am),
                                    "set_am_recv_handler (writes)"));
  am.id = kStagedAmId;
  am.cb = OnStagedMessage;
  return UcxStatusToStatus(ucp_worker_set_am_recv_handler(worker.get(), &am),
                           "set_am_recv_handler (staged)");
}

absl::Status UcxCore::ConnectPeer(UcxPeer* peer, const std::string& address) {
  ucp_ep_params_t params;
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = OnEndpointError;
  params.err_handler.arg = peer;
  ucp_ep_h ep = nullptr;
  RETURN_IF_ERROR(
      UcxStatusToStatus(ucp_ep_create(worker.get(), &params, &ep), "ep_create", peer->label));
  peer->ep = UcxEndpoint(worker.get(), ep);
  peer->connected = true;
  return absl::OkStatus();
}

void UcxCore::SendControl(UcxPeer* peer, StagedType type, std::string body) {
  if (!peer->ep || !peer->status.ok() || shut_down) return;
  auto owned = std::make_unique<ControlSend>();
  ControlSend* send = owned.get();
  send->core = this;
  send->header = EncodeStagedHeader(type, uid, peer->stamp);
  send->body = std::move(body);
  ucp_request_param_t param;
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_EAGER;
  param.cb.send = OnControlSent;
  param.user_data = send;
  ucs_status_ptr_t request =
      ucp_am_send_nbx(peer->ep.get(), kStagedAmId, send->header.data(), send->header.size(),
                      send->body.data(), send->body.size(), &param);
  if (UCS_PTR_IS_ERR(request)) {
    FailPeer(peer, UcxStatusToStatus(UCS_PTR_STATUS(request), "am_send_nbx (staged)",
                                     peer->label));
  } else if (request != nullptr) {
    send->request = request;
    control_sends.emplace(send, std::move(owned));
  }
}

UcxPeer* UcxCore::NewPeer(uint64_t peer_uid) {
  auto peer = std::make_unique<UcxPeer>();
  peer->core = this;
  peer->id = next_peer++;
  peer->uid = peer_uid;
  peer->label = absl::StrCat("peer ", peer->id, " (uid ", absl::Hex(peer_uid), ")");
  UcxPeer* raw = peer.get();
  peers.emplace(raw->id, std::move(peer));
  return raw;
}

UcxPeer* UcxCore::PeerForUid(uint64_t sender_uid) {
  UcxPeer* found = nullptr;
  for (auto& [id, peer] : peers) {
    if (peer->uid != sender_uid || peer->disconnected) continue;
    if (found == nullptr || (peer->connected && !found->connected)) found = peer.get();
  }
  if (found == nullptr) found = NewPeer(sender_uid);
  return found;
}

bool UcxCore::Fenced(uint64_t sender_uid, uint64_t stamp) const {
  if (refused_uids.count(sender_uid) != 0) return true;
  const auto it = stamps_from.find(sender_uid);
  return it != stamps_from.end() && stamp < it->second;
}

void UcxCore::Fence(uint64_t sender_uid) {
  refused_uids.insert(sender_uid);
  ++fence_epoch;
  stamps_from[sender_uid] = fence_epoch;
  RefreshLocalInfo();
}

void UcxCore::RefreshLocalInfo() {
  UcxWorkerInfo info;
  info.uid = uid;
  info.fence_epoch = fence_epoch;
  info.address = worker_address;
  local_info = EncodeWorkerInfo(info);
}

void UcxCore::FailTransfer(UcxTransfer* t, absl::Status status) {
  if (!t->active()) return;
  UcxPeer* peer = t->peer;
  peer->outstanding.erase(t);
  const bool was_waiting = t->phase == Phase::kCopying;
  t->phase = Phase::kFailed;
  t->status = std::move(status);
  if (t->job != nullptr && !t->job->finished()) CopyPool::Abandon(*t->job);
  t->job.reset();
  if (t->staged != nullptr) StagedTransferFailed(this, t);
  if (was_waiting) {
    auto it = std::find(peer->waiting.begin(), peer->waiting.end(), t);
    if (it != peer->waiting.end()) peer->waiting.erase(it);
    Pump(peer);  // the transfers behind it may go on
  }
}

void UcxCore::Pump(UcxPeer* peer) {
  while (!peer->waiting.empty() && peer->status.ok() && !peer->disconnected && peer->ep &&
         !shut_down) {
    UcxTransfer* t = peer->waiting.front();
    if (t->copying()) return;
    peer->waiting.pop_front();
    t->job.reset();
    absl::Status status = StartFlush(t);
    if (!status.ok()) FailTransfer(t, std::move(status));
  }
}

void UcxCore::CopiesDone(TransferId id) {
  absl::MutexLock lock(&mu);
  auto it = transfers.find(id);
  if (it == transfers.end() || it->second->phase != Phase::kCopying) return;
  Pump(it->second->peer);
}

void UcxCore::FailCopiesThrough(const void* handle, absl::string_view what) {
  for (auto& [id, t] : transfers) {
    if (t->phase != Phase::kCopying || !t->copying()) continue;
    if (t->local_handle != handle && t->remote_handle != handle) continue;
    FailTransfer(t.get(), absl::CancelledError(absl::StrCat(
                              "UCX transfer ", id, " to ", t->peer->label, " cancelled: ",
                              what, " was destroyed while the transfer was copying")));
  }
}

void UcxCore::CompleteTransfer(UcxTransfer* t) {
  t->peer->outstanding.erase(t);
  t->phase = Phase::kDone;
}

void UcxCore::FailPeer(UcxPeer* peer, const absl::Status& error) {
  if (!peer->status.ok()) return;
  peer->status = error;
  std::vector<UcxTransfer*> outstanding(peer->outstanding.begin(), peer->outstanding.end());
  for (UcxTransfer* t : outstanding) FailTransfer(t, error);
  // A peer the user already disconnected from is not news to report.
  if (!peer->disconnected) peer_errors.emplace_back(peer->id, error);
  StagedPeerFailed(this, peer);
  maintenance = true;
}

bool UcxCore::RequestDone(UcxTransfer* t, void* request) {
  ucp_request_free(request);
  t->request = nullptr;
  if (t->released) {
    zombies.erase(t);
    return false;
  }
  return true;
}

void UcxCore::SendNotification(UcxTransfer* t) {
  if (t->payload.empty()) {
    CompleteTransfer(t);
    return;
  }
  // The tail's producer ran before the write's ready event, which the write's GPU work
  // (or StagedSendFinished) has seen complete by now.
  if (t->tail != nullptr) {
    t->payload.append(static_cast<const char*>(t->tail), t->tail_bytes);
    t->tail = nullptr;
  }
  t->header = EncodeNotificationHeader(uid, t->peer->stamp, t->watermark);
  ucp_request_param_t param;
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_EAGER;
  param.cb.send = OnAmSent;
  param.user_data = t;
  ucs_status_ptr_t request =
      ucp_am_send_nbx(t->peer->ep.get(), kNotificationAmId, t->header.data(), t->header.size(),
                      t->payload.data(), t->payload.size(), &param);
  if (request == nullptr) {
    CompleteTransfer(t);
  } else if (UCS_PTR_IS_ERR(request)) {
    FailTransfer(t, UcxStatusToStatus(UCS_PTR_STATUS(request), "am_send_nbx", t->peer->label));
  } else {
    t->request = request;
    t->phase = Phase::kNotifying;
  }
}

absl::Status UcxCore::StartFlush(UcxTransfer* t) {
  t->phase = Phase::kFlushing;
  ucp_request_param_t param;
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = OnFlushed;
  param.user_data = t;
  ucs_status_ptr_t request = ucp_ep_flush_nbx(t->peer->ep.get(), &param);
  if (UCS_PTR_IS_ERR(request)) {
    return UcxStatusToStatus(UCS_PTR_STATUS(request), "ep_flush_nbx", t->peer->label);
  }
  if (request == nullptr) {
    SendNotification(t);  // the flush completed at once
  } else {
    t->request = request;
  }
  return absl::OkStatus();
}

void UcxCore::Maintain() {
  bool again = false;
  for (auto it = peers.begin(); it != peers.end();) {
    UcxPeer* peer = it->second.get();
    if (!peer->status.ok() && peer->ep) peer->close_request = peer->ep.StartClose(true);
    if (peer->close_request != nullptr &&
        ucp_request_check_status(peer->close_request) != UCS_INPROGRESS) {
      ucp_request_free(peer->close_request);
      peer->close_request = nullptr;
    }
    const bool idle = StagedPeerIdle(*peer);
    if (peer->disconnected && peer->close_request == nullptr && peer->outstanding.empty() &&
        idle) {
      it = peers.erase(it);
      continue;
    }
    again = again || peer->close_request != nullptr || (peer->disconnected && !idle);
    ++it;
  }
  maintenance = again;
}

void UcxCore::Shutdown() {
  absl::MutexLock lock(&mu);
  shut_down = true;
  for (auto& [id, t] : transfers) {
    FailTransfer(t.get(), absl::CancelledError("UCX transport destroyed"));
  }
  for (auto& [id, peer] : peers) {
    if (peer->ep) {
      void* request = peer->ep.StartClose(/*force=*/true);
      if (request != nullptr) {
        if (peer->close_request != nullptr) ucp_request_free(peer->close_request);
        peer->close_request = request;
      }
    }
  }
  const absl::Time deadline = absl::Now() + kShutdownTimeout;
  while (true) {
    bool pending = !zombies.empty() || !control_sends.empty();
    for (auto& [id, t] : transfers) pending = pending || t->request != nullptr;
    for (auto& [id, peer] : peers) {
      if (peer->close_request != nullptr &&
          ucp_request_check_status(peer->close_request) != UCS_INPROGRESS) {
        ucp_request_free(peer->close_request);
        peer->close_request = nullptr;
      }
      pending = pending || peer->close_request != nullptr || StagedRequestsPending(*peer);
    }
    if (!pending) break;
    if (absl::Now() >= deadline) {
      // Leak what UCX may still call back into rather than free it under UCX's feet.
      Log(LogLevel::kError, "UCX transport destroyed with requests UCX did not return");
      for (auto& [id, t] : transfers) {
        if (t->request != nullptr) (void)t.release();
      }
      for (auto& [raw, t] : zombies) (void)t.release();
      for (auto& [raw, send] : control_sends) (void)send.release();
      for (auto& [id, peer] : peers) {
        if (peer->close_request != nullptr || StagedRequestsPending(*peer)) (void)peer.release();
      }
      break;
    }
    ucp_worker_progress(worker.get());
  }
  // No GPU work may still touch a buffer the peers' staged state frees.
  DrainStaged(this, absl::Now() + kShutdownTimeout);
  transfers.clear();
  zombies.clear();
  control_sends.clear();
  orphan_headers.clear();
  peers.clear();
  inbox.clear();
  staged_inbox.clear();
  staged.reset();
}

}  // namespace internal
}  // namespace kvstream
