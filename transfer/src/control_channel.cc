// The TCP control channel: non-blocking POSIX sockets driven by poll() against absl::Time
// deadlines, carrying wire.h frames. This file is where socket errno values become Status.
//
// Closing is split in two on purpose: Close() only marks the connection closed and calls
// shutdown(), which wakes any thread blocked in poll() on it; the descriptor itself is
// released by the destructor. Closing the descriptor while another thread may still be
// polling it would let the number be reused by an unrelated open() in between.
#include "kvstream/transfer/control_channel.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
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
#include "kvstream/transfer/wire.h"

namespace kvstream {
namespace {

// The payload buffer grows as bytes actually arrive rather than to the announced length at
// once, so a header that announces the maximum and then stalls costs little memory.
constexpr size_t kReadChunkBytes = 1u << 20;

// glibc offers the GNU strerror_r (returns char*) or the XSI one (returns int, fills buf)
// depending on feature macros; these overloads accept either.
[[maybe_unused]] const char* StrerrorResult(int /*xsi_result*/, const char* buf) { return buf; }
[[maybe_unused]] const char* StrerrorResult(const char* gnu_result, const char* /*buf*/) {
  return gnu_result;
}

std::string ErrnoText(int err) {
  char buf[128] = {0};
  return absl::StrCat(StrerrorResult(strerror_r(err, buf, sizeof(buf)), buf), " (errno ", err, ")");
}

// Move-only owner of a file descriptor.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(ScopedFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

 private:
  void Reset() {
    // Linux releases the descriptor even when close() reports EINTR; retrying could close
    // a descriptor another thread has just been given.
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  int fd_ = -1;
};

// Milliseconds for poll(): -1 for no deadline, 0 once it has passed, otherwise rounded up
// (so that poll does not return just before the deadline) and clamped to int.
int PollTimeoutMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  const int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)));
  return static_cast<int>(std::min<int64_t>(ms, INT_MAX));
}

// Waits until `fd` is ready for `events`. True when ready (or in an error/hang-up state the
// next syscall will report), false when the deadline passed first.
absl::StatusOr<bool> WaitFd(int fd, short events, absl::Time deadline, absl::string_view op) {
  for (;;) {
    const int timeout_ms = PollTimeoutMs(deadline);
    pollfd pfd;
    pfd.fd = fd;
    pfd.events = events;
    pfd.revents = 0;
    const int n = ::poll(&pfd, 1, timeout_ms);
    if (n > 0) return true;
    if (n == 0) {
      if (timeout_ms == 0 || absl::Now() >= deadline) return false;
      continue;  // the timeout was clamped, or the clocks disagree by a hair
    }
    if (errno == EINTR) continue;
    return absl::InternalError(absl::StrCat("poll during ", op, ": ", ErrnoText(errno)));
  }
}

// Only numeric IPv4 and "localhost": name resolution (getaddrinfo) cannot honour a deadline.
absl::StatusOr<in_addr> ParseHost(const std::string& host) {
  const std::string numeric = host == "localhost" ? "127.0.0.1" : host;
  in_addr addr;
  if (::inet_pton(AF_INET, numeric.c_str(), &addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("host '", host, "' is neither a numeric IPv4 address nor 'localhost'"));
  }
  return addr;
}

std::string FormatAddress(const sockaddr_in& addr) {
  char ip[INET_ADDRSTRLEN] = {0};
  if (::inet_ntop(AF_INET, &addr.sin_addr, ip, sizeof(ip)) == nullptr) return "?";
  return absl::StrCat(ip, ":", ntohs(addr.sin_port));
}

sockaddr_in MakeAddress(in_addr ip, uint16_t port) {
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_addr = ip;
  addr.sin_port = htons(port);
  return addr;
}

absl::Status SetNoDelay(int fd, absl::string_view peer) {
  const int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    return absl::InternalError(
        absl::StrCat("setsockopt(TCP_NODELAY) for ", peer, ": ", ErrnoText(errno)));
  }
  return absl::OkStatus();
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
    while (sent < frame->size()) {
      const ssize_t n = ::send(fd_.get(), frame->data() + sent, frame->size() - sent, MSG_NOSIGNAL);
      if (n >= 0) {
        sent += static_cast<size_t>(n);
        continue;
      }
      const int err = errno;
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        absl::StatusOr<bool> ready = WaitFd(fd_.get(), POLLOUT, deadline, "send");
        if (!ready.ok()) return Fail(ready.status());
        if (!*ready) {
          return Fail(absl::DeadlineExceededError(
              absl::StrCat("deadline exceeded sending ", MessageTypeName(TypeOf(message)), " to ",
                           peer_, " (", sent, " of ", frame->size(), " bytes written)")));
        }
        continue;
      }
      if (closed()) return ClosedError();  // closed locally while we were writing
      return Fail(absl::UnavailableError(absl::StrCat("send ", MessageTypeName(TypeOf(message)),
                                                      " to ", peer_, ": ", ErrnoText(err))));
    }
    return absl::OkStatus();
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
    while (*got < n) {
      const ssize_t r = ::recv(fd_.get(), buf + *got, n - *got, 0);
      if (r > 0) {
        *got += static_cast<size_t>(r);
        continue;
      }
      if (r == 0) {
        if (closed()) return ClosedError();  // our own shutdown() woke us
        return absl::UnavailableError(absl::StrCat("peer ", peer_, " closed the connection",
                                                   *got > 0 ? " in the middle of a frame" : ""));
      }
      const int err = errno;
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        ASSIGN_OR_RETURN(bool ready, WaitFd(fd_.get(), POLLIN, deadline, "receive"));
        if (!ready) {
          return absl::DeadlineExceededError(
              *got > 0 ? absl::StrCat("deadline exceeded in the middle of a frame from ", peer_)
                       : absl::StrCat("no frame from ", peer_, " before the deadline"));
        }
        continue;
      }
      if (closed()) return ClosedError();
      return absl::UnavailableError(absl::StrCat("recv from ", peer_, ": ", ErrnoText(err)));
    }
    return absl::OkStatus();
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
    for (;;) {
      sockaddr_in peer;
      socklen_t peer_len = sizeof(peer);
      const int fd = ::accept4(fd_.get(), reinterpret_cast<sockaddr*>(&peer), &peer_len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) {
        ScopedFd conn(fd);
        const std::string peer_address = FormatAddress(peer);
        RETURN_IF_ERROR(SetNoDelay(conn.get(), peer_address));
        return std::unique_ptr<ControlConnection>(
            new TcpControlConnection(std::move(conn), peer_address));
      }
      const int err = errno;
      // A connection that died while queued is not our failure: wait for the next one.
      if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        ASSIGN_OR_RETURN(bool ready, WaitFd(fd_.get(), POLLIN, deadline, "accept"));
        if (!ready) {
          return absl::DeadlineExceededError(
              absl::StrCat("no connection on ", address_, " before the deadline"));
        }
        continue;
      }
      return absl::UnavailableError(absl::StrCat("accept on ", address_, ": ", ErrnoText(err)));
    }
  }

 private:
  const ScopedFd fd_;
  const uint16_t port_;
  const std::string address_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ControlListener>> ControlListener::Listen(const std::string& host,
                                                                         uint16_t port) {
  ASSIGN_OR_RETURN(in_addr ip, ParseHost(host));
  sockaddr_in addr = MakeAddress(ip, port);
  const std::string address = FormatAddress(addr);
  ScopedFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    return absl::UnavailableError(
        absl::StrCat("socket for listening on ", address, ": ", ErrnoText(errno)));
  }
  // Lets a restarted worker bind its port while old connections sit in TIME_WAIT.
  const int one = 1;
  if (::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("setsockopt(SO_REUSEADDR) on ", address, ": ", ErrnoText(errno)));
  }
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(absl::StrCat("bind ", address, ": ", ErrnoText(errno)));
  }
  if (::listen(fd.get(), SOMAXCONN) != 0) {
    return absl::UnavailableError(absl::StrCat("listen on ", address, ": ", ErrnoText(errno)));
  }
  sockaddr_in bound;
  socklen_t bound_len = sizeof(bound);
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &bound_len) != 0) {
    return absl::UnavailableError(absl::StrCat("getsockname on ", address, ": ", ErrnoText(errno)));
  }
  const uint16_t bound_port = ntohs(bound.sin_port);
  return std::unique_ptr<ControlListener>(
      new TcpControlListener(std::move(fd), bound_port, FormatAddress(bound)));
}

absl::StatusOr<std::unique_ptr<ControlConnection>> ConnectControl(const std::string& host,
                                                                  uint16_t port,
                                                                  absl::Time deadline) {
  ASSIGN_OR_RETURN(in_addr ip, ParseHost(host));
  if (port == 0) return absl::InvalidArgumentError(absl::StrCat("cannot connect to ", host, ":0"));
  const sockaddr_in addr = MakeAddress(ip, port);
  const std::string address = FormatAddress(addr);
  ScopedFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    return absl::UnavailableError(
        absl::StrCat("socket for connecting to ", address, ": ", ErrnoText(errno)));
  }
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    // EINTR: a non-blocking connect carries on asynchronously, like EINPROGRESS.
    if (err != EINPROGRESS && err != EINTR) {
      return absl::UnavailableError(absl::StrCat("connect to ", address, ": ", ErrnoText(err)));
    }
    ASSIGN_OR_RETURN(bool ready, WaitFd(fd.get(), POLLOUT, deadline, "connect"));
    if (!ready) {
      return absl::DeadlineExceededError(
          absl::StrCat("connect to ", address, ": deadline exceeded"));
    }
    int so_error = 0;
    socklen_t len = sizeof(so_error);
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so_error, &len) != 0) {
      so_error = errno;
    }
    if (so_error != 0) {
      return absl::UnavailableError(
          absl::StrCat("connect to ", address, ": ", ErrnoText(so_error)));
    }
  }
  RETURN_IF_ERROR(SetNoDelay(fd.get(), address));
  return std::unique_ptr<ControlConnection>(new TcpControlConnection(std::move(fd), address));
}

}  // namespace kvstream
