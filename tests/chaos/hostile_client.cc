// Hostile connections to a producer's control port (hostile_client.h).
#include "tests/chaos/hostile_client.h"

#include <poll.h>

#include <algorithm>
#include <string>

#include "absl/time/clock.h"
#include "connector/src/control_messages.h"
#include "kvstream/common/byte_io.h"
#include "kvstream/transfer/socket.h"
#include "kvstream/transfer/wire.h"

namespace kvstream {
namespace chaos {
namespace {

constexpr char kPeer[] = "chaos producer";

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xff);
  return s;
}

// A well-formed Hello frame claiming to be `engine_id`, with a connector hello whose
// compatibility hash and transport info are noise.
std::string HelloFrame(std::mt19937_64& rng, const std::string& engine_id) {
  internal::ConnectorHello hello;
  hello.protocol_version = static_cast<uint32_t>(rng() % 4);
  hello.compat_hash = rng();
  hello.compat_description = "chaos";
  hello.transport = "ucx";
  hello.transport_info = RandomBytes(rng, 1 + rng() % 64);
  hello.regions.push_back({0, 0, RandomBytes(rng, 1 + rng() % 64)});
  auto payload = internal::EncodeConnectorHello(hello);
  HelloMsg msg;
  msg.engine_id = engine_id;
  msg.payload = payload.ok() ? *payload : "";
  auto frame = EncodeFrame(msg);
  return frame.ok() ? *frame : RandomBytes(rng, 64);
}

// A hand-off frame of `request_id`, as a consumer would send it after its handshake.
std::string HandOffFrame(std::mt19937_64& rng, const std::string& request_id) {
  internal::HandOffMsg h;
  h.request_id = request_id;
  for (int i = 0; i < 20; ++i) h.prompt_token_ids.push_back(static_cast<int32_t>(rng() % 256));
  h.dest_block_ids = {0, 1};
  h.num_tokens = 19;
  h.attempt = rng();
  auto payload = internal::EncodeConnectorMessage(h);
  DataMsg data;
  data.payload = payload.ok() ? *payload : "";
  auto frame = EncodeFrame(data);
  return frame.ok() ? *frame : RandomBytes(rng, 64);
}

std::string Header(uint16_t version, uint16_t type, uint32_t payload_len) {
  std::string out;
  ByteWriter w(&out);
  w.U32(kWireMagic);
  w.U16(version);
  w.U16(type);
  w.U32(payload_len);
  return out;
}

// Reads and drops what the producer sends within `wait` (its challenge, its error).
void Drain(int fd, absl::Duration wait) {
  const absl::Time deadline = absl::Now() + wait;
  char buffer[4096];
  while (absl::Now() < deadline) {
    auto readable = WaitFd(fd, POLLIN, deadline, "chaos drain");
    if (!readable.ok() || !*readable) return;
    auto n = RecvSome(fd, buffer, sizeof(buffer), kPeer);
    if (!n.ok() || *n == 0) return;
  }
}

bool Send(int fd, const std::string& bytes) {
  return SendAll(fd, bytes, absl::Now() + absl::Seconds(1), kPeer).ok();
}

}  // namespace

const char* HostileKindName(HostileKind kind) {
  switch (kind) {
    case HostileKind::kRandomBytes: return "random_bytes";
    case HostileKind::kTruncatedFrame: return "truncated_frame";
    case HostileKind::kWrongVersion: return "wrong_version";
    case HostileKind::kHugeLength: return "huge_length";
    case HostileKind::kReplayedHello: return "replayed_hello";
    case HostileKind::kSilent: return "silent";
  }
  return "?";
}

int PlayHostileConnection(std::mt19937_64& rng, const HostileTarget& target, HostileKind kind) {
  const uint16_t port = static_cast<uint16_t>(target.port);
  auto fd = ConnectTcp("127.0.0.1", port, absl::Now() + absl::Seconds(1));
  if (!fd.ok()) return 0;
  const int s = fd->get();
  int frames = 0;
  switch (kind) {
    case HostileKind::kRandomBytes: {
      std::string noise = RandomBytes(rng, 1 + rng() % 2048);
      if (rng() % 2 == 0) noise = Header(kWireVersion, static_cast<uint16_t>(rng() % 8),
                                         static_cast<uint32_t>(noise.size())) + noise;
      frames += Send(s, noise) ? 1 : 0;
      break;
    }
    case HostileKind::kTruncatedFrame: {
      const std::string frame = HelloFrame(rng, target.victim_engine_id);
      frames += Send(s, frame.substr(0, rng() % frame.size())) ? 1 : 0;
      break;
    }
    case HostileKind::kWrongVersion: {
      std::string frame = HelloFrame(rng, target.victim_engine_id);
      uint16_t version = static_cast<uint16_t>(rng() & 0xffff);
      if (version == kWireVersion) version = kWireVersion - 1;
      frame[4] = static_cast<char>(version & 0xff);
      frame[5] = static_cast<char>(version >> 8);
      frames += Send(s, frame) ? 1 : 0;
      break;
    }
    case HostileKind::kHugeLength: {
      const uint32_t len = rng() % 2 == 0
                               ? kMaxPayloadBytes + 1 + static_cast<uint32_t>(rng() % 1000)
                               : (1u << 20) + static_cast<uint32_t>(rng() % 1000);
      frames += Send(s, Header(kWireVersion, static_cast<uint16_t>(MessageType::kHello), len) +
                            RandomBytes(rng, rng() % 512))
                    ? 1
                    : 0;
      break;
    }
    case HostileKind::kReplayedHello: {
      const std::string hello = HelloFrame(rng, target.victim_engine_id);
      const std::string hand_off = HandOffFrame(rng, target.victim_request_id);
      Drain(s, absl::Milliseconds(50));  // the challenge
      for (const std::string* f : {&hello, &hello, &hand_off}) frames += Send(s, *f) ? 1 : 0;
      Drain(s, absl::Milliseconds(50));
      auto again = ConnectTcp("127.0.0.1", port, absl::Now() + absl::Seconds(1));
      if (again.ok()) {
        for (const std::string* f : {&hello, &hand_off}) frames += Send(again->get(), *f) ? 1 : 0;
        Drain(again->get(), absl::Milliseconds(50));
      }
      break;
    }
    case HostileKind::kSilent:
      Drain(s, absl::Milliseconds(static_cast<int64_t>(rng() % 300)));
      break;
  }
  if (kind != HostileKind::kSilent && rng() % 2 == 0) Drain(s, absl::Milliseconds(20));
  return frames;
}

}  // namespace chaos
}  // namespace kvstream
