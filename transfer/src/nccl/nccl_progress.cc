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
#include "kvstream/common/status_macros.h"
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
  PeerErrorReports::Pending errors;
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
    errors = peer_errors_.Take();
  }
  // Outside the lock: the callback may take its own locks (it must not call us).
  errors.Deliver();
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
      : refused_uids_.count(hello.uid) != 0
          ? absl::FailedPreconditionError("this side disconnected from its transport")
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

template <typename OnFrame>
void NcclTransport::ReadFrames(NcclPeer& peer, NcclLink& link, OnFrame on_frame) {
  absl::StatusOr<bool> eof = link.conn->ReadAvailable(kMaxReadPerConnection);
  if (!eof.ok()) return FailPeer(peer, eof.status());
  for (;;) {
    uint8_t type = 0;
    std::string payload;
    absl::StatusOr<bool> frame = link.conn->reader().NextFrame(&type, &payload);
    if (!frame.ok()) return FailPeer(peer, frame.status());
    if (!*frame) break;
    absl::StatusOr<bool> more = on_frame(static_cast<NcclFrameType>(type), payload);
    if (!more.ok()) return FailPeer(peer, more.status());
    if (!*more) return;  // the link ended
  }
  if (*eof) FailPeer(peer, Died());
}

void NcclTransport::ReadSendLink(NcclPeer& peer) {
  SendLink& link = *peer.send;
  ReadFrames(peer, link, [&link](NcclFrameType t, std::string& payload) -> absl::StatusOr<bool> {
    if (t == NcclFrameType::kWelcome && !link.welcomed) {
      ASSIGN_OR_RETURN(const NcclWelcome w, DecodeNcclWelcome(payload));
      if (!w.ok) {
        return absl::FailedPreconditionError(
            absl::StrCat("refused this writer: ", absl::CHexEscape(w.reason)));
      }
      link.welcomed = true;
      link.limits.staged_bytes = std::min(link.limits.staged_bytes, w.max_staged_bytes);
      link.limits.in_place_min_bytes =
          std::min(link.limits.in_place_min_bytes, link.limits.staged_bytes);
      link.limits.max_pieces = std::min(link.limits.max_pieces, w.max_pieces);
      return true;
    }
    if (t == NcclFrameType::kBye) {
      return absl::UnavailableError("disconnected (it said goodbye)");
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "sent frame type ", static_cast<int>(t), " on the link it receives on"));
  });
}

void NcclTransport::ReadRecvLink(NcclPeer& peer) {
  RecvLink& link = *peer.recv;
  // What is left of the welcome (the receive link sends nothing else but its goodbye).
  absl::Status flushed = link.conn->Flush();
  if (!flushed.ok()) return FailPeer(peer, flushed);
  ReadFrames(peer, link, [&](NcclFrameType t, std::string& payload) -> absl::StatusOr<bool> {
    mu_.AssertHeld();
    if (t == NcclFrameType::kBatch) {
      ASSIGN_OR_RETURN(NcclBatchHeader header, DecodeNcclBatch(payload));
      if (header.serial != link.next_serial) {
        return absl::InvalidArgumentError(absl::StrCat("sent batch ", header.serial,
                                                       " where batch ", link.next_serial,
                                                       " was due"));
      }
      auto region = regions_.find(header.region_id);
      if (region == regions_.end()) {
        return absl::FailedPreconditionError(
            absl::StrCat("wrote into region ", header.region_id,
                         ", which is not registered here (destroyed?)"));
      }
      RecvBatch batch;
      ASSIGN_OR_RETURN(batch.plan,
                       PlanNcclReceive(header, region->second.length, options_.staging_bytes));
      batch.header = std::move(header);
      batch.region_base = region->second.base;
      link.batches.push_back(std::move(batch));
      ++link.next_serial;
      return true;
    }
    if (t == NcclFrameType::kNotification) {
      Notification n;
      n.peer = peer.id;
      n.payload = std::move(payload);
      if (link.landed == link.next_serial && link.held.empty()) {
        transfers_.inbox().Deliver(std::move(n));
      } else {
        link.held.push_back({link.next_serial, std::move(n)});
      }
      return true;
    }
    if (t == NcclFrameType::kBye) {
      // The writer closed on purpose: what landed was delivered; its link ends here.
      PollReceives(peer);
      EndLink(link, /*fail=*/false, absl::OkStatus());
      peer.recv.reset();
      return false;
    }
    return absl::InvalidArgumentError(
        absl::StrCat("sent frame type ", static_cast<int>(t), " on its receive link"));
  });
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

namespace {

// Retires the link's batches whose GPU work (`event`) completed, oldest first: each gives
// its run of the table ring back and is handed to `retired` (which takes its event back)
// before it is dropped. The GPU's error, said as such, when a query fails.
template <typename Link, typename Batch, typename Retired>
absl::Status RetireCompleted(Link& link, CudaEvent Batch::*event, Retired retired) {
  while (!link.batches.empty() && link.batches.front().phase == BatchPhase::kIssued) {
    Batch& b = link.batches.front();
    absl::StatusOr<bool> done = (b.*event).Query();
    if (!done.ok()) {
      return absl::Status(done.status().code(),
                          absl::StrCat("a batch's GPU work failed: ", done.status().message()));
    }
    if (!*done) break;
    if (b.table_entries > 0) link.gpu->tables->ReleaseOldest();
    retired(b);
    link.batches.pop_front();
  }
  return absl::OkStatus();
}

// When the oldest of `batches` handed to NCCL was issued (InfiniteFuture: none is).
template <typename Batch>
absl::Time OldestIssued(const std::deque<Batch>& batches) {
  absl::Time oldest = absl::InfiniteFuture();
  for (const Batch& b : batches) {
    if (b.phase != BatchPhase::kQueued) oldest = std::min(oldest, b.issued_at);
  }
  return oldest;
}

}  // namespace

void NcclTransport::PollSends(NcclPeer& peer) {
  absl::Status status = RetireCompleted(*peer.send, &SendBatch::done, [this](SendBatch& b) {
    mu_.AssertHeld();
    NcclTransfers::Transfer* t = transfers_.Find(b.transfer);
    if (t != nullptr && t->work.batches_left > 0) --t->work.batches_left;
    ReturnEvent(std::move(b.done));
  });
  if (!status.ok()) FailPeer(peer, status);
}

void NcclTransport::PollReceives(NcclPeer& peer) {
  RecvLink& link = *peer.recv;
  absl::Status status = RetireCompleted(link, &RecvBatch::landed, [this, &link](RecvBatch& b) {
    mu_.AssertHeld();
    ReturnEvent(std::move(b.landed));
    ++link.landed;
  });
  if (!status.ok()) return FailPeer(peer, status);
  // Notifications follow the data of every batch announced before them.
  while (!link.held.empty() && link.held.front().after <= link.landed) {
    transfers_.inbox().Deliver(std::move(link.held.front().note));
    link.held.pop_front();
  }
}

void NcclTransport::CheckDeadlines(NcclPeer& peer) {
  const absl::Time now = absl::Now();
  if (peer.send != nullptr &&
      peer.send->state.CheckDeadlines(OldestIssued(peer.send->batches), now) ==
          CommAction::kAbort) {
    return FailPeer(peer, peer.send->state.status());
  }
  if (peer.recv != nullptr &&
      peer.recv->state.CheckDeadlines(OldestIssued(peer.recv->batches), now) ==
          CommAction::kAbort) {
    return FailPeer(peer, peer.recv->state.status());
  }
}

void NcclTransport::SendReady(NcclPeer& peer) {
  if (peer.send == nullptr || peer.send->conn == nullptr) return;
  IpcConnection& conn = *peer.send->conn;
  auto ready = [](NcclTransfers::Transfer& t) -> absl::StatusOr<bool> {
    // Its data, and that of every earlier write, is not all sent yet.
    if (!t.work.planned || t.work.batches_left > 0) return false;
    if (t.work.ready != nullptr) {
      // A write with no bytes still orders its tail after the caller's GPU work.
      ASSIGN_OR_RETURN(const bool done, t.work.ready->Query());
      if (!done) return false;
      t.work.ready.reset();
    }
    return true;
  };
  absl::Status started = transfers_.StartReady(peer.id, ready, [&conn](std::string frame) {
    return conn.QueueFrame(static_cast<uint8_t>(NcclFrameType::kNotification), frame);
  });
  if (!started.ok()) return FailPeer(peer, started);
  absl::Status flushed = conn.Flush();
  if (!flushed.ok()) return FailPeer(peer, flushed);
  transfers_.FinishSent(peer.id, conn.bytes_sent());
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
  transfers_.FailPeer(peer.id, peer.status);
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
  if (notify) peer_errors_.Add(peer.id, peer.status);
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
  transfers_.FailAll(absl::CancelledError("nccl transport destroyed"));
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
  transfers_.Clear();
}

}  // namespace internal
}  // namespace kvstream
