// The TCP control channel: wire.h frames over the sockets of socket.h (non-blocking, every
// wait against an absl::Time deadline; socket.h is where errno values become Status).
//
// Closing is split in two on purpose: Close() only marks the connection closed and calls
// shutdown(), which wakes any thread blocked in poll() on it; the descriptor itself is
// released by the destructor. Closing the descriptor while another thread may still be
// polling it would let the number be reused by an unrelated open() in between.
//
// Receiving a frame: the payload buffer starts at kFirstBufferBytes and doubles only once
// it is full, so it never holds more than twice the bytes that actually arrived; the
// buffer of a large frame, and the decoded copy of its fields, are charged to the
// ReceiveBudget before they are allocated, and released when Receive returns.
#include "kvstream/transfer/control_channel.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstring>
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

// The first allocation for a payload; later ones double it (up to the announced length).
constexpr size_t kFirstBufferBytes = size_t{64} << 10;

// "ip:port" as messages name an address (socket.h accepts "localhost" for 127.0.0.1).
std::string Address(const std::string& host, uint16_t port) {
  return absl::StrCat(host == "localhost" ? "127.0.0.1" : host, ":", port);
}

// "ip:port" of one end of a connected TCP socket as the kernel reports it; `fallback` if it
// cannot say (the socket then fails its first read or write anyway).
std::string SocketEndpoint(int fd, bool local, const std::string& fallback) {
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  socklen_t len = sizeof(addr);
  sockaddr* sa = reinterpret_cast<sockaddr*>(&addr);
  const int rc = local ? ::getsockname(fd, sa, &len) : ::getpeername(fd, sa, &len);
  if (rc != 0 || addr.sin_family != AF_INET) return fallback;
  char ip[INET_ADDRSTRLEN] = {0};
  if (::inet_ntop(AF_INET, &addr.sin_addr, ip, sizeof(ip)) == nullptr) return fallback;
  return absl::StrCat(ip, ":", ntohs(addr.sin_port));
}

// What one Receive has charged to the budget; gives it all back when destroyed. Frames
// that are not charged (`charged` false) only count, so that the accounting stays exact.
class Charge {
 public:
  Charge(ReceiveBudget& budget, bool charged) : budget_(budget), charged_(charged) {}
  ~Charge() {
    if (charged_ && held_ > 0) budget_.Release(held_);
  }
  Charge(const Charge&) = delete;
  Charge& operator=(const Charge&) = delete;

  bool Acquire(size_t bytes) {
    if (charged_ && !budget_.TryAcquire(bytes)) return false;
    held_ += bytes;
    return true;
  }
  void Release(size_t bytes) {
    if (charged_) budget_.Release(bytes);
    held_ -= bytes;
  }

 private:
  ReceiveBudget& budget_;
  const bool charged_;
  size_t held_ = 0;
};

// Send and Receive each hold their own mutex for a whole frame, so frames never interleave
// and one thread can send while another receives. closed_ is atomic because closed() and
// Close() may be called from any thread without either mutex.
class TcpControlConnection final : public ControlConnection {
 public:
  TcpControlConnection(ScopedFd fd, const std::string& peer, const ControlChannelOptions& options)
      : fd_(std::move(fd)),
        peer_(SocketEndpoint(fd_.get(), /*local=*/false, peer)),
        local_(SocketEndpoint(fd_.get(), /*local=*/true, "?")),
        budget_(options.budget != nullptr ? options.budget : ReceiveBudget::Process()),
        max_frame_bytes_(std::min(options.max_frame_bytes, kMaxPayloadBytes)) {}

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
    size_t header_got = 0;
    absl::Status status = ReadFully(header_bytes, kFrameHeaderBytes, deadline, &header_got);
    if (!status.ok()) {
      // Nothing of a frame consumed: the stream is still aligned on a frame boundary.
      if (absl::IsDeadlineExceeded(status) && header_got == 0) return status;
      return Fail(status);
    }
    absl::StatusOr<FrameHeader> header =
        DecodeFrameHeader(absl::string_view(header_bytes, kFrameHeaderBytes));
    if (!header.ok()) return FailMalformed(header.status());

    const size_t len = header->payload_len;
    if (len > max_frame_bytes_) {
      return FailExhausted(absl::StrCat(MessageTypeName(header->type), " frame from ", peer_,
                                        " announces ", len,
                                        " bytes, more than this connection's limit of ",
                                        max_frame_bytes_));
    }
    Charge charge(*budget_, len > budget_->limits().free_frame_bytes);
    std::unique_ptr<char[]> buffer;
    size_t capacity = 0;
    size_t got = 0;
    while (got < len) {
      if (got == capacity) {
        // Grow only once full: the buffer never exceeds twice what arrived (plus the first).
        const size_t next = std::min(len, std::max(kFirstBufferBytes, 2 * capacity));
        if (!charge.Acquire(next)) return FailOverBudget(header->type, len, got);
        std::unique_ptr<char[]> bigger(new char[next]);
        if (got > 0) std::memcpy(bigger.get(), buffer.get(), got);
        buffer = std::move(bigger);
        charge.Release(capacity);
        capacity = next;
      }
      size_t chunk_got = 0;
      status = ReadFully(buffer.get() + got, capacity - got, deadline, &chunk_got);
      got += chunk_got;
      if (!status.ok()) return Fail(status);
    }
    // Decoding copies the fields out of the buffer: at most `len` bytes more.
    if (!charge.Acquire(len)) return FailOverBudget(header->type, len, got);
    absl::StatusOr<ControlMessage> message =
        DecodePayload(header->type, absl::string_view(buffer.get(), len));
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
  std::string local_address() const override { return local_; }

 private:
  absl::Status ClosedError() const {
    return absl::FailedPreconditionError(absl::StrCat("connection to ", peer_, " is closed"));
  }

  // Closes the connection and passes `status` through.
  absl::Status Fail(absl::Status status) {
    Close();
    return status;
  }

  absl::Status FailExhausted(std::string message) {
    Log(LogLevel::kWarning, absl::StrCat("closing control connection to ", peer_, ": ", message));
    return Fail(absl::ResourceExhaustedError(std::move(message)));
  }

  absl::Status FailOverBudget(MessageType type, size_t len, size_t got) {
    return FailExhausted(absl::StrCat(
        MessageTypeName(type), " frame of ", len, " bytes from ", peer_, " (", got,
        " received): the control channel's receive budget (", budget_->limits().max_total_bytes,
        " bytes for all connections, ", budget_->in_use_bytes(), " in use) has no room for it"));
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
  const std::string local_;
  const std::shared_ptr<ReceiveBudget> budget_;
  const uint32_t max_frame_bytes_;
  std::atomic<bool> closed_{false};
  absl::Mutex send_mu_;  // held for the whole of one Send
  absl::Mutex recv_mu_;  // held for the whole of one Receive
};

class TcpControlListener final : public ControlListener {
 public:
  TcpControlListener(ScopedFd fd, uint16_t port, std::string address,
                     ControlChannelOptions options)
      : fd_(std::move(fd)),
        port_(port),
        address_(std::move(address)),
        options_(std::move(options)) {}

  uint16_t port() const override { return port_; }

  absl::StatusOr<std::unique_ptr<ControlConnection>> Accept(absl::Time deadline) override {
    ASSIGN_OR_RETURN(AcceptedSocket conn, AcceptSocket(fd_.get(), deadline, address_));
    return std::unique_ptr<ControlConnection>(
        new TcpControlConnection(std::move(conn.fd), conn.peer, options_));
  }

 private:
  const ScopedFd fd_;
  const uint16_t port_;
  const std::string address_;
  const ControlChannelOptions options_;
};

}  // namespace

const std::shared_ptr<ReceiveBudget>& ReceiveBudget::Process() {
  static const auto* budget =
      new std::shared_ptr<ReceiveBudget>(std::make_shared<ReceiveBudget>(ReceiveBudgetLimits()));
  return *budget;
}

bool ReceiveBudget::TryAcquire(size_t bytes) {
  size_t in_use = in_use_.load(std::memory_order_relaxed);
  do {
    if (bytes > limits_.max_total_bytes || in_use > limits_.max_total_bytes - bytes) {
      refusals_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
  } while (!in_use_.compare_exchange_weak(in_use, in_use + bytes, std::memory_order_relaxed));
  const size_t now = in_use + bytes;
  size_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  return true;
}

void ReceiveBudget::Release(size_t bytes) { in_use_.fetch_sub(bytes, std::memory_order_relaxed); }

absl::StatusOr<std::unique_ptr<ControlListener>> ControlListener::Listen(
    const std::string& host, uint16_t port, ControlChannelOptions options) {
  ASSIGN_OR_RETURN(ScopedFd fd, ListenTcp(host, port));
  ASSIGN_OR_RETURN(uint16_t bound_port, BoundTcpPort(fd.get()));
  return std::unique_ptr<ControlListener>(new TcpControlListener(
      std::move(fd), bound_port, Address(host, bound_port), std::move(options)));
}

absl::StatusOr<std::unique_ptr<ControlConnection>> ConnectControl(const std::string& host,
                                                                  uint16_t port,
                                                                  absl::Time deadline,
                                                                  ControlChannelOptions options) {
  ASSIGN_OR_RETURN(ScopedFd fd, ConnectTcp(host, port, deadline));
  return std::unique_ptr<ControlConnection>(
      new TcpControlConnection(std::move(fd), Address(host, port), options));
}

}  // namespace kvstream
