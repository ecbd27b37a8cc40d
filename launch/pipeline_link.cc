// Pipeline stages joined over TCP (pipeline_link.h).
#include "pipeline_link.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

constexpr uint32_t kFrameMagic = 0x4650564B;  // "KVPF"
constexpr uint32_t kHelloMagic = 0x4850564B;  // "KVPH"
constexpr uint32_t kVersion = 2;  // 2: the hello carries the group key
constexpr size_t kFrameHeaderBytes = 12;  // magic, payload length
// step, schedule, value count, error count: the payload of an empty message.
constexpr uint64_t kMinPayload = 8 + 8 + 8 + 4;
// Receive grows its payload buffer by at most this much ahead of the bytes that arrived.
constexpr size_t kReadChunkBytes = size_t{4} << 20;
constexpr uint64_t kLastCode = static_cast<uint64_t>(absl::StatusCode::kUnauthenticated);

static_assert(sizeof(float) == 4, "floats travel as 4 bytes");

void Put(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Reads little-endian integers from a payload, failing once it would run past the end.
class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  bool Get(int n, uint64_t& v) {
    if (s_.size() - pos_ < static_cast<size_t>(n)) return false;
    v = 0;
    for (int i = 0; i < n; ++i) {
      v |= static_cast<uint64_t>(static_cast<uint8_t>(s_[pos_ + i])) << (8 * i);
    }
    pos_ += n;
    return true;
  }
  bool Bytes(size_t n, std::string& out) {
    if (s_.size() - pos_ < n) return false;
    out.assign(s_, pos_, n);
    pos_ += n;
    return true;
  }
  size_t remaining() const { return s_.size() - pos_; }
  const char* here() const { return s_.data() + pos_; }
  void Skip(size_t n) { pos_ += n; }

 private:
  const std::string& s_;
  size_t pos_ = 0;
};

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { Reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Waits until `fd` is ready for `events` or the deadline passes.
absl::Status WaitFor(int fd, short events, absl::Time deadline, absl::string_view what) {
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
    }
    pollfd p{fd, events, 0};
    // Clamped before converting: `left` is infinite for absl::InfiniteFuture(). Rounded up so
    // that poll does not return just before the deadline.
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(
        absl::Ceil(std::min(left, absl::Seconds(1)), absl::Milliseconds(1))));
    const int r = poll(&p, 1, ms);
    if (r > 0) return absl::OkStatus();
    if (r < 0 && errno != EINTR) return Errno(what);
  }
}

// Sends all of `data`; `*off` counts the bytes sent, also on failure.
absl::Status SendAll(int fd, const std::string& data, absl::Time deadline, absl::string_view what,
                     size_t* off_out) {
  size_t& off = *off_out;
  off = 0;
  while (off < data.size()) {
    RETURN_IF_ERROR(WaitFor(fd, POLLOUT, deadline, what));
    const ssize_t n = send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return Errno(what);
    }
    off += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Receives exactly `len` bytes; `*off` counts the bytes received, also on failure.
absl::Status RecvAll(int fd, char* out, size_t len, absl::Time deadline, absl::string_view what,
                     size_t* off_out) {
  size_t& off = *off_out;
  off = 0;
  while (off < len) {
    RETURN_IF_ERROR(WaitFor(fd, POLLIN, deadline, what));
    const ssize_t n = recv(fd, out + off, len - off, MSG_DONTWAIT);
    if (n == 0) return absl::UnavailableError(absl::StrCat(what, ": the other stage closed"));
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return Errno(what);
    }
    off += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Hello: magic, version, stage, number of stages, group key length (4 bytes each), key.
std::string EncodeHello(int stage, int num_stages, const std::string& group_key) {
  std::string out;
  Put(out, kHelloMagic, 4);
  Put(out, kVersion, 4);
  Put(out, static_cast<uint32_t>(stage), 4);
  Put(out, static_cast<uint32_t>(num_stages), 4);
  Put(out, group_key.size(), 4);
  out += group_key;
  return out;
}

// Receives the other side's hello and checks it is `want_stage` of `num_stages` with the
// same group key.
absl::Status ExpectHello(int fd, int want_stage, int num_stages, const std::string& group_key,
                         absl::Time deadline) {
  std::string buf(20, '\0');
  size_t got = 0;
  RETURN_IF_ERROR(RecvAll(fd, buf.data(), buf.size(), deadline, "pipeline stage hello", &got));
  Reader r(buf);
  uint64_t magic = 0, version = 0, stage = 0, stages = 0, key_bytes = 0;
  r.Get(4, magic);
  r.Get(4, version);
  r.Get(4, stage);
  r.Get(4, stages);
  r.Get(4, key_bytes);
  if (magic != kHelloMagic || version != kVersion) {
    return absl::FailedPreconditionError(
        "pipeline stage hello: not a kvstream stage (or another version)");
  }
  if (static_cast<int>(stage) != want_stage || static_cast<int>(stages) != num_stages) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pipeline stage hello: expected stage ", want_stage, " of ", num_stages, ", got stage ",
        stage, " of ", stages, " (do the decode ranks agree on the pipeline size?)"));
  }
  if (key_bytes > kMaxStageGroupKeyBytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("pipeline stage hello: stage ", stage, " announces a group key of ",
                     key_bytes, " bytes, more than ", kMaxStageGroupKeyBytes));
  }
  std::string key(static_cast<size_t>(key_bytes), '\0');
  RETURN_IF_ERROR(RecvAll(fd, key.data(), key.size(), deadline, "pipeline stage hello", &got));
  if (key != group_key) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pipeline stage hello: stage ", stage, " belongs to group '", absl::CHexEscape(key),
        "', this stage to '", absl::CHexEscape(group_key),
        "' (stages of another job or model on the same rendezvous path?)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<sockaddr_in> ParseAddress(const std::string& host, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  const std::string h = host == "localhost" ? "127.0.0.1" : host;
  if (inet_pton(AF_INET, h.c_str(), &a.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("'", host, "' is not an IPv4 address"));
  }
  return a;
}

absl::StatusOr<Fd> Listen(const std::string& host, int& port) {
  ASSIGN_OR_RETURN(sockaddr_in addr, ParseAddress(host, 0));
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Errno("pipeline stage socket");
  const int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd.get(), 4) != 0) {
    return Errno(absl::StrCat("pipeline stage listening on ", host));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  port = ntohs(addr.sin_port);
  return fd;
}

// Writes "host:port" to `path` (through a rename, so a reader never sees half a line).
absl::Status Publish(const std::string& path, const std::string& address) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << address << "\n";
    if (!f) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

// Removes the rendezvous file at `path` if it still holds `address` (what this stage wrote):
// once the previous stage is connected nobody needs it, and a stale file would point a later
// job at a dead port until its own stage overwrites it.
void Unpublish(const std::string& path, const std::string& address) {
  std::ifstream f(path);
  std::string line;
  if (f && std::getline(f, line) && line == address) std::remove(path.c_str());
}

// Reads the next stage's address from its rendezvous file and connects, retrying until the
// deadline (the file may not exist yet).
absl::StatusOr<Fd> ConnectNext(const std::string& path, absl::Time deadline) {
  absl::Status last = absl::NotFoundError(absl::StrCat("no rendezvous file ", path));
  while (absl::Now() < deadline) {
    std::ifstream f(path);
    std::string line;
    if (!f || !std::getline(f, line) || line.empty()) {
      absl::SleepFor(absl::Milliseconds(20));
      continue;
    }
    const size_t colon = line.rfind(':');
    int port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(line.substr(colon + 1), &port)) {
      return absl::InvalidArgumentError(absl::StrCat(path, " holds '", line, "', not host:port"));
    }
    ASSIGN_OR_RETURN(sockaddr_in addr, ParseAddress(line.substr(0, colon), port));
    Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) return Errno("pipeline stage socket");
    if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 &&
        errno != EINPROGRESS) {
      last = Errno(absl::StrCat("connecting to the next pipeline stage at ", line));
      absl::SleepFor(absl::Milliseconds(20));
      continue;
    }
    absl::Status ready = WaitFor(fd.get(), POLLOUT, deadline, "connecting to the next stage");
    if (!ready.ok()) return ready;
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      last = absl::UnavailableError(absl::StrCat("connecting to the next pipeline stage at ",
                                                 line, ": ", std::strerror(err)));
      absl::SleepFor(absl::Milliseconds(20));
      continue;
    }
    return fd;
  }
  return absl::DeadlineExceededError(absl::StrCat("the next pipeline stage did not show up in ",
                                                  path, " in time: ", last.message()));
}

void NoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Bytes of the payload EncodeStageMessage produces for `m` (when it succeeds).
uint64_t EncodedSize(const StageMessage& m) {
  uint64_t size = kMinPayload + uint64_t{m.values.size()} * sizeof(float);
  for (const StageError& e : m.errors) {
    size += 12 + e.request_id.size() + std::min(e.message.size(), kMaxStageErrorMessageBytes);
  }
  return size;
}

// One neighbour: the socket to it and, once a failure has left the stream out of step, why.
struct Link {
  Fd fd;
  std::string broken;  // empty while the link is usable
};

class TcpStageChannel final : public StageChannel {
 public:
  TcpStageChannel(int stage, int num_stages, uint64_t max_frame_bytes, Fd prev, Fd next)
      : stage_(stage), num_stages_(num_stages), max_frame_bytes_(max_frame_bytes) {
    prev_.fd = std::move(prev);
    next_.fd = std::move(next);
  }

  int stage() const override { return stage_; }
  int num_stages() const override { return num_stages_; }

  absl::Status SendForward(const StageMessage& m, absl::Time deadline) override {
    return Send(next_, m, deadline, "sending to the next pipeline stage");
  }
  absl::StatusOr<StageMessage> ReceiveForward(absl::Time deadline) override {
    return Receive(prev_, deadline, "receiving from the previous pipeline stage");
  }
  absl::Status SendBackward(const StageMessage& m, absl::Time deadline) override {
    return Send(prev_, m, deadline, "sending to the previous pipeline stage");
  }
  absl::StatusOr<StageMessage> ReceiveBackward(absl::Time deadline) override {
    return Receive(next_, deadline, "receiving from the next pipeline stage");
  }

 private:
  // OK when `link` can carry a frame.
  static absl::Status Usable(const Link& link, absl::string_view what) {
    if (!link.broken.empty()) {
      return absl::UnavailableError(
          absl::StrCat(what, ": the link was closed after an earlier failure: ", link.broken));
    }
    if (!link.fd.valid()) {
      return absl::FailedPreconditionError(absl::StrCat(what, ": no such stage"));
    }
    return absl::OkStatus();
  }

  // Closes `link`, whose stream is out of step after `status` (`moved` bytes of the frame had
  // gone through), and returns `status` saying so.
  static absl::Status Break(Link& link, const absl::Status& status, size_t moved) {
    link.fd.Reset();
    std::string why(status.message());
    if (moved > 0) absl::StrAppend(&why, " (after ", moved, " bytes of a frame)");
    link.broken = absl::StrCat(absl::StatusCodeToString(status.code()), ": ", why);
    return absl::Status(status.code(), absl::StrCat(why, "; the link is closed"));
  }

  absl::Status Send(Link& link, const StageMessage& m, absl::Time deadline,
                    absl::string_view what) {
    RETURN_IF_ERROR(Usable(link, what));
    // Checked before encoding, so that an oversized message is not copied first.
    const uint64_t size = EncodedSize(m);
    if (size > max_frame_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the message is ", size, " bytes (", m.values.size(), " values, ",
          m.errors.size(), " errors), over the frame limit of ", max_frame_bytes_,
          " bytes (StageChannelOptions::max_frame_bytes)"));
    }
    absl::StatusOr<std::string> payload = EncodeStageMessage(m);
    if (!payload.ok()) {
      return absl::Status(payload.status().code(),
                          absl::StrCat(what, ": ", payload.status().message()));
    }
    std::string frame;
    frame.reserve(kFrameHeaderBytes + payload->size());
    Put(frame, kFrameMagic, 4);
    Put(frame, payload->size(), 8);
    frame += *payload;
    size_t sent = 0;
    const absl::Status status = SendAll(link.fd.get(), frame, deadline, what, &sent);
    if (status.ok()) return status;
    if (absl::IsDeadlineExceeded(status) && sent == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat(status.message(), " (nothing sent; the link is intact)"));
    }
    return Break(link, status, sent);
  }

  absl::StatusOr<StageMessage> Receive(Link& link, absl::Time deadline, absl::string_view what) {
    RETURN_IF_ERROR(Usable(link, what));
    std::string header(kFrameHeaderBytes, '\0');
    size_t got = 0;
    absl::Status status =
        RecvAll(link.fd.get(), header.data(), header.size(), deadline, what, &got);
    if (!status.ok()) {
      if (absl::IsDeadlineExceeded(status) && got == 0) {
        return absl::DeadlineExceededError(
            absl::StrCat(status.message(), " (no frame begun; the link is intact)"));
      }
      return Break(link, status, got);
    }
    Reader r(header);
    uint64_t magic = 0, len = 0;
    r.Get(4, magic);
    r.Get(8, len);
    if (magic != kFrameMagic) {
      return Break(link,
                   absl::InvalidArgumentError(absl::StrCat(what, ": bad frame header (magic ",
                                                           absl::Hex(magic), ", length ", len,
                                                           ")")),
                   got);
    }
    if (len > max_frame_bytes_) {
      return Break(link,
                   absl::InvalidArgumentError(absl::StrCat(
                       what, ": the frame announces ", len, " bytes, over the limit of ",
                       max_frame_bytes_, " (StageChannelOptions::max_frame_bytes)")),
                   got);
    }
    // Grown as bytes arrive, never far ahead of them (see max_frame_bytes).
    std::string payload;
    while (payload.size() < len) {
      const size_t at = payload.size();
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(len - at, kReadChunkBytes));
      payload.resize(at + chunk);
      size_t chunk_got = 0;
      status = RecvAll(link.fd.get(), &payload[at], chunk, deadline, what, &chunk_got);
      got += chunk_got;
      if (!status.ok()) {
        return Break(link, absl::Status(status.code(),
                                        absl::StrCat(status.message(), " in a frame of ",
                                                     kFrameHeaderBytes + len, " bytes")),
                     got);
      }
    }
    absl::StatusOr<StageMessage> message = DecodeStageMessage(payload);
    if (!message.ok()) {
      // The stream is still in step, but a peer that encodes differently cannot be trusted
      // with the next frame either.
      return Break(link,
                   absl::Status(message.status().code(),
                                absl::StrCat(what, ": ", message.status().message())),
                   0);
    }
    return message;
  }

  const int stage_;
  const int num_stages_;
  const uint64_t max_frame_bytes_;
  Link prev_;
  Link next_;
};

}  // namespace

absl::StatusOr<std::string> EncodeStageMessage(const StageMessage& m) {
  std::string out;
  out.reserve(EncodedSize(m));
  Put(out, m.step, 8);
  Put(out, m.schedule, 8);
  Put(out, m.values.size(), 8);
  const size_t at = out.size();
  out.resize(at + m.values.size() * sizeof(float));
  // Host byte order: the stages run the same build on machines of one architecture.
  if (!m.values.empty()) std::memcpy(&out[at], m.values.data(), m.values.size() * sizeof(float));
  Put(out, m.errors.size(), 4);
  for (const StageError& e : m.errors) {
    // Truncating an id could make the stages disagree about which request failed.
    if (e.request_id.size() > kMaxStageRequestIdBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pipeline stage message: request id '", e.request_id.substr(0, 32), "...' is ",
          e.request_id.size(), " bytes, over the limit of ", kMaxStageRequestIdBytes));
    }
    if (e.code <= 0 || static_cast<uint64_t>(e.code) > kLastCode) {
      return absl::InvalidArgumentError(
          absl::StrCat("pipeline stage message: the error of request '", e.request_id,
                       "' has code ", e.code, ", not an error code (1..", kLastCode, ")"));
    }
    const size_t msg_len = std::min(e.message.size(), kMaxStageErrorMessageBytes);
    Put(out, e.request_id.size(), 4);
    out += e.request_id;
    Put(out, static_cast<uint32_t>(e.code), 4);
    Put(out, msg_len, 4);
    out.append(e.message, 0, msg_len);
  }
  return out;
}

absl::StatusOr<StageMessage> DecodeStageMessage(const std::string& payload) {
  StageMessage m;
  Reader r(payload);
  uint64_t count = 0;
  if (!r.Get(8, m.step) || !r.Get(8, m.schedule) || !r.Get(8, count)) {
    return absl::InvalidArgumentError("pipeline stage message: truncated header");
  }
  if (count > r.remaining() / sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline stage message: ", count,
                                                   " values run past the end"));
  }
  m.values.resize(count);
  if (count > 0) std::memcpy(m.values.data(), r.here(), count * sizeof(float));
  r.Skip(count * sizeof(float));
  uint64_t errors = 0;
  if (!r.Get(4, errors)) return absl::InvalidArgumentError("pipeline stage message: truncated");
  for (uint64_t i = 0; i < errors; ++i) {
    StageError e;
    uint64_t id_len = 0, code = 0, msg_len = 0;
    if (!r.Get(4, id_len) || id_len > kMaxStageRequestIdBytes || !r.Bytes(id_len, e.request_id) ||
        !r.Get(4, code) || !r.Get(4, msg_len) || msg_len > kMaxStageErrorMessageBytes ||
        !r.Bytes(msg_len, e.message)) {
      return absl::InvalidArgumentError(
          absl::StrCat("pipeline stage message: error ", i, " is truncated or out of bounds"));
    }
    if (code == 0 || code > kLastCode) {
      return absl::InvalidArgumentError(
          absl::StrCat("pipeline stage message: error ", i, " (request '", e.request_id,
                       "') has code ", code, ", not an error code (1..", kLastCode, ")"));
    }
    e.code = static_cast<int32_t>(code);
    m.errors.push_back(std::move(e));
  }
  if (r.remaining() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline stage message: ", r.remaining(),
                                                   " trailing bytes"));
  }
  return m;
}

std::string DialableAddress(const std::string& address) {
  if (address.rfind("0.0.0.0:", 0) != 0) return address;
  const std::string port = address.substr(8);
  struct ifaddrs* ifs = nullptr;
  std::string ip = "127.0.0.1";
  if (getifaddrs(&ifs) == 0) {
    for (struct ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
      char buf[INET_ADDRSTRLEN];
      const auto* sin = reinterpret_cast<const struct sockaddr_in*>(i->ifa_addr);
      if (inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf)) == nullptr) continue;
      if (std::string(buf).rfind("127.", 0) == 0) continue;
      ip = buf;
      break;
    }
    freeifaddrs(ifs);
  }
  return ip + ":" + port;
}

absl::StatusOr<std::unique_ptr<StageChannel>> ConnectStages(const StageChannelOptions& o) {
  if (o.num_stages < 1 || o.stage < 0 || o.stage >= o.num_stages) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline stage ", o.stage, " of ", o.num_stages, " does not exist"));
  }
  if (o.num_stages > 1 && o.rendezvous.empty()) {
    return absl::InvalidArgumentError("pipeline stages need a rendezvous path");
  }
  if (o.group_key.size() > kMaxStageGroupKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline stage group key of ",
                                                   o.group_key.size(), " bytes, more than ",
                                                   kMaxStageGroupKeyBytes));
  }
  if (o.max_frame_bytes < kMinPayload) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline stage frames of at most ",
                                                   o.max_frame_bytes, " bytes cannot hold a ",
                                                   kMinPayload, "-byte empty message"));
  }
  const absl::Time deadline = absl::Now() + o.timeout;
  Fd listener, prev, next;
  const std::string published_path = absl::StrCat(o.rendezvous, ".pp", o.stage);
  std::string published;
  if (o.stage > 0) {
    int port = 0;
    ASSIGN_OR_RETURN(listener, Listen(o.listen_host, port));
    published = DialableAddress(absl::StrCat(o.listen_host, ":", port));
    RETURN_IF_ERROR(Publish(published_path, published));
  }
  if (o.stage + 1 < o.num_stages) {
    ASSIGN_OR_RETURN(next, ConnectNext(absl::StrCat(o.rendezvous, ".pp", o.stage + 1), deadline));
    NoDelay(next.get());
    size_t sent = 0;
    RETURN_IF_ERROR(SendAll(next.get(), EncodeHello(o.stage, o.num_stages, o.group_key),
                            deadline, "pipeline stage hello", &sent));
    RETURN_IF_ERROR(ExpectHello(next.get(), o.stage + 1, o.num_stages, o.group_key, deadline));
  }
  if (o.stage > 0) {
    RETURN_IF_ERROR(WaitFor(listener.get(), POLLIN, deadline,
                            "waiting for the previous pipeline stage"));
    prev = Fd(accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!prev.valid()) return Errno("accepting the previous pipeline stage");
    NoDelay(prev.get());
    RETURN_IF_ERROR(ExpectHello(prev.get(), o.stage - 1, o.num_stages, o.group_key, deadline));
    size_t sent = 0;
    RETURN_IF_ERROR(SendAll(prev.get(), EncodeHello(o.stage, o.num_stages, o.group_key),
                            deadline, "pipeline stage hello", &sent));
    Unpublish(published_path, published);
  }
  return std::unique_ptr<StageChannel>(
      new TcpStageChannel(o.stage, o.num_stages, o.max_frame_bytes, std::move(prev),
                          std::move(next)));
}

}  // namespace kvstream
