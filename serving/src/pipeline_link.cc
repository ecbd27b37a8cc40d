// Pipeline stages joined over TCP (pipeline_link.h). Bytes are encoded with ByteWriter and
// decoded with ByteReader (kvstream/common/byte_io.h); the sockets are kvstream's socket
// helper's (kvstream/transfer/socket.h), which also turns their errno values into Status.
#include "kvstream/serving/pipeline_link.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "kvstream/common/byte_io.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/transfer/socket.h"

namespace kvstream {
namespace {

constexpr uint32_t kFrameMagic = 0x4650564B;  // "KVPF"
constexpr uint32_t kHelloMagic = 0x4850564B;  // "KVPH"
constexpr uint32_t kVersion = 2;  // 2: the hello carries the group key
// Hello: magic, version, stage, number of stages, group key length (u32 each), then the key.
constexpr size_t kHelloFixedBytes = 20;
constexpr size_t kFrameHeaderBytes = 12;  // magic (u32), payload length (u64)
// step, schedule, value count, error count: the payload of an empty message.
constexpr uint64_t kMinPayload = 8 + 8 + 8 + 4;
// An error on the wire: request id length, code, message length (u32 each), then the bytes.
constexpr size_t kMinErrorBytes = 12;
// Receive grows its payload buffer by at most this much ahead of the bytes that arrived.
constexpr size_t kReadChunkBytes = size_t{4} << 20;
constexpr uint64_t kLastCode = static_cast<uint64_t>(absl::StatusCode::kUnauthenticated);
// Only the previous stage connects to a stage's listener.
constexpr int kListenBacklog = 4;
// How often a stage looks again for the next stage's rendezvous file or listener.
constexpr absl::Duration kConnectRetry = absl::Milliseconds(20);

// Values travel as little-endian IEEE-754 binary32, 4 bytes each. On the hosts kvstream
// builds for, that is exactly how a float sits in memory, so the values are copied as one
// block rather than encoded one by one (logits of a step reach hundreds of MiB).
static_assert(sizeof(float) == 4, "floats travel as 4 bytes");
static_assert(std::numeric_limits<float>::is_iec559, "floats travel as IEEE-754 binary32");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "float values are copied as little-endian bytes");

// `status` with "<what>: " in front of its message.
absl::Status Annotate(const absl::Status& status, absl::string_view what) {
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
}

// True when `status` is the caller's own deadline passing (not, say, a TCP timeout
// reported by the kernel as ETIMEDOUT, which leaves the connection dead).
bool DeadlinePassed(const absl::Status& status, absl::Time deadline) {
  return absl::IsDeadlineExceeded(status) && absl::Now() >= deadline;
}

absl::StatusOr<std::string> EncodeHello(int stage, int num_stages, const std::string& group_key) {
  std::string out;
  ByteWriter w(&out);
  w.U32(kHelloMagic);
  w.U32(kVersion);
  w.U32(static_cast<uint32_t>(stage));
  w.U32(static_cast<uint32_t>(num_stages));
  RETURN_IF_ERROR(w.Bytes("pipeline stage group key", group_key, kMaxStageGroupKeyBytes));
  return out;
}

// Receives the hello of `peer` on `fd` and checks it is `want_stage` of `num_stages` with
// the same group key.
absl::Status ExpectHello(int fd, const std::string& peer, int want_stage, int num_stages,
                         const std::string& group_key, absl::Time deadline) {
  std::string fixed(kHelloFixedBytes, '\0');
  absl::Status received = RecvAll(fd, fixed.data(), fixed.size(), deadline, peer);
  if (!received.ok()) return Annotate(received, "pipeline stage hello");
  ByteReader r(fixed);
  uint32_t magic = 0, version = 0, stage = 0, stages = 0, key_bytes = 0;
  RETURN_IF_ERROR(r.U32("hello magic", &magic));
  RETURN_IF_ERROR(r.U32("hello version", &version));
  RETURN_IF_ERROR(r.U32("hello stage", &stage));
  RETURN_IF_ERROR(r.U32("hello stage count", &stages));
  RETURN_IF_ERROR(r.U32("hello group key length", &key_bytes));
  if (magic != kHelloMagic || version != kVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pipeline stage hello: ", peer, " is not a kvstream stage (or another version)"));
  }
  if (static_cast<int64_t>(stage) != want_stage || static_cast<int64_t>(stages) != num_stages) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pipeline stage hello: expected stage ", want_stage, " of ", num_stages, ", got stage ",
        stage, " of ", stages, " (do the decode ranks agree on the pipeline size?)"));
  }
  if (key_bytes > kMaxStageGroupKeyBytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("pipeline stage hello: stage ", stage, " announces a group key of ",
                     key_bytes, " bytes, more than ", kMaxStageGroupKeyBytes));
  }
  std::string key(key_bytes, '\0');
  received = RecvAll(fd, key.data(), key.size(), deadline, peer);
  if (!received.ok()) return Annotate(received, "pipeline stage hello");
  if (key != group_key) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pipeline stage hello: stage ", stage, " belongs to group '", absl::CHexEscape(key),
        "', this stage to '", absl::CHexEscape(group_key),
        "' (stages of another job or model on the same rendezvous path?)"));
  }
  return absl::OkStatus();
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

// A connected neighbour and how messages name it.
struct Neighbour {
  ScopedFd fd;
  std::string peer;
};

// Reads the address of stage `stage` from its rendezvous file at `path` and connects,
// retrying until the deadline while the file is missing or nobody listens at the address
// yet (the file may be a stale one that its stage has not overwritten yet).
absl::StatusOr<Neighbour> ConnectNext(const std::string& path, int stage, absl::Time deadline) {
  absl::Status last = absl::NotFoundError(absl::StrCat("no rendezvous file ", path));
  while (absl::Now() < deadline) {
    std::ifstream f(path);
    std::string line;
    if (!f || !std::getline(f, line) || line.empty()) {
      absl::SleepFor(kConnectRetry);
      continue;
    }
    const size_t colon = line.rfind(':');
    uint32_t port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(line.substr(colon + 1), &port) ||
        port == 0 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat(path, " holds '", line, "', not host:port"));
    }
    absl::StatusOr<ScopedFd> fd =
        ConnectTcp(line.substr(0, colon), static_cast<uint16_t>(port), deadline);
    if (fd.ok()) {
      return Neighbour{std::move(*fd), absl::StrCat("pipeline stage ", stage, " at ", line)};
    }
    // Refused or unreachable: the stage is not listening yet. Anything else (a bad host,
    // the deadline, no descriptors left) will not change by retrying.
    if (!absl::IsUnavailable(fd.status())) {
      return Annotate(fd.status(), absl::StrCat("connecting to the next pipeline stage (", path,
                                                ")"));
    }
    last = fd.status();
    absl::SleepFor(kConnectRetry);
  }
  return absl::DeadlineExceededError(absl::StrCat("the next pipeline stage did not show up in ",
                                                  path, " in time: ", last.message()));
}

// Bytes of the payload EncodeStageMessage produces for `m` (when it succeeds).
uint64_t EncodedSize(const StageMessage& m) {
  uint64_t size = kMinPayload + uint64_t{m.values.size()} * sizeof(float);
  for (const StageError& e : m.errors) {
    size += kMinErrorBytes + e.request_id.size() +
            std::min(e.message.size(), kMaxStageErrorMessageBytes);
  }
  return size;
}

// One neighbour: the socket to it, how messages name it and, once a failure has left the
// stream out of step, why.
struct Link {
  ScopedFd fd;
  std::string peer;
  std::string broken;  // empty while the link is usable
};

class TcpStageChannel final : public StageChannel {
 public:
  TcpStageChannel(int stage, int num_stages, uint64_t max_frame_bytes, Neighbour prev,
                  Neighbour next)
      : stage_(stage), num_stages_(num_stages), max_frame_bytes_(max_frame_bytes) {
    prev_.fd = std::move(prev.fd);
    prev_.peer = std::move(prev.peer);
    next_.fd = std::move(next.fd);
    next_.peer = std::move(next.peer);
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
    if (!payload.ok()) return Annotate(payload.status(), what);
    // A deadline already passed sends nothing (SendAll would still try once).
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": the deadline had passed before the frame was sent (nothing sent; the link "
                "is intact)"));
    }
    std::string frame;
    frame.reserve(kFrameHeaderBytes + payload->size());
    ByteWriter w(&frame);
    w.U32(kFrameMagic);
    w.U64(payload->size());
    w.Raw(*payload);
    size_t sent = 0;
    const absl::Status status = SendAll(link.fd.get(), frame, deadline, link.peer, &sent);
    if (status.ok()) return status;
    if (sent == 0 && DeadlinePassed(status, deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat(status.message(), " (nothing sent; the link is intact)"));
    }
    return Break(link, status, sent);
  }

  absl::StatusOr<StageMessage> Receive(Link& link, absl::Time deadline, absl::string_view what) {
    RETURN_IF_ERROR(Usable(link, what));
    // A deadline already passed reads nothing, even when a frame is waiting (as Send).
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": the deadline had passed before a frame was read (no frame begun; the link "
                "is intact)"));
    }
    std::string header(kFrameHeaderBytes, '\0');
    size_t got = 0;
    absl::Status status =
        RecvAll(link.fd.get(), header.data(), header.size(), deadline, link.peer, &got);
    if (!status.ok()) {
      if (got == 0 && DeadlinePassed(status, deadline)) {
        return absl::DeadlineExceededError(
            absl::StrCat(status.message(), " (no frame begun; the link is intact)"));
      }
      return Break(link, status, got);
    }
    ByteReader r(header);
    uint32_t magic = 0;
    uint64_t len = 0;
    RETURN_IF_ERROR(r.U32("frame magic", &magic));
    RETURN_IF_ERROR(r.U64("frame length", &len));
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
      status = RecvAll(link.fd.get(), &payload[at], chunk, deadline, link.peer, &chunk_got);
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
      return Break(link, Annotate(message.status(), what), 0);
    }
    return message;
  }

  const int stage_;
  const int num_stages_;
  const uint64_t max_frame_bytes_;
  Link prev_;
  Link next_;
};

// One error of a payload, read where `r` stands.
absl::Status DecodeStageError(ByteReader& r, StageError* e) {
  uint32_t code = 0;
  RETURN_IF_ERROR(r.Bytes("request id", kMaxStageRequestIdBytes, &e->request_id));
  RETURN_IF_ERROR(r.U32("error code", &code));
  if (code == 0 || code > kLastCode) {
    return absl::InvalidArgumentError(absl::StrCat("request '", absl::CHexEscape(e->request_id),
                                                   "' has code ", code,
                                                   ", not an error code (1..", kLastCode, ")"));
  }
  e->code = static_cast<int32_t>(code);
  return r.Bytes("error message", kMaxStageErrorMessageBytes, &e->message);
}

absl::StatusOr<StageMessage> DecodePayload(absl::string_view payload) {
  StageMessage m;
  ByteReader head(payload);
  uint64_t count = 0;
  RETURN_IF_ERROR(head.U64("step", &m.step));
  RETURN_IF_ERROR(head.U64("schedule", &m.schedule));
  RETURN_IF_ERROR(head.U64("value count", &count));
  if (count > head.remaining() / sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat(count, " values run past the end (",
                                                   head.remaining(), " bytes left)"));
  }
  // The values are copied straight from the payload (see the static_asserts above); a
  // second reader takes over after them.
  const size_t values_at = head.position();
  const size_t values_bytes = static_cast<size_t>(count) * sizeof(float);
  m.values.resize(static_cast<size_t>(count));
  if (count > 0) std::memcpy(m.values.data(), payload.data() + values_at, values_bytes);
  ByteReader r(payload.substr(values_at + values_bytes));
  uint32_t errors = 0;
  RETURN_IF_ERROR(
      r.Count("error", std::numeric_limits<uint32_t>::max(), kMinErrorBytes, &errors));
  m.errors.resize(errors);
  for (uint32_t i = 0; i < errors; ++i) {
    const absl::Status status = DecodeStageError(r, &m.errors[i]);
    if (!status.ok()) return Annotate(status, absl::StrCat("error ", i));
  }
  RETURN_IF_ERROR(r.ExpectEnd("stage message"));
  return m;
}

}  // namespace

absl::StatusOr<std::string> EncodeStageMessage(const StageMessage& m) {
  // Everything is checked before anything is written.
  if (m.errors.size() > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline stage message: ", m.errors.size(),
                                                   " errors, more than a u32 counts"));
  }
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
  }
  std::string out;
  out.reserve(EncodedSize(m));
  ByteWriter w(&out);
  w.U64(m.step);
  w.U64(m.schedule);
  w.U64(m.values.size());
  w.Raw(absl::string_view(reinterpret_cast<const char*>(m.values.data()),
                          m.values.size() * sizeof(float)));
  w.U32(static_cast<uint32_t>(m.errors.size()));
  for (const StageError& e : m.errors) {
    RETURN_IF_ERROR(w.Bytes("pipeline stage request id", e.request_id, kMaxStageRequestIdBytes));
    w.U32(static_cast<uint32_t>(e.code));
    RETURN_IF_ERROR(w.Bytes("pipeline stage error message",
                            absl::string_view(e.message).substr(0, kMaxStageErrorMessageBytes),
                            kMaxStageErrorMessageBytes));
  }
  return out;
}

absl::StatusOr<StageMessage> DecodeStageMessage(const std::string& payload) {
  absl::StatusOr<StageMessage> m = DecodePayload(payload);
  if (!m.ok()) return Annotate(m.status(), "pipeline stage message");
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
  ASSIGN_OR_RETURN(const std::string hello, EncodeHello(o.stage, o.num_stages, o.group_key));
  ScopedFd listener;
  Neighbour prev, next;
  const std::string published_path = absl::StrCat(o.rendezvous, ".pp", o.stage);
  std::string published;
  if (o.stage > 0) {
    absl::StatusOr<ScopedFd> listening = ListenTcp(o.listen_host, 0, kListenBacklog);
    if (!listening.ok()) {
      return Annotate(listening.status(),
                      absl::StrCat("pipeline stage ", o.stage, " listening on ", o.listen_host));
    }
    listener = std::move(*listening);
    ASSIGN_OR_RETURN(const uint16_t port, BoundTcpPort(listener.get()));
    published = DialableAddress(absl::StrCat(o.listen_host, ":", port));
    RETURN_IF_ERROR(Publish(published_path, published));
  }
  if (o.stage + 1 < o.num_stages) {
    ASSIGN_OR_RETURN(next,
                     ConnectNext(absl::StrCat(o.rendezvous, ".pp", o.stage + 1), o.stage + 1,
                                 deadline));
    const absl::Status sent = SendAll(next.fd.get(), hello, deadline, next.peer);
    if (!sent.ok()) return Annotate(sent, "pipeline stage hello");
    RETURN_IF_ERROR(
        ExpectHello(next.fd.get(), next.peer, o.stage + 1, o.num_stages, o.group_key, deadline));
  }
  if (o.stage > 0) {
    ASSIGN_OR_RETURN(AcceptedSocket accepted,
                     AcceptSocket(listener.get(), deadline,
                                  absl::StrCat("pipeline stage ", o.stage, "'s listener at ",
                                               published, " (waiting for stage ", o.stage - 1,
                                               ")")));
    prev.fd = std::move(accepted.fd);
    prev.peer = absl::StrCat("pipeline stage ", o.stage - 1, " at ", accepted.peer);
    RETURN_IF_ERROR(
        ExpectHello(prev.fd.get(), prev.peer, o.stage - 1, o.num_stages, o.group_key, deadline));
    const absl::Status sent = SendAll(prev.fd.get(), hello, deadline, prev.peer);
    if (!sent.ok()) return Annotate(sent, "pipeline stage hello");
    Unpublish(published_path, published);
  }
  return std::unique_ptr<StageChannel>(new TcpStageChannel(
      o.stage, o.num_stages, o.max_frame_bytes, std::move(prev), std::move(next)));
}

}  // namespace kvstream
