// The TCP control channel: wire.h frames over the sockets of socket.h (non-blocking, every
// wait against an absl::Time deadline; socket.h is where errno values become Status).
//
// Closing is split in two on purpose: Close() only marks the connection closed and calls
// shutdown(), which wakes any thread blocked in poll() on it; the descriptor itself is
// released by the destructor. Closing the descriptor while another thread may still be
// polling it would let the number be reused by an unrelated open() in between.
#include "kvstream/transfer/control_channel.h"

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/transfer/socket.h"
#include "kvstream/transfer/wire.h"

namespace kvstream {
namespace {

// The payload buffer grows as bytes actually arrive rather than to the announced length at
// once, so a header that announces the maximum and then stalls costs little memory.
constexpr size_t kReadChunkBytes = 1u << 20;

// "ip:port" as messages name an address (socket.h accepts "localhost" for 127.0.0.1).
std::string Address(const std::string& host, uint16_t port) {
  return absl::StrCat(host == "localhost" ? "127.0.0.1" : host, ":", port);
}

// Send and Receive each hold their own mutex for a whole frame, so frames never interleave
// and one thread can send while another receives. closed_ is atomic because closed() and
// Close() may be called from any thread without either mutex.
class TcpControlConnection final : public ControlConnection {
 public:
  TcpControlConnection(ScopedFd fd, std::string peer)
      : fd_(std::move(fd)), peer_(std::move(peer)) {}

  absl::Status Send(const ControlMessage& message, absl::Time deadline) override {
    absl::MutexLock lock(&send_mu_);
    if (closed()) return ClosedError();
    absl::StatusOr<std::string> frame = EncodeFrame(message);
    if (!frame.ok()) {
      // Nothing was written, so the stream is intact and the connection stays open.
      return absl::Status(frame.status().code(),
                          absl::StrCat("cannot send ", MessageTypeName(TypeOf(message)), " to ",
                                       peer_, ": ", frame.status().message()));
    }
    size_t sent = 0;
    absl::Status status = SendAll(fd_.get(), *frame, deadline, peer_, &sent);
    if (status.ok()) return status;
    if (closed()) return ClosedError();  // closed locally while we were writing
    // A partial frame cannot be recovered: the connection is closed either way.
    return Fail(absl::Status(status.code(), absl::StrCat("send ", MessageTypeName(TypeOf(message)),
                                                         ": ", status.message())));
  }

  absl::StatusOr<ControlMessage> Receive(absl::Time deadline) override {
    absl::MutexLock lock(&recv_mu_);
    if (closed()) return ClosedError();

    char header_bytes[kFrameHeaderBytes];
    size_t got = 0;
    absl::Status status = ReadFully(header_bytes, kFrameHeaderBytes, deadline, &got);
    if (!status.ok()) {
      // Nothing of a frame consumed: the stream is still aligned on a frame boundary.
      if (absl::IsDeadlineExceeded(status) && got == 0) return status;
      return Fail(status);
    }
    absl::StatusOr<FrameHeader> header =
        DecodeFrameHeader(absl::string_view(header_bytes, kFrameHeaderBytes));
    if (!header.ok()) return FailMalformed(header.status());

    std::string payload;
    size_t payload_got = 0;
    while (payload_got < header->payload_len) {
      const size_t chunk = std::min<size_t>(header->payload_len - payload_got, kReadChunkBytes);
      payload.resize(payload_got + chunk);
      size_t chunk_got = 0;
      status = ReadFully(&payload[payload_got], chunk, deadline, &chunk_got);
      payload_got += chunk_got;
      if (!status.ok()) return Fail(status);
    }
    absl::StatusOr<ControlMessage> message = DecodePayload(header->type, payload);
    if (!message.ok()) return FailMalformed(message.status());
    return message;
  }

  bool closed() const override { return closed_.load(std::memory_order_acquire); }

  void Close() override {
    if (!closed_.exchange(true, std::memory_order_acq_rel)) {
      // ENOTCONN when the peer already reset the connection: nothing left to do.
      ::shutdown(fd_.get(), SHUT_RDWR);
    }
  }

  std::string peer_address() const override { return peer_; }

 private:
  absl::Status ClosedError() const {
    return absl::FailedPreconditionError(absl::StrCat("connection to ", peer_, " is closed"));
  }

  // Closes the connection and passes `status` through.
  absl::Status Fail(absl::Status status) {
    Close();
    return status;
  }

  absl::Status FailMalformed(const absl::Status& decode_error) {
    Log(LogLevel::kWarning, absl::StrCat("closing control connection to ", peer_,
                                         ": malformed frame: ", decode_error.message()));
    return Fail(absl::Status(decode_error.code(), absl::StrCat("malformed frame from ", peer_, ": ",
                                                               decode_error.message())));
  }

  // Reads exactly `n` bytes into `buf`; `*got` counts the bytes read even on failure.
  absl::Status ReadFully(char* buf, size_t n, absl::Time deadline, size_t* got) {
    absl::Status status = RecvAll(fd_.get(), buf, n, deadline, absl::StrCat("peer ", peer_), got);
    if (status.ok()) return status;
    if (closed()) return ClosedError();  // our own shutdown() woke us
    return status;
  }

  const ScopedFd fd_;
  const std::string peer_;
  std::atomic<bool> closed_{false};
  absl::Mutex send_mu_;  // held for the whole of one Send
  absl::Mutex recv_mu_;  // held for the whole of one Receive
};

class TcpControlListener final : public ControlListener {
 public:
  TcpControlListener(ScopedFd fd, uint16_t port, std::string address)
      : fd_(std::move(fd)), port_(port), address_(std::move(address)) {}

  uint16_t port() const override { return port_; }

  absl::StatusOr<std::unique_ptr<ControlConnection>> Accept(absl::Time deadline) override {
    ASSIGN_OR_RETURN(AcceptedSocket conn, AcceptSocket(fd_.get(), deadline, address_));
    return std::unique_ptr<ControlConnection>(
        new TcpControlConnection(std::move(conn.fd), std::move(conn.peer)));
  }

 private:
  const ScopedFd fd_;
  const uint16_t port_;
  const std::string address_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ControlListener>> ControlListener::Listen(const std::string& host,
                                                                         uint16_t port) {
  ASSIGN_OR_RETURN(ScopedFd fd, ListenTcp(host, port));
  ASSIGN_OR_RETURN(uint16_t bound_port, BoundTcpPort(fd.get()));
  return std::unique_ptr<ControlListener>(
      new TcpControlListener(std::move(fd), bound_port, Address(host, bound_port)));
}

absl::StatusOr<std::unique_ptr<ControlConnection>> ConnectControl(const std::string& host,
                                                                  uint16_t port,
                                                                  absl::Time deadline) {
  ASSIGN_OR_RETURN(ScopedFd fd, ConnectTcp(host, port, deadline));
  return std::unique_ptr<ControlConnection>(
      new TcpControlConnection(std::move(fd), Address(host, port)));
}

}  // namespace kvstream
