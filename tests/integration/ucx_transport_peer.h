// Shared by the multi-process UCX transport test and its peer program
// (ucx_transport_peer_main.cc): the deterministic data pattern and scattered segments both
// sides compute, a child-process launcher, and line/byte I/O on pipes bounded by deadlines.
//
// The control protocol is deliberately not kvstream's control channel (tested elsewhere):
// newline-terminated text lines, binary values hex-encoded, over a pipe pair.
#ifndef KVSTREAM_TESTS_INTEGRATION_UCX_TRANSPORT_PEER_H_
#define KVSTREAM_TESTS_INTEGRATION_UCX_TRANSPORT_PEER_H_

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {
namespace test {

// The file descriptor the peer program writes its protocol lines to (its stdout stays free
// for UCX's own log lines).
inline constexpr int kPeerOutFd = 3;

inline void FillPattern(char* data, size_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<char>(1 + rng() % 255);
}

// `count` blocks of `block` bytes from random distinct source blocks to random distinct
// destination blocks, both drawn from [0, pool_blocks).
inline std::vector<Segment> ScatteredSegments(size_t count, size_t block, size_t pool_blocks,
                                              uint32_t seed) {
  std::vector<uint64_t> src(pool_blocks), dst(pool_blocks);
  std::iota(src.begin(), src.end(), 0);
  std::iota(dst.begin(), dst.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(src.begin(), src.end(), rng);
  std::shuffle(dst.begin(), dst.end(), rng);
  std::vector<Segment> segments(std::min(count, pool_blocks));
  for (size_t i = 0; i < segments.size(); ++i) {
    segments[i].local_offset = src[i] * block;
    segments[i].remote_offset = dst[i] * block;
    segments[i].length = block;
  }
  return segments;
}

// Writes all of `data` to `fd` (blocking; pipes to a live reader drain quickly).
inline absl::Status WriteAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError(absl::StrCat("write: ", std::strerror(errno)));
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

inline absl::Status WriteLine(int fd, const std::string& line) {
  std::string with_newline = line + "\n";
  return WriteAll(fd, with_newline.data(), with_newline.size());
}

// Buffered reads from a pipe, each bounded by a deadline.
class PipeReader {
 public:
  explicit PipeReader(int fd) : fd_(fd) {}

  absl::StatusOr<std::string> ReadLine(absl::Time deadline) {
    while (true) {
      size_t newline = buffer_.find('\n');
      if (newline != std::string::npos) {
        std::string line = buffer_.substr(0, newline);
        buffer_.erase(0, newline + 1);
        return line;
      }
      absl::Status status = Fill(deadline);
      if (!status.ok()) return status;
    }
  }

  absl::Status ReadExactly(char* out, size_t size, absl::Time deadline) {
    while (buffer_.size() < size) {
      // Copy what is buffered, then read the rest straight into `out`.
      size_t have = buffer_.size();
      std::memcpy(out, buffer_.data(), have);
      buffer_.clear();
      out += have;
      size -= have;
      absl::Status status = Fill(deadline);
      if (!status.ok()) return status;
    }
    std::memcpy(out, buffer_.data(), size);
    buffer_.erase(0, size);
    return absl::OkStatus();
  }

  // True if a line is already buffered or data can be read without blocking.
  bool Readable() {
    if (buffer_.find('\n') != std::string::npos) return true;
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }

 private:
  absl::Status Fill(absl::Time deadline) {
    while (true) {
      const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
      pollfd p{fd_, POLLIN, 0};
      int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1000)));
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0) return absl::InternalError(absl::StrCat("poll: ", std::strerror(errno)));
      if (ready == 0) {
        if (absl::Now() >= deadline) return absl::DeadlineExceededError("pipe read timed out");
        continue;
      }
      char chunk[1 << 16];
      ssize_t n = ::read(fd_, chunk, sizeof(chunk));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return absl::InternalError(absl::StrCat("read: ", std::strerror(errno)));
      if (n == 0) return absl::UnavailableError("pipe closed by the other side");
      buffer_.append(chunk, static_cast<size_t>(n));
      return absl::OkStatus();
    }
  }

  int fd_;
  std::string buffer_;
};

// A child process running `argv` with its stdin fed by `to_child` and its kPeerOutFd read
// through `from_child`. Killed (SIGKILL) and reaped on destruction if still running.
// A line from `reader`, progressing `transport` meanwhile (what the other process waits for
// may need this side's progress, e.g. a notification still to be sent); DeadlineExceeded
// when no line came by `deadline`.
inline absl::StatusOr<std::string> ReadLineProgressing(PipeReader& reader, Transport& transport,
                                                       absl::Time deadline) {
  while (!reader.Readable()) {
    absl::Status progress = transport.Progress();
    if (!progress.ok()) return progress;
    if (absl::Now() >= deadline) return absl::DeadlineExceededError("no line from the child");
  }
  return reader.ReadLine(deadline);
}

class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn(const std::vector<std::string>& argv) {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) {
      return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
    }
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
    if (pid == 0) {
      // Only async-signal-safe calls until exec.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(126);
      // dup2 onto itself would keep O_CLOEXEC: clear it explicitly in that case.
      if (in[0] == 0) {
        ::fcntl(0, F_SETFD, 0);
      } else {
        ::dup2(in[0], 0);
      }
      if (out[1] == kPeerOutFd) {
        ::fcntl(kPeerOutFd, F_SETFD, 0);
      } else {
        ::dup2(out[1], kPeerOutFd);
      }
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    return std::unique_ptr<ChildProcess>(new ChildProcess(pid, in[1], out[0]));
  }

  ~ChildProcess() {
    ::close(to_child_);
    ::close(from_child_);
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  int to_child() const { return to_child_; }
  PipeReader& reader() { return reader_; }

  // SIGKILL and reap.
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // SIGSTOP, returning once the child has stopped; SIGCONT.
  void Stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGSTOP);
    int status = 0;
    ::waitpid(pid_, &status, WUNTRACED);
  }
  void Continue() {
    if (pid_ > 0) ::kill(pid_, SIGCONT);
  }

  // Waits (bounded) for a normal exit; returns the exit status or an error.
  absl::StatusOr<int> Wait(absl::Time deadline) {
    while (pid_ > 0) {
      int status = 0;
      pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        if (WIFEXITED(status)) return WEXITSTATUS(status);
        return absl::InternalError(absl::StrCat("child died with signal ", WTERMSIG(status)));
      }
      if (absl::Now() >= deadline) return absl::DeadlineExceededError("child did not exit");
      absl::SleepFor(absl::Milliseconds(5));
    }
    return absl::FailedPreconditionError("child already reaped");
  }

 private:
  ChildProcess(pid_t pid, int to_child, int from_child)
      : pid_(pid), to_child_(to_child), from_child_(from_child), reader_(from_child) {}

  pid_t pid_;
  int to_child_;
  int from_child_;
  PipeReader reader_;
};

}  // namespace test
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_INTEGRATION_UCX_TRANSPORT_PEER_H_
