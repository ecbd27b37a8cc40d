// Sockets: kvstream's one helper for stream sockets (TCP over IPv4, Unix-domain sockets in
// the abstract namespace), and the one place where socket errno values become Status.
//
//   ASSIGN_OR_RETURN(ScopedFd listener, ListenTcp("127.0.0.1", 0));
//   ASSIGN_OR_RETURN(uint16_t port, BoundTcpPort(listener.get()));
//   ... peer: ASSIGN_OR_RETURN(ScopedFd fd, ConnectTcp("127.0.0.1", port, deadline));
//   ASSIGN_OR_RETURN(AcceptedSocket conn, AcceptSocket(listener.get(), deadline, "stage 1"));
//   RETURN_IF_ERROR(SendAll(conn.fd.get(), bytes, deadline, conn.peer));
//
// Every socket made here is non-blocking and close-on-exec. The blocking-style calls
// (ConnectTcp, AcceptSocket, SendAll, RecvAll) wait with poll() against an absl::Time
// deadline and never past it: a deadline already passed still tries once without waiting.
// The non-blocking calls (SendSome, RecvSome) never wait at all. SIGPIPE is never raised
// (MSG_NOSIGNAL). Errors name the operation and the peer, and carry the errno text:
// Unavailable for what the network or the peer caused (refused, reset, closed, address in
// use), DeadlineExceeded when the deadline passed, ResourceExhausted when the process or
// kernel ran out of descriptors or buffers, InvalidArgument for a malformed host or name,
// Internal for a misuse (bad descriptor). Hosts are numeric IPv4 addresses or "localhost":
// name resolution (getaddrinfo) could not honour a deadline. Unix socket names live in the
// abstract namespace (no file on disk; gone when the last descriptor closes), at most
// kMaxUnixSocketNameBytes bytes.
//
// Thread safety: the functions are thread-safe; a descriptor is the caller's to serialise.
#ifndef KVSTREAM_TRANSFER_SOCKET_H_
#define KVSTREAM_TRANSFER_SOCKET_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvstream {

// Move-only owner of a file descriptor; closes it on destruction.
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
  // Gives up ownership: returns the descriptor (or -1) and leaves this empty.
  int release() { return std::exchange(fd_, -1); }
  // Closes the descriptor now (no-op when empty). Linux releases a descriptor even when
  // close() reports EINTR, so it is never retried (a retry could close a descriptor another
  // thread has just been given).
  void Reset();

 private:
  int fd_ = -1;
};

// "Connection refused (errno 111)".
std::string ErrnoText(int err);

// The Status for `err` from `operation` on the socket to `peer` (either may be empty):
// "<operation> <peer>: <errno text>", with the code chosen as the header comment says.
absl::Status SocketError(int err, absl::string_view operation, absl::string_view peer);

// Waits until `fd` is ready for `events` (POLLIN, POLLOUT). True when ready, or in an error
// or hang-up state that the next call on it reports; false when the deadline passed first.
// An error only if poll() itself fails.
absl::StatusOr<bool> WaitFd(int fd, short events, absl::Time deadline, absl::string_view operation);

// Sets or clears O_NONBLOCK.
absl::Status SetNonBlocking(int fd, bool non_blocking);
// Disables Nagle's algorithm on a TCP socket (frames are small and latency-bound).
absl::Status SetTcpNoDelay(int fd, absl::string_view peer);

// ---- TCP ----

// Listens on host:port (port 0: any free port), SO_REUSEADDR set so that a restarted worker
// can bind its port while old connections sit in TIME_WAIT. Unavailable naming the address
// when it cannot be bound.
absl::StatusOr<ScopedFd> ListenTcp(const std::string& host, uint16_t port, int backlog = 4096);

// OK when `host` is one ListenTcp and ConnectTcp take (a numeric IPv4 address or
// "localhost"); InvalidArgument saying so otherwise. Touches no socket.
absl::Status CheckTcpHost(const std::string& host);
// The port a TCP socket is bound to.
absl::StatusOr<uint16_t> BoundTcpPort(int fd);
// Connects to host:port with TCP_NODELAY set. Unavailable when refused (the message has
// "refused" and the address); DeadlineExceeded when the connection is not up in time.
// InvalidArgument for port 0 or a bad host.
absl::StatusOr<ScopedFd> ConnectTcp(const std::string& host, uint16_t port, absl::Time deadline);

// ---- Unix-domain sockets (abstract namespace) ----

inline constexpr size_t kMaxUnixSocketNameBytes = 100;

// Listens on the abstract name `name` (no leading '@' or NUL: that is added). Unavailable
// when the name is taken; InvalidArgument for an empty name, one longer than
// kMaxUnixSocketNameBytes, or one holding a NUL.
absl::StatusOr<ScopedFd> ListenUnix(absl::string_view name, int backlog = 4096);
// Connects to the abstract name `name`. Unavailable (refused) when nobody listens there;
// DeadlineExceeded while the listener's backlog stays full past the deadline.
absl::StatusOr<ScopedFd> ConnectUnix(absl::string_view name, absl::Time deadline);
// "unix:@<name>", how messages name such a socket.
std::string UnixSocketLabel(absl::string_view name);

// ---- Either kind ----

struct AcceptedSocket {
  ScopedFd fd;       // non-blocking, close-on-exec; TCP_NODELAY set for TCP
  std::string peer;  // "ip:port" for TCP; "<listener> (connection N)" for Unix sockets
  // The connecting process's ids (Unix sockets: SO_PEERCRED; TCP: -1).
  int pid = -1;
  int uid = -1;
};

// Accepts one connection on the listening socket `fd` (`listener` names it in messages).
// DeadlineExceeded when none arrives in time (with a deadline already passed: when none is
// pending, so InfinitePast() polls). A connection that died while queued is skipped.
absl::StatusOr<AcceptedSocket> AcceptSocket(int fd, absl::Time deadline,
                                            absl::string_view listener);

// ---- Reading and writing ----

// Writes all of `data`, waiting (until the deadline) while the socket is full. `*sent`, if
// given, counts the bytes written, also on failure (a partial write cannot be taken back).
// DeadlineExceeded (with the counts) when not all of it was written in time; Unavailable
// when the peer is gone.
absl::Status SendAll(int fd, absl::string_view data, absl::Time deadline, absl::string_view peer,
                     size_t* sent = nullptr);
// Reads exactly `n` bytes into `out`, waiting (until the deadline) while none are there.
// `*got`, if given, counts the bytes read, also on failure. DeadlineExceeded (with the
// counts) when they did not all arrive in time; Unavailable naming the peer when it closed
// the connection ("closed the connection", and "after k of n bytes" if some came) or the
// connection broke.
absl::Status RecvAll(int fd, char* out, size_t n, absl::Time deadline, absl::string_view peer,
                     size_t* got = nullptr);

// Writes as much of `data` as the socket takes now: the count (0 when it is full). Never
// waits. Unavailable when the peer is gone.
absl::StatusOr<size_t> SendSome(int fd, absl::string_view data, absl::string_view peer);
// Reads what is there now, at most `n` bytes: the count (0 when nothing is waiting). Never
// waits. Unavailable naming the peer when the connection broke, and at end of stream
// ("closed the connection") unless `eof` is given: then end of stream sets *eof and
// returns 0 (*eof is false otherwise). REQUIRES: n > 0.
absl::StatusOr<size_t> RecvSome(int fd, char* out, size_t n, absl::string_view peer,
                                bool* eof = nullptr);

}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SOCKET_H_
