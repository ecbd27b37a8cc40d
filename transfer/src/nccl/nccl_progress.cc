// What the nccl transport's Progress advances (nccl_state.h has the life of a transfer and of
// a batch): new side connections and their hellos, frames from peers, every live
// communicator's state (ncclCommGetAsyncError), batch completions in order, notifications,
// deadlines, peer failures, and the freeing of retired GPU resources; and the bounded wait
// at destruction. Nothing here blocks: sockets are read and written as far as they go,
// events and streams are queried, never synchronised.
#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/logging.h"
#include "nccl/nccl_transport_impl.h"

namespace kvstream {
namespace internal {
namespace {

// Bounds on the work one Progress call does, so that it never runs long.
constexpr size_t kMaxReadPerConnection = size_t{4} << 20;
constexpr int kMaxAcceptsPerProgress = 16;

absl::Status Died() {
  return absl::UnavailableError(
      "closed its side connection without a goodbye (the process exited or was killed?)");
}

bool StreamIdle(const IpcStream& stream) {
  if (stream.get() == nullptr) return true;
  const cudaError_t e = cudaStreamQuery(stream.get());
  if (e == cudaErrorNotReady) return false;
  if (e != cudaSuccess) cudaGetLastError();  // a sticky error: nothing more will run there
  return true;
}

}  // namespace

absl::Status NcclTransport::Progress() {
  std::vector<std::pair<PeerId, absl::Status>> errors;
  PeerErrorCallback callback;
  {
    absl::MutexLock lock(&mu_);
    CudaDeviceScope scope(device_);
    AcceptConnections();
    ReadPending();
    for (auto& [id, p] : peers_) {
      NcclPeer& peer = *p;
      if (!peer.status.ok()) continue;
      if (peer.send != nullptr && !peer.send->state.terminal()) {
        ReadSendLink(peer);
        if (peer.status.ok() && PollComm(peer, /*send=*/true)) {
          PollSends(peer);
          if (peer.send->welcomed) {
            absl::Status issued = PlanWrites(*peer.send);
            if (issued.ok()) issued = IssueSends(peer);
            if (!issued.ok()) FailPeer(peer, issued);
          }
        }
      }
      if (peer.status.ok() && peer.recv != nullptr && !peer.recv->state.terminal()) {
        ReadRecvLink(peer);
        if (peer.status.ok() && peer.recv != nullptr && PollComm(peer, /*send=*/false)) {
          PollReceives(peer);
          absl::Status issued = IssueReceives(peer);
          if (!issued.ok()) FailPeer(peer, issued);
        }
      }
      if (peer.status.ok()) SendReady(peer);
      if (peer.status.ok()) CheckDeadlines(peer);
    }
    FreeIdleRetired();
    if (!peer_errors_.empty()) {
      errors.swap(peer_errors_);
      callback = callback_;
    }
  }
  // Outside the lock: the callback may take its own locks (it must not call us).
  if (callback) {
    for (const auto& [peer, error] : errors) callback(peer, error);
  }
  return absl::OkStatus();
}

void NcclTransport::AcceptConnections() {
  if (!listener_.valid()) return;
  for (int i = 0; i < kMaxAcceptsPerProgress; ++i) {
    absl::StatusOr<AcceptedSocket> accepted =
        AcceptSocket(listener_.get(), absl::InfinitePast(), listener_label_);
    if (!accepted.ok()) {
      if (!absl::IsDeadlineExceeded(accepted.status())) {
        Log(LogLevel::kWarning, absl::StrCat("nccl: ", accepted.status().message()));
      }
      return;
    }
    pending_.push_back(std::make_unique<IpcConnection>(std::move(accepted->fd),
                                                       std::move(accepted->peer), kNcclFrames));
  }
}

void NcclTransport::ReadPending() {
  for (size_t i = 0; i < pending_.size();) {
    IpcConnection& conn = *pending_[i];
    absl::StatusOr<bool> eof = conn.ReadAvailable(kIpcFrameHeaderBytes + 512);
    uint8_t type = 0;
    std::string payload;
    absl::StatusOr<bool> frame =
        eof.ok() ? conn.reader().NextFrame(&type, &payload) : eof.status();
    absl::Status problem;
    if (!frame.ok()) {
      problem = frame.status();
    } else if (!*frame) {
      if (!*eof) {
        ++i;  // no hello yet
        continue;
      }
      problem = absl::UnavailableError("closed before its hello");
    } else if (type != static_cast<uint8_t>(NcclFrameType::kHello)) {
      problem = absl::InvalidArgumentError("its first frame is not a hello");
    }
    absl::StatusOr<NcclHello> hello =
        problem.ok() ? DecodeNcclHello(payload) : absl::StatusOr<NcclHello>(problem);
    std::unique_ptr<IpcConnection> owned = std::move(pending_[i]);
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
    if (!hello.ok()) {
      Log(LogLevel::kWarning, absl::StrCat("nccl: dropped connection ", owned->label(), ": ",
                                           hello.status().message()));
      continue;
    }
    AcceptHello(std::move(owned), *hello);
  }
}

void NcclTransport::AcceptHello(std::unique_ptr<IpcConnection> conn, const NcclHello& hello) {
  const std::string who = absl::StrCat("the writer at ", conn->label(), " (uid ",
                                       absl::Hex(hello.uid), ", pid ", hello.pid, ")");
  auto refuse = [&](const absl::Status& why) {
    Log(LogLevel::kWarning, absl::StrCat("nccl: refused ", who, ": ", why.message()));
    NcclWelcome no;
    no.reason = std::string(why.message());
    conn->QueueFrame(static_cast<uint8_t>(NcclFrameType::kWelcome), EncodeNcclWelcome(no));
    (void)conn->Flush();  // best effort; the connection closes here
  };
  absl::Status refused =
      hello.uid == uid_ ? absl::InvalidArgumentError("it claims this transport's own uid")
                        : CheckPeer(hello.job_id, hello.nccl_version, hello.device_uuid, who);
  if (!refused.ok()) return refuse(refused);
  NcclPeer* peer = nullptr;
  for (auto& [id, p] : peers_) {
    if (p->uid == hello.uid && p->status.ok()) peer = p.get();
  }
  if (peer == nullptr) peer = NewPeer(hello.uid, hello.pid);
  if (peer->recv != nullptr) {
    refuse(absl::FailedPreconditionError("a receive link from it is already open"));
    FailPeer(*peer, absl::InvalidArgumentError("said hello twice on one receive link"));
    return;
  }
  auto link = std::make_unique<RecvLink>(absl::StrCat(peer->label, " receive link"),
                                         "receive link", options_.join_timeout,
                                         options_.op_timeout);
  absl::StatusOr<std::unique_ptr<LinkGpu>> gpu = NewLinkGpu();
  if (!gpu.ok()) return refuse(gpu.status());
  link->gpu = std::move(gpu).value();
  auto [comm, poll] = NcclComm::Init(hello.unique_id, /*rank=*/1, link->label);
  link->comm = std::move(comm);
  if (link->state.OnInitCalled(poll, absl::Now()) == CommAction::kAbort) {
    link->comm.Abort();
    retired_.push_back(std::move(link->gpu));
    return refuse(link->state.status());
  }
  conn->set_label(link->label);
  NcclWelcome yes;
  yes.ok = true;
  yes.max_staged_bytes = options_.staging_bytes;
  yes.max_pieces = MaxPiecesPerBatch();
  conn->QueueFrame(static_cast<uint8_t>(NcclFrameType::kWelcome), EncodeNcclWelcome(yes));
  link->conn = std::move(conn);
  peer->recv = std::move(link);
  // A failure to write shows when it is read next.
  (void)peer->recv->conn->Flush();
  ReadRecvLink(*peer);  // frames that came with the hello
}

void NcclTransport::ReadSendLink(NcclPeer& peer) {
  SendLink& link = *peer.send;
  absl::StatusOr<bool> eof = link.conn->ReadAvailable(kMaxReadPerConnection);
  if (!eof.ok()) return FailPeer(peer, eof.status());
  for (;;) {
    uint8_t type = 0;
    std::string payload;
    absl::StatusOr<bool> frame = link.conn->reader().NextFrame(&type, &payload);
    if (!frame.ok()) return FailPeer(peer, frame.status());
    if (!*frame) break;
    const auto t = static_cast<NcclFrameType>(type);
    if (t == NcclFrameType::kWelcome && !link.welcomed) {
      absl::StatusOr<NcclWelcome> w = DecodeNcclWelcome(payload);
      if (!w.ok()) return FailPeer(peer, w.status());
      if (!w->ok) {
        return FailPeer(peer, absl::FailedPreconditionError(absl::StrCat(
                                  "refused this writer: ", absl::CHexEscape(w->reason))));
      }
      link.welcomed = true;
      link.limits.staged_bytes = std::min(link.limits.staged_bytes, w->max_staged_bytes);
      link.limits.in_place_min_bytes =
          std::min(link.limits.in_place_min_bytes, link.limits.staged_bytes);
      link.limits.max_pieces = std::min(link.limits.max_pieces, w->max_pieces);
    } else if (t == NcclFrameType::kBye) {
      return FailPeer(peer, absl::UnavailableError("disconnected (it said goodbye)"));
    } else {
      return FailPeer(peer, absl::InvalidArgumentError(absl::StrCat(
                                "sent frame type ", int{type}, " on the link it receives on")));
    }
  }
  if (*eof) FailPeer(peer, Died());
}

void NcclTransport::ReadRecvLink(NcclPeer& peer) {
  RecvLink& link = *peer.recv;
  // What is left of the welcome (the receive link sends nothing else but its goodbye).
  absl::Status flushed = link.conn->Flush();
  if (!flushed.ok()) return FailPeer(peer, flushed);
  absl::StatusOr<bool> eof = link.conn->ReadAvailable(kMaxReadPerConnection);
  if (!eof.ok()) return FailPeer(peer, eof.status());
  for (;;) {
    uint8_t type = 0;
    std::string payload;
    absl::StatusOr<bool> frame = link.conn->reader().NextFrame(&type, &payload);
    if (!frame.ok()) return FailPeer(peer, frame.status());
    if (!*frame) break;
    const auto t = static_cast<NcclFrameType>(type);
    if (t == NcclFrameType::kBatch) {
      absl::StatusOr<NcclBatchHeader> header = DecodeNcclBatch(payload);
      if (!header.ok()) return FailPeer(peer, header.status());
      if (header->serial != link.next_serial) {
        return FailPeer(peer, absl::InvalidArgumentError(absl::StrCat(
                                  "sent batch ", header->serial, " where batch ",
                                  link.next_serial, " was due")));
      }
      auto region = regions_.find(header->region_id);
      if (region == regions_.end()) {
        return FailPeer(peer, absl::FailedPreconditionError(absl::StrCat(
                                  "wrote into region ", header->region_id,
                                  ", which is not registered here (destroyed?)")));
      }
      absl::StatusOr<NcclRecvBatch> plan =
          PlanNcclReceive(*header, region->second.length, options_.staging_bytes);
      if (!plan.ok()) return FailPeer(peer, plan.status());
      RecvBatch batch;
      batch.header = std::move(header).value();
      batch.plan = std::move(plan).value();
      batch.region_base = region->second.base;
      link.batches.push_back(std::move(batch));
      ++link.next_serial;
    } else if (t == NcclFrameType::kNotification) {
      Notification n;
      n.peer = peer.id;
      n.payload = std::move(payload);
      if (link.landed == link.next_serial && link.held.empty()) {
        inbox_.push_back(std::move(n));
      } else {
        link.held.push_back({link.next_serial, std::move(n)});
      }
    } else if (t == NcclFrameType::kBye) {
      // The writer closed on purpose: what landed was delivered; its link ends here.
      PollReceives(peer);
      EndLink(link, /*fail=*/false, absl::OkStatus());
      peer.recv.reset();
      return;
    } else {
      return FailPeer(peer, absl::InvalidArgumentError(absl::StrCat(
                                "sent frame type ", int{type}, " on its receive link")));
    }
  }
  if (*eof) FailPeer(peer, Died());
}

namespace {

// Finishes the link's batch whose group was being issued in the background.
template <typename Link, typename Finish>
absl::Status FinishIssuing(Link& link, Finish finish) {
  for (auto& batch : link.batches) {
    if (batch.phase == BatchPhase::kIssuing) return finish(link, batch);
  }
  return absl::OkStatus();
}

}  // namespace

bool NcclTransport::PollComm(NcclPeer& peer, bool send) {
  NcclLink& link = send ? static_cast<NcclLink&>(*peer.send) : *peer.recv;
  if (!link.state.has_comm()) return true;
  absl::Status status;
  switch (link.state.OnAsyncState(link.comm.AsyncState(), absl::Now())) {
    case CommAction::kIssued:
      status = send ? FinishIssuing(*peer.send, [this](SendLink& l, SendBatch& b) {
                        mu_.AssertHeld();
                        return FinishSend(l, b);
                      })
                    : FinishIssuing(*peer.recv, [this](RecvLink& l, RecvBatch& b) {
                        mu_.AssertHeld();
                        return FinishReceive(l, b);
                      });
      break;
    case CommAction::kAbort:
      status = link.state.status();
      break;
    default:
      break;
  }
  if (status.ok()) return true;
  FailPeer(peer, status);
  return false;
}

void NcclTransport::PollSends(NcclPeer& peer) {
  SendLink& link = *peer.send;
  while (!link.batches.empty() && link.batches.front().phase == BatchPhase::kIssued) {
    SendBatch& b = link.batches.front();
    absl::StatusOr<bool> done = b.done.Query();
    if (!done.ok()) {
      return FailPeer(peer, absl::Status(done.status().code(),
                                         absl::StrCat("a batch's GPU work failed: ",
                                                      done.status().message())));
    }
    if (!*done) return;
    if (b.table_entries > 0) link.gpu->tables->ReleaseOldest();
    auto t = transfers_.find(b.transfer);
    if (t != transfers_.end() && t->second.batches_left > 0) --t->second.batches_left;
    ReturnEvent(std::move(b.done));
    link.batches.pop_front();
  }
}

void NcclTransport::PollReceives(NcclPeer& peer) {
  RecvLink& link = *peer.recv;
  while (!link.batches.empty() && link.batches.front().phase == BatchPhase::kIssued) {
    RecvBatch& b = link.batches.front();
    absl::StatusOr<bool> landed = b.landed.Query();
    if (!landed.ok()) {
      return FailPeer(peer, absl::Status(landed.status().code(),
                                         absl::StrCat("a batch's GPU work failed: ",
                                                      landed.status().message())));
    }
    if (!*landed) break;
    if (b.table_entries > 0) link.gpu->tables->ReleaseOldest();
    ReturnEvent(std::move(b.landed));
    link.batches.pop_front();
    ++link.landed;
  }
  // Notifications follow the data of every batch announced before them.
  while (!link.held.empty() && link.held.front().after <= link.landed) {
    inbox_.push_back(std::move(link.held.front().note));
    link.held.pop_front();
  }
}

void NcclTransport::CheckDeadlines(NcclPeer& peer) {
  const absl::Time now = absl::Now();
  if (peer.send != nullptr) {
    absl::Time oldest = absl::InfiniteFuture();
    for (const SendBatch& b : peer.send->batches) {
      if (b.phase != BatchPhase::kQueued) oldest = std::min(oldest, b.issued_at);
    }
    if (peer.send->state.CheckDeadlines(oldest, now) == CommAction::kAbort) {
      return FailPeer(peer, peer.send->state.status());
    }
  }
  if (peer.recv != nullptr) {
    absl::Time oldest = absl::InfiniteFuture();
    for (const RecvBatch& b : peer.recv->batches) {
      if (b.phase != BatchPhase::kQueued) oldest = std::min(oldest, b.issued_at);
    }
    if (peer.recv->state.CheckDeadlines(oldest, now) == CommAction::kAbort) {
      return FailPeer(peer, peer.recv->state.status());
    }
  }
}

void NcclTransport::SendReady(NcclPeer& peer) {
  if (peer.send == nullptr || peer.send->conn == nullptr) return;
  IpcConnection& conn = *peer.send->conn;
  while (!peer.queue.empty()) {
    const TransferId id = peer.queue.front();
    auto it = transfers_.find(id);
    if (it == transfers_.end() || it->second.phase != NcclPhase::kQueued) {
      peer.queue.pop_front();  // released, cancelled or failed
      continue;
    }
    NcclTransfer& t = it->second;
    // Its data, and that of every earlier write, is not all sent yet.
    if (!t.planned || t.batches_left > 0) break;
    if (t.ready != nullptr) {
      // A write with no bytes still orders its tail after the caller's GPU work.
      absl::StatusOr<bool> ready = t.ready->Query();
      if (!ready.ok()) return FailPeer(peer, ready.status());
      if (!*ready) break;
    }
    peer.queue.pop_front();
    t.ready.reset();
    if (t.notification.empty()) {
      t.phase = NcclPhase::kDone;
      continue;
    }
    std::string payload = std::move(t.notification);
    if (t.tail_bytes > 0) payload.append(static_cast<const char*>(t.tail), t.tail_bytes);
    t.send_mark = conn.QueueFrame(static_cast<uint8_t>(NcclFrameType::kNotification), payload);
    t.phase = NcclPhase::kSending;
    peer.sending.push_back(id);
  }
  absl::Status flushed = conn.Flush();
  if (!flushed.ok()) return FailPeer(peer, flushed);
  while (!peer.sending.empty()) {
    auto it = transfers_.find(peer.sending.front());
    if (it != transfers_.end() && it->second.phase == NcclPhase::kSending) {
      if (it->second.send_mark > conn.bytes_sent()) break;
      it->second.phase = NcclPhase::kDone;
    }
    peer.sending.pop_front();
  }
}

void NcclTransport::FailTransfer(TransferId id, const absl::Status& status) {
  auto it = transfers_.find(id);
  if (it == transfers_.end() || !it->second.active()) return;
  it->second.phase = NcclPhase::kFailed;
  it->second.status = status;
}

void NcclTransport::EndLink(NcclLink& link, bool fail, const absl::Status& cause) {
  if (fail) {
    (void)link.state.Fail(cause);
  } else {
    (void)link.state.Close();
  }
  // Never waits for the peer; stops this side's NCCL kernels still spinning for it.
  link.comm.Abort();
  link.conn.reset();
  // Its memory outlives the GPU work that may still use it.
  if (link.gpu != nullptr) retired_.push_back(std::move(link.gpu));
}

void NcclTransport::FailPeer(NcclPeer& peer, const absl::Status& cause, bool notify) {
  if (!peer.status.ok()) return;
  peer.status = absl::Status(cause.code(), absl::StrCat(peer.label, " failed: ", cause.message()));
  for (TransferId id : peer.queue) FailTransfer(id, peer.status);
  for (TransferId id : peer.sending) FailTransfer(id, peer.status);
  peer.queue.clear();
  peer.sending.clear();
  if (peer.send != nullptr) {
    EndLink(*peer.send, /*fail=*/true, cause);
    peer.send->batches.clear();
    peer.send->unplanned.clear();
  }
  if (peer.recv != nullptr) {
    EndLink(*peer.recv, /*fail=*/true, cause);
    peer.recv->batches.clear();
    peer.recv->held.clear();
  }
  if (notify) peer_errors_.emplace_back(peer.id, peer.status);
}

void NcclTransport::FreeIdleRetired() {
  for (size_t i = 0; i < retired_.size();) {
    if (StreamIdle(retired_[i]->nccl) && StreamIdle(retired_[i]->copy)) {
      retired_.erase(retired_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
}

void NcclTransport::Shutdown() {
  absl::MutexLock lock(&mu_);
  CudaDeviceScope scope(device_);
  for (auto& [id, t] : transfers_) {
    if (t.active()) {
      t.phase = NcclPhase::kFailed;
      t.status = absl::CancelledError("nccl transport destroyed");
    }
  }
  for (auto& [id, peer] : peers_) {
    for (NcclLink* link : {static_cast<NcclLink*>(peer->send.get()),
                           static_cast<NcclLink*>(peer->recv.get())}) {
      if (link == nullptr) continue;
      if (link->conn != nullptr && peer->status.ok() && !link->state.terminal()) {
        link->conn->QueueFrame(static_cast<uint8_t>(NcclFrameType::kBye), "");
        (void)link->conn->Flush();
      }
      EndLink(*link, /*fail=*/false, absl::OkStatus());
    }
  }
  peers_.clear();
  pending_.clear();
  listener_.Reset();
  // Staging memory and tables must outlive the GPU work that uses them.
  const absl::Time deadline = absl::Now() + options_.shutdown_timeout;
  for (;;) {
    FreeIdleRetired();
    if (retired_.empty()) break;
    if (absl::Now() >= deadline) {
      Log(LogLevel::kError,
          absl::StrCat("nccl transport destroyed with GPU work of ", retired_.size(),
                       " links still running after ",
                       absl::FormatDuration(options_.shutdown_timeout),
                       ": their staging memory is left allocated"));
      for (auto& gpu : retired_) (void)gpu.release();
      retired_.clear();
      break;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  transfers_.clear();
}

}  // namespace internal
}  // namespace kvstream
