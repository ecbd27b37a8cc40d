// Sockets (socket.h): non-blocking POSIX sockets driven by poll() against absl::Time
// deadlines.
#include "kvstream/transfer/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

// glibc offers the GNU strerror_r (returns char*) or the XSI one (returns int, fills buf)
// depending on feature macros; these overloads accept either.
[[maybe_unused]] const char* StrerrorResult(int /*xsi_result*/, const char* buf) { return buf; }
[[maybe_unused]] const char* StrerrorResult(const char* gnu_result, const char* /*buf*/) {
  return gnu_result;
}

// Milliseconds for poll(): -1 for no deadline, 0 once it has passed, otherwise rounded up
// (so that poll does not return just before the deadline) and clamped to int.
int PollTimeoutMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  const int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)));
  return static_cast<int>(std::min<int64_t>(ms, INT_MAX));
}

bool WouldBlock(int err) { return err == EAGAIN || err == EWOULDBLOCK; }

// Only numeric IPv4 and "localhost".
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

// The abstract-namespace address of `name` and its length for bind/connect.
absl::StatusOr<std::pair<sockaddr_un, socklen_t>> MakeUnixAddress(absl::string_view name) {
  if (name.empty() || name.size() > kMaxUnixSocketNameBytes ||
      name.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Unix socket name '", name, "' must be 1 to ", kMaxUnixSocketNameBytes,
        " bytes without NUL"));
  }
  sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  addr.sun_path[0] = '\0';  // abstract namespace
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return std::make_pair(addr, len);
}

absl::StatusOr<ScopedFd> NewSocket(int domain, absl::string_view what) {
  ScopedFd fd(::socket(domain, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return SocketError(errno, "socket for", what);
  return fd;
}

// After a non-blocking connect reported EINPROGRESS: waits for the outcome.
absl::Status FinishConnect(int fd, absl::Time deadline, const std::string& address) {
  ASSIGN_OR_RETURN(bool ready, WaitFd(fd, POLLOUT, deadline, "connect"));
  if (!ready) {
    return absl::DeadlineExceededError(absl::StrCat("connect to ", address, ": deadline exceeded"));
  }
  int so_error = 0;
  socklen_t len = sizeof(so_error);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) != 0) so_error = errno;
  if (so_error != 0) return SocketError(so_error, "connect to", address);
  return absl::OkStatus();
}

}  // namespace

void ScopedFd::Reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string ErrnoText(int err) {
  char buf[128] = {0};
  return absl::StrCat(StrerrorResult(strerror_r(err, buf, sizeof(buf)), buf), " (errno ", err, ")");
}

absl::Status SocketError(int err, absl::string_view operation, absl::string_view peer) {
  std::string message = std::string(operation);
  if (!peer.empty()) absl::StrAppend(&message, message.empty() ? "" : " ", peer);
  absl::StrAppend(&message, ": ", ErrnoText(err));
  switch (err) {
    case EMFILE:
    case ENFILE:
    case ENOBUFS:
    case ENOMEM:
      return absl::ResourceExhaustedError(message);
    case EBADF:
    case EFAULT:
    case ENOTSOCK:
    case EINVAL:
      return absl::InternalError(message);
    case ETIMEDOUT:
      return absl::DeadlineExceededError(message);
    default:
      // Refused, reset, broken pipe, unreachable, address in use or unavailable: the other
      // side or the network.
      return absl::UnavailableError(message);
  }
}

absl::StatusOr<bool> WaitFd(int fd, short events, absl::Time deadline,
                            absl::string_view operation) {
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
    return absl::InternalError(absl::StrCat("poll during ", operation, ": ", ErrnoText(errno)));
  }
}

absl::Status SetNonBlocking(int fd, bool non_blocking) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0) return SocketError(errno, "fcntl(F_GETFL)", "");
  const int wanted = non_blocking ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  if (wanted != flags && ::fcntl(fd, F_SETFL, wanted) != 0) {
    return SocketError(errno, "fcntl(F_SETFL)", "");
  }
  return absl::OkStatus();
}

absl::Status SetTcpNoDelay(int fd, absl::string_view peer) {
  const int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    return SocketError(errno, "setsockopt(TCP_NODELAY) for", peer);
  }
  return absl::OkStatus();
}

absl::Status CheckTcpHost(const std::string& host) { return ParseHost(host).status(); }

absl::StatusOr<ScopedFd> ListenTcp(const std::string& host, uint16_t port, int backlog) {
  ASSIGN_OR_RETURN(in_addr ip, ParseHost(host));
  const sockaddr_in addr = MakeAddress(ip, port);
  const std::string address = FormatAddress(addr);
  ASSIGN_OR_RETURN(ScopedFd fd, NewSocket(AF_INET, absl::StrCat("listening on ", address)));
  const int one = 1;
  if (::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) {
    return SocketError(errno, "setsockopt(SO_REUSEADDR) on", address);
  }
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return SocketError(errno, "bind", address);
  }
  if (::listen(fd.get(), backlog) != 0) return SocketError(errno, "listen on", address);
  return fd;
}

absl::StatusOr<uint16_t> BoundTcpPort(int fd) {
  sockaddr_in bound;
  socklen_t len = sizeof(bound);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    return SocketError(errno, "getsockname", "");
  }
  if (bound.sin_family != AF_INET) {
    return absl::InvalidArgumentError("BoundTcpPort: not an IPv4 socket");
  }
  return ntohs(bound.sin_port);
}

absl::StatusOr<ScopedFd> ConnectTcp(const std::string& host, uint16_t port, absl::Time deadline) {
  ASSIGN_OR_RETURN(in_addr ip, ParseHost(host));
  if (port == 0) return absl::InvalidArgumentError(absl::StrCat("cannot connect to ", host, ":0"));
  const sockaddr_in addr = MakeAddress(ip, port);
  const std::string address = FormatAddress(addr);
  ASSIGN_OR_RETURN(ScopedFd fd, NewSocket(AF_INET, absl::StrCat("connecting to ", address)));
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    // EINTR: a non-blocking connect carries on asynchronously, like EINPROGRESS.
    if (err != EINPROGRESS && err != EINTR) return SocketError(err, "connect to", address);
    RETURN_IF_ERROR(FinishConnect(fd.get(), deadline, address));
  }
  RETURN_IF_ERROR(SetTcpNoDelay(fd.get(), address));
  return fd;
}

std::string UnixSocketLabel(absl::string_view name) { return absl::StrCat("unix:@", name); }

absl::StatusOr<ScopedFd> ListenUnix(absl::string_view name, int backlog) {
  ASSIGN_OR_RETURN(auto address, MakeUnixAddress(name));
  const std::string label = UnixSocketLabel(name);
  ASSIGN_OR_RETURN(ScopedFd fd, NewSocket(AF_UNIX, absl::StrCat("listening on ", label)));
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address.first), address.second) != 0) {
    return SocketError(errno, "bind", label);
  }
  if (::listen(fd.get(), backlog) != 0) return SocketError(errno, "listen on", label);
  return fd;
}

absl::StatusOr<ScopedFd> ConnectUnix(absl::string_view name, absl::Time deadline) {
  ASSIGN_OR_RETURN(auto address, MakeUnixAddress(name));
  const std::string label = UnixSocketLabel(name);
  for (;;) {
    ASSIGN_OR_RETURN(ScopedFd fd, NewSocket(AF_UNIX, absl::StrCat("connecting to ", label)));
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&address.first), address.second) ==
        0) {
      return fd;
    }
    const int err = errno;
    if (err == EINPROGRESS || err == EINTR) {
      RETURN_IF_ERROR(FinishConnect(fd.get(), deadline, label));
      return fd;
    }
    // A non-blocking Unix-domain connect fails with EAGAIN while the listener's backlog is
    // full, and must be retried with a new call.
    if (!WouldBlock(err)) return SocketError(err, "connect to", label);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "connect to ", label, ": the listener's backlog stayed full until the deadline"));
    }
    absl::SleepFor(std::min(absl::Milliseconds(1), deadline - absl::Now()));
  }
}

absl::StatusOr<AcceptedSocket> AcceptSocket(int fd, absl::Time deadline,
                                            absl::string_view listener) {
  static std::atomic<uint64_t> next_connection{1};
  for (;;) {
    sockaddr_storage peer;
    socklen_t peer_len = sizeof(peer);
    const int conn = ::accept4(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (conn >= 0) {
      AcceptedSocket accepted;
      accepted.fd = ScopedFd(conn);
      if (peer.ss_family == AF_INET) {
        accepted.peer = FormatAddress(*reinterpret_cast<const sockaddr_in*>(&peer));
        RETURN_IF_ERROR(SetTcpNoDelay(conn, accepted.peer));
      } else {
        accepted.peer = absl::StrCat(listener, " (connection ", next_connection.fetch_add(1), ")");
        ucred cred;
        socklen_t cred_len = sizeof(cred);
        if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) == 0) {
          accepted.pid = static_cast<int>(cred.pid);
          accepted.uid = static_cast<int>(cred.uid);
        }
      }
      return accepted;
    }
    const int err = errno;
    // A connection that died while queued is not our failure: wait for the next one.
    if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
    if (!WouldBlock(err)) return SocketError(err, "accept on", listener);
    ASSIGN_OR_RETURN(bool ready, WaitFd(fd, POLLIN, deadline, "accept"));
    if (!ready) {
      return absl::DeadlineExceededError(
          absl::StrCat("no connection on ", listener, " before the deadline"));
    }
  }
}

absl::StatusOr<size_t> SendSome(int fd, absl::string_view data, absl::string_view peer) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n =
        ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    const int err = errno;
    if (err == EINTR) continue;
    if (WouldBlock(err)) break;
    return SocketError(err, "send to", peer);
  }
  return sent;
}

absl::StatusOr<size_t> RecvSome(int fd, char* out, size_t n, absl::string_view peer,
                                bool* eof) {
  if (eof != nullptr) *eof = false;
  for (;;) {
    const ssize_t r = ::recv(fd, out, n, MSG_DONTWAIT);
    if (r > 0) return static_cast<size_t>(r);
    if (r == 0) {
      if (eof == nullptr) {
        return absl::UnavailableError(absl::StrCat(peer, " closed the connection"));
      }
      *eof = true;
      return size_t{0};
    }
    const int err = errno;
    if (err == EINTR) continue;
    if (WouldBlock(err)) return size_t{0};
    return SocketError(err, "recv from", peer);
  }
}

absl::Status SendAll(int fd, absl::string_view data, absl::Time deadline, absl::string_view peer,
                     size_t* sent_out) {
  size_t sent = 0;
  absl::Status status;
  while (sent < data.size()) {
    absl::StatusOr<size_t> n = SendSome(fd, data.substr(sent), peer);
    if (!n.ok()) {
      status = n.status();
      break;
    }
    sent += *n;
    if (sent == data.size()) break;
    absl::StatusOr<bool> ready = WaitFd(fd, POLLOUT, deadline, "send");
    if (!ready.ok()) {
      status = ready.status();
      break;
    }
    if (!*ready) {
      status = absl::DeadlineExceededError(absl::StrCat("deadline exceeded sending to ", peer,
                                                        " (", sent, " of ", data.size(),
                                                        " bytes written)"));
      break;
    }
  }
  if (sent_out != nullptr) *sent_out = sent;
  return status;
}

absl::Status RecvAll(int fd, char* out, size_t n, absl::Time deadline, absl::string_view peer,
                     size_t* got_out) {
  size_t got = 0;
  absl::Status status;
  while (got < n) {
    absl::StatusOr<size_t> r = RecvSome(fd, out + got, n - got, peer);
    if (!r.ok()) {
      status = r.status();
      if (got > 0 && absl::IsUnavailable(status)) {
        status = absl::UnavailableError(
            absl::StrCat(status.message(), " after ", got, " of ", n, " bytes"));
      }
      break;
    }
    got += *r;
    if (got == n) break;
    if (*r > 0) continue;
    absl::StatusOr<bool> ready = WaitFd(fd, POLLIN, deadline, "receive");
    if (!ready.ok()) {
      status = ready.status();
      break;
    }
    if (!*ready) {
      status = absl::DeadlineExceededError(absl::StrCat("deadline exceeded receiving from ", peer,
                                                        " (", got, " of ", n, " bytes read)"));
      break;
    }
  }
  if (got_out != nullptr) *got_out = got;
  return status;
}

}  // namespace kvstream
