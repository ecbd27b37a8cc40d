// What the cuda_ipc transport's Progress advances (cuda_ipc_state.h has the life of a
// transfer): new connections and their hellos, frames from peers, ends of stream, copy
// completions in stream order, notifications in post order per peer; peer failures; and
// the bounded wait for copies at destruction. Nothing here blocks: sockets are read and
// written only as far as they go without waiting, events are queried, never synchronised.
#include <cuda_runtime.h>
#include <unistd.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cuda_ipc/cuda_ipc_transport_impl.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/logging.h"

namespace kvstream {
namespace internal {
namespace {

// Bounds on the work one Progress call does, so it never runs long.
constexpr size_t kMaxReadPerConnection = size_t{1} << 20;
constexpr int kMaxAcceptsPerProgress = 16;
// What is read from an outgoing connection to see its end (the peer sends nothing on it).
constexpr size_t kOutboundProbeBytes = 256;

}  // namespace

absl::Status CudaIpcTransport::Progress() {
  PeerErrorReports::Pending errors;
  {
    absl::MutexLock lock(&mu_);
    CudaDeviceScope scope(device_);
    AcceptConnections();
    ReadPending();
    for (auto& [id, peer] : peers_) {
      if (peer->in != nullptr) ReadInbound(peer.get());
      if (peer->out != nullptr) WatchOutbound(peer.get());
    }
    PollCopies();
    for (auto& [id, peer] : peers_) {
      if (peer->out != nullptr && peer->status.ok()) SendReady(peer.get());
    }
    errors = peer_errors_.Take();
  }
  // Outside the lock: the callback may take its own locks (it must not call us).
  errors.Deliver();
  return absl::OkStatus();
}

void CudaIpcTransport::AcceptConnections() {
  if (!listener_.valid()) return;
  for (int i = 0; i < kMaxAcceptsPerProgress; ++i) {
    absl::StatusOr<AcceptedSocket> accepted =
        AcceptSocket(listener_.get(), absl::InfinitePast(), socket_label_);
    if (!accepted.ok()) {
      if (!absl::IsDeadlineExceeded(accepted.status())) {
        Log(LogLevel::kWarning, absl::StrCat("cuda_ipc: ", accepted.status().message()));
      }
      return;
    }
    // Anyone on the host can reach an abstract socket: only this user's processes may
    // deliver notifications (and they could map our memory anyway).
    if (accepted->uid >= 0 && accepted->uid != static_cast<int>(getuid())) {
      Log(LogLevel::kWarning, absl::StrCat("cuda_ipc: refused a connection on ", socket_label_,
                                           " from uid ", accepted->uid, " (pid ", accepted->pid,
                                           ")"));
      continue;
    }
    pending_.push_back(
        std::make_unique<IpcConnection>(std::move(accepted->fd), std::move(accepted->peer)));
  }
}

IpcPeer* CudaIpcTransport::PeerForUid(uint64_t uid, uint32_t pid) {
  for (auto& [id, peer] : peers_) {
    if (peer->uid == uid && peer->status.ok()) return peer.get();
  }
  return NewPeer(uid, pid);
}

void CudaIpcTransport::ReadPending() {
  for (size_t i = 0; i < pending_.size();) {
    IpcConnection& conn = *pending_[i];
    absl::StatusOr<bool> eof = conn.ReadAvailable(kIpcFrameHeaderBytes + 64);
    IpcFrameType type = IpcFrameType::kHello;
    std::string payload;
    absl::StatusOr<bool> frame = eof.ok() ? conn.reader().Next(&type, &payload) : eof.status();
    absl::Status problem;
    if (!frame.ok()) {
      problem = frame.status();
    } else if (!*frame) {
      if (!*eof) {
        ++i;  // no hello yet
        continue;
      }
      problem = absl::UnavailableError("closed before its hello");
    } else if (type != IpcFrameType::kHello) {
      problem = absl::InvalidArgumentError("its first frame is not a hello");
    }
    absl::StatusOr<IpcHello> hello =
        problem.ok() ? DecodeIpcHello(payload) : absl::StatusOr<IpcHello>(problem);
    const bool refused = hello.ok() && refused_uids_.count(hello->uid) != 0;
    if (!hello.ok() || hello->uid == uid_ || refused) {
      const std::string why =
          !hello.ok() ? std::string(hello.status().message())
          : refused   ? std::string("this side disconnected from its transport")
                      : std::string("it claims this transport's own uid");
      Log(LogLevel::kWarning,
          absl::StrCat("cuda_ipc: dropped connection ", conn.label(), ": ", why));
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    IpcPeer* peer = PeerForUid(hello->uid, hello->pid);
    // A newer connection from the same transport replaces an older one (a reconnect).
    peer->in = std::move(pending_[i]);
    peer->in->set_label(peer->label);
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
    ReadInbound(peer);  // frames that came with the hello
  }
}

void CudaIpcTransport::ReadInbound(IpcPeer* peer) {
  absl::StatusOr<bool> eof = peer->in->ReadAvailable(kMaxReadPerConnection);
  if (!eof.ok()) {
    FailPeer(peer, eof.status());
    return;
  }
  for (;;) {
    IpcFrameType type = IpcFrameType::kHello;
    std::string payload;
    absl::StatusOr<bool> frame = peer->in->reader().Next(&type, &payload);
    if (!frame.ok()) {
      FailPeer(peer, absl::InvalidArgumentError(
                         absl::StrCat("malformed frame: ", frame.status().message())));
      return;
    }
    if (!*frame) break;
    if (type == IpcFrameType::kNotification) {
      Notification n;
      n.peer = peer->id;
      n.payload = std::move(payload);
      transfers_.inbox().Deliver(std::move(n));
    } else if (type == IpcFrameType::kBye) {
      // The peer closed on purpose: its connection ends here, the peer is not failed.
      peer->in.reset();
      return;
    } else {
      FailPeer(peer, absl::InvalidArgumentError("a second hello on its connection"));
      return;
    }
  }
  if (*eof) {
    FailPeer(peer, absl::UnavailableError(
                       "closed its connection without a goodbye (the process exited or was "
                       "killed?)"));
  }
}

void CudaIpcTransport::WatchOutbound(IpcPeer* peer) {
  absl::StatusOr<bool> eof = peer->out->ReadAvailable(kOutboundProbeBytes);
  if (!eof.ok()) {
    FailPeer(peer, eof.status());
  } else if (peer->out->reader().buffered() > 0) {
    FailPeer(peer, absl::InvalidArgumentError("sent bytes on a connection it only receives on"));
  } else if (*eof) {
    FailPeer(peer, absl::UnavailableError(
                       "closed the connection (the process exited, was killed, or "
                       "disconnected)"));
  }
}

void CudaIpcTransport::PollCopies() {
  while (!inflight_.empty()) {
    InFlightCopy& copy = inflight_.front();
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(copy.done.get()));
    if (e == cudaErrorNotReady) return;
    IpcTransfers::Transfer* t = copy.transfer == 0 ? nullptr : transfers_.Find(copy.transfer);
    if (e == cudaSuccess) {
      if (t != nullptr) t->work.copy_done = true;
      const bool timed = !copy.start.empty();
      if (timed && !copy.kernel_start.empty()) {
        absl::StatusOr<float> stream_ms = CudaEvent::ElapsedMilliseconds(copy.start, copy.done);
        absl::StatusOr<float> kernel_ms =
            CudaEvent::ElapsedMilliseconds(copy.kernel_start, copy.done);
        if (stream_ms.ok() && kernel_ms.ok()) {
          timings_.push_back(CudaIpcCopyTiming{*stream_ms * 1e3, *kernel_ms * 1e3});
        }
      }
      ReturnEvent(std::move(copy.start), true);
      ReturnEvent(std::move(copy.kernel_start), true);
      ReturnEvent(std::move(copy.done), timed);
    } else {
      // An error of the copy or of earlier work on the device (sticky errors end the
      // context): the transfer fails with it; the event is not reused.
      cudaGetLastError();
      if (t != nullptr) {
        transfers_.Fail(copy.transfer,
                        CudaErrorToStatus(static_cast<int>(e),
                                          absl::StrCat("cuda_ipc transfer ", copy.transfer,
                                                       ": the copy failed")));
      }
    }
    if (copy.ring != nullptr) copy.ring->ReleaseOldest();
    inflight_.pop_front();  // drops its hold on the destination's mapping
  }
}

void CudaIpcTransport::SendReady(IpcPeer* peer) {
  // Its data, and (stream order) that of every earlier write, is in place once its copy
  // completed; the GPU wrote the tail before ready_event, which the copy waited for.
  (void)transfers_.StartReady(
      peer->id, [](const IpcTransfers::Transfer& t) { return t.work.copy_done; },
      [peer](std::string frame) { return peer->out->Queue(IpcFrameType::kNotification, frame); });
  absl::Status flushed = peer->out->Flush();
  if (!flushed.ok()) {
    FailPeer(peer, flushed);
    return;
  }
  transfers_.FinishSent(peer->id, peer->out->bytes_sent());
}

void CudaIpcTransport::FailPeer(IpcPeer* peer, const absl::Status& cause) {
  if (!peer->status.ok()) return;
  peer->status = absl::Status(cause.code(),
                              absl::StrCat(peer->label, " failed: ", cause.message()));
  transfers_.FailPeer(peer->id, peer->status);
  peer->out.reset();
  peer->in.reset();
  // Closed once the copies in flight into them are done (they hold references).
  peer->mappings.clear();
  peer_errors_.Add(peer->id, peer->status);
}

void CudaIpcTransport::Shutdown() {
  absl::MutexLock lock(&mu_);
  CudaDeviceScope scope(device_);
  transfers_.FailAll(absl::CancelledError("cuda_ipc transport destroyed"));
  for (auto& [id, peer] : peers_) {
    if (peer->out != nullptr && peer->status.ok()) {
      peer->out->Queue(IpcFrameType::kBye, "");
      (void)peer->out->Flush();
    }
  }
  peers_.clear();
  pending_.clear();
  listener_.Reset();
  // Mappings, staging rings and events must outlive the copies that use them.
  const absl::Time deadline = absl::Now() + options_.shutdown_timeout;
  while (!inflight_.empty()) {
    PollCopies();
    if (inflight_.empty()) break;
    if (absl::Now() >= deadline) {
      Log(LogLevel::kError,
          absl::StrCat("cuda_ipc transport destroyed with ", inflight_.size(),
                       " copies still running after ",
                       absl::FormatDuration(options_.shutdown_timeout),
                       ": their mappings and staging memory are left open"));
      for (InFlightCopy& copy : inflight_) {
        if (copy.mapping != nullptr) new std::shared_ptr<IpcMapping>(std::move(copy.mapping));
      }
      (void)ring_.release();
      for (auto& ring : retired_rings_) (void)ring.release();
      break;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  inflight_.clear();
  transfers_.Clear();
}

}  // namespace internal
}  // namespace kvstream
