// Tests of the TCP control channel and the handshake over real sockets on 127.0.0.1: frames
// across a connection, deadlines, peer close, hostile peers (garbage, huge announced
// lengths, stalls), concurrency, and the handshake's authentication and compatibility
// outcomes on both sides. No test asserts on timing; deadlines only bound how long a broken
// implementation could hang.
#include "kvstream/transfer/control_channel.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstream/transfer/wire.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// Generous: only reached when something is broken.
absl::Time Later() { return absl::Now() + absl::Seconds(20); }
// For waits that are expected to expire.
absl::Time Shortly() { return absl::Now() + absl::Milliseconds(200); }

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

struct Pair {
  std::unique_ptr<ControlListener> listener;
  std::unique_ptr<ControlConnection> client;
  std::unique_ptr<ControlConnection> server;
};

Pair Connect() {
  Pair pair;
  auto listener = ControlListener::Listen("127.0.0.1", 0);
  EXPECT_TRUE(listener.ok()) << listener.status();
  if (!listener.ok()) return pair;
  pair.listener = std::move(*listener);
  auto client = ConnectControl("127.0.0.1", pair.listener->port(), Later());
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return pair;
  pair.client = std::move(*client);
  auto server = pair.listener->Accept(Later());
  EXPECT_TRUE(server.ok()) << server.status();
  if (server.ok()) pair.server = std::move(*server);
  return pair;
}

ErrorMsg Error(int32_t code, std::string message) {
  ErrorMsg m;
  m.status_code = code;
  m.message = std::move(message);
  return m;
}

// A peer that speaks raw bytes, for the hostile-peer tests. Blocking, with a receive
// timeout so that a broken implementation fails the test instead of hanging it.
class RawPeer {
 public:
  explicit RawPeer(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    timeval tv;
    tv.tv_sec = 20;
    tv.tv_usec = 0;
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    sockaddr_in addr;
    std::memset(&addr, 0, sizeof(addr));
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawPeer() { ::close(fd_); }
  RawPeer(const RawPeer&) = delete;
  RawPeer& operator=(const RawPeer&) = delete;

  bool connected() const { return connected_; }
  void Write(absl::string_view bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      ASSERT_GT(n, 0) << std::strerror(errno);
      done += static_cast<size_t>(n);
    }
  }
  // True when the other side closed: end of stream or reset (anything it sent first is
  // skipped). False on timeout.
  bool SeesClose() {
    char buf[4096];
    for (;;) {
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n > 0) continue;
      if (n == 0) return true;
      if (errno == EINTR) continue;
      return errno == ECONNRESET;
    }
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

std::string HeaderBytes(uint16_t type, uint32_t payload_len) {
  std::string h(kFrameHeaderBytes, '\0');
  const uint32_t magic = kWireMagic;
  const uint16_t version = kWireVersion;
  for (int i = 0; i < 4; ++i) h[i] = static_cast<char>((magic >> (8 * i)) & 0xff);
  for (int i = 0; i < 2; ++i) h[4 + i] = static_cast<char>((version >> (8 * i)) & 0xff);
  for (int i = 0; i < 2; ++i) h[6 + i] = static_cast<char>((type >> (8 * i)) & 0xff);
  for (int i = 0; i < 4; ++i) h[8 + i] = static_cast<char>((payload_len >> (8 * i)) & 0xff);
  return h;
}

// ---- Listener and connect ----

TEST(ControlListenerTest, RejectsHostsThatAreNotIpv4OrLocalhost) {
  for (const char* host : {"", "not-a-host", "256.1.1.1", "::1", "127.0.0.1:80"}) {
    SCOPED_TRACE(host);
    auto listener = ControlListener::Listen(host, 0);
    ASSERT_FALSE(listener.ok());
    EXPECT_EQ(listener.status().code(), absl::StatusCode::kInvalidArgument);
    auto conn = ConnectControl(host, 1234, Later());
    ASSERT_FALSE(conn.ok());
    EXPECT_EQ(conn.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(ControlListenerTest, BusyPortIsUnavailableAndNamesAddressAndErrno) {
  auto first = ControlListener::Listen("127.0.0.1", 0);
  ASSERT_TRUE(first.ok()) << first.status();
  const uint16_t port = (*first)->port();
  EXPECT_NE(port, 0);
  auto second = ControlListener::Listen("127.0.0.1", port);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(Msg(second.status()), HasSubstr(absl::StrCat("127.0.0.1:", port)));
  EXPECT_THAT(Msg(second.status()), HasSubstr("in use"));
}

TEST(ControlListenerTest, LocalhostAndAnyAddressWork) {
  auto local = ControlListener::Listen("localhost", 0);
  ASSERT_TRUE(local.ok()) << local.status();
  auto c1 = ConnectControl("localhost", (*local)->port(), Later());
  ASSERT_TRUE(c1.ok()) << c1.status();
  EXPECT_EQ((*c1)->peer_address(), absl::StrCat("127.0.0.1:", (*local)->port()));
  ASSERT_TRUE((*local)->Accept(Later()).ok());

  auto any = ControlListener::Listen("0.0.0.0", 0);
  ASSERT_TRUE(any.ok()) << any.status();
  auto c2 = ConnectControl("127.0.0.1", (*any)->port(), Later());
  ASSERT_TRUE(c2.ok()) << c2.status();
  auto s2 = (*any)->Accept(Later());
  ASSERT_TRUE(s2.ok()) << s2.status();
  EXPECT_THAT((*s2)->peer_address(), StartsWith("127.0.0.1:"));
}

TEST(ControlListenerTest, AcceptWithNobodyConnectingMeetsTheDeadline) {
  auto listener = ControlListener::Listen("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok()) << listener.status();
  auto conn = (*listener)->Accept(Shortly());
  ASSERT_FALSE(conn.ok());
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(ControlConnectTest, RefusedIsUnavailableWithErrnoText) {
  uint16_t port = 0;
  {
    auto listener = ControlListener::Listen("127.0.0.1", 0);
    ASSERT_TRUE(listener.ok()) << listener.status();
    port = (*listener)->port();
  }  // closed: nothing listens there now
  auto conn = ConnectControl("127.0.0.1", port, Later());
  ASSERT_FALSE(conn.ok());
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(Msg(conn.status()), HasSubstr("refused"));
  EXPECT_THAT(Msg(conn.status()), HasSubstr(absl::StrCat("127.0.0.1:", port)));
  EXPECT_EQ(ConnectControl("127.0.0.1", 0, Later()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- Frames across a connection ----

std::vector<ControlMessage> OneOfEach() {
  ChallengeMsg challenge;
  challenge.nonce.assign(32, '\x5a');
  HelloMsg hello;
  hello.engine_id = "prefill-0";
  hello.compat_hash = 42;
  RegionDescriptor region;
  region.layer = 7;
  region.tensor = 1;
  region.descriptor = std::string("\0\1\2", 3);
  hello.regions = {region};
  HelloAckMsg ack;
  ack.hello = hello;
  ack.status_code = 9;
  ack.message = "ack";
  RequestMsg request;
  request.request_id = "r1";
  request.prompt_token_ids = {1, 2, 3};
  request.dest_block_ids = {4};
  request.num_tokens = 2;
  RequestAckMsg request_ack;
  request_ack.request_id = "r1";
  AbortMsg abort;
  abort.request_id = "r1";
  abort.reason = "cancelled";
  return {challenge, hello, ack, request, request_ack, abort, Error(13, "boom")};
}

TEST(ControlConnectionTest, EveryMessageTypeCrossesInBothDirections) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  EXPECT_EQ(p.client->peer_address(), absl::StrCat("127.0.0.1:", p.listener->port()));
  EXPECT_THAT(p.server->peer_address(), StartsWith("127.0.0.1:"));
  for (const ControlMessage& m : OneOfEach()) {
    SCOPED_TRACE(std::string(MessageTypeName(TypeOf(m))));
    ASSERT_TRUE(p.client->Send(m, Later()).ok());
    auto got = p.server->Receive(Later());
    ASSERT_TRUE(got.ok()) << got.status();
    // Same type and, since encoding is canonical, the same bytes.
    EXPECT_EQ(*EncodeFrame(*got), *EncodeFrame(m));
    ASSERT_TRUE(p.server->Send(m, Later()).ok());
    got = p.client->Receive(Later());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*EncodeFrame(*got), *EncodeFrame(m));
  }
  RequestMsg big;
  big.request_id = "big";
  big.prompt_token_ids.assign(3u << 20, 11);  // 12 MiB: many reads and writes per frame
  // Sent while the other end receives: neither side buffers a whole 12 MiB frame.
  absl::Status sent;
  std::thread sender([&] { sent = p.client->Send(big, Later()); });
  auto got = p.server->Receive(Later());
  sender.join();
  ASSERT_TRUE(sent.ok()) << sent;
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::get<RequestMsg>(*got).prompt_token_ids, big.prompt_token_ids);
}

TEST(ControlConnectionTest, ReceiveDeadlineWithNothingSentKeepsTheConnection) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  auto none = p.server->Receive(Shortly());
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(p.server->closed());
  // An already-passed deadline still returns at once.
  EXPECT_EQ(p.server->Receive(absl::InfinitePast()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(p.client->Send(Error(1, "after"), Later()).ok());
  auto got = p.server->Receive(Later());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::get<ErrorMsg>(*got).message, "after");
}

TEST(ControlConnectionTest, PeerCloseIsUnavailableThenFailedPrecondition) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  ASSERT_TRUE(p.client->Send(Error(2, "last words"), Later()).ok());
  p.client.reset();
  // What was sent before the close still arrives.
  auto got = p.server->Receive(Later());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::get<ErrorMsg>(*got).message, "last words");
  auto gone = p.server->Receive(Later());
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable) << gone.status();
  EXPECT_THAT(Msg(gone.status()), HasSubstr(p.server->peer_address()));
  EXPECT_TRUE(p.server->closed());
  EXPECT_EQ(p.server->Receive(Later()).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.server->Send(Error(1, ""), Later()).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ControlConnectionTest, LocalCloseFailsLaterCallsAndTellsThePeer) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  EXPECT_FALSE(p.client->closed());
  p.client->Close();
  p.client->Close();  // idempotent
  EXPECT_TRUE(p.client->closed());
  EXPECT_EQ(p.client->Send(Error(1, ""), Later()).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.client->Receive(Later()).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.server->Receive(Later()).status().code(), absl::StatusCode::kUnavailable);
}

TEST(ControlConnectionTest, CloseWakesABlockedReceive) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  absl::Status result;
  std::thread receiver([&] { result = p.server->Receive(absl::InfiniteFuture()).status(); });
  p.server->Close();
  receiver.join();
  EXPECT_EQ(result.code(), absl::StatusCode::kFailedPrecondition) << result;
}

TEST(ControlConnectionTest, InvalidMessageIsRefusedBeforeSendingAndTheConnectionStays) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  absl::Status s = p.client->Send(Error(99, "bad code"), Later());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_FALSE(p.client->closed());
  ASSERT_TRUE(p.client->Send(Error(1, "good"), Later()).ok());
  auto got = p.server->Receive(Later());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::get<ErrorMsg>(*got).message, "good");
}

TEST(ControlConnectionTest, SendToAClosedPeerFailsWithoutSigpipe) {
  // With the default disposition, a SIGPIPE would kill the test binary.
  auto previous = std::signal(SIGPIPE, SIG_DFL);
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  p.server.reset();
  absl::Status s;
  // The first writes may land in the socket buffer before the reset comes back.
  const absl::Time give_up = Later();
  while (s.ok() && absl::Now() < give_up) s = p.client->Send(Error(1, "anyone?"), Later());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(p.client->closed());
  std::signal(SIGPIPE, previous);
}

TEST(ControlConnectionTest, SendDeadlineWhenThePeerNeverReadsClosesTheConnection) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  RequestMsg big;
  big.prompt_token_ids.assign(3u << 20, 1);  // 12 MiB per frame
  absl::Status s;
  // Several frames, in case the kernel's buffers take a whole one.
  for (int i = 0; i < 16 && s.ok(); ++i) s = p.client->Send(big, Shortly());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(p.client->closed());
}

// ---- Hostile peers ----

class HostilePeerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto listener = ControlListener::Listen("127.0.0.1", 0);
    ASSERT_TRUE(listener.ok()) << listener.status();
    listener_ = std::move(*listener);
    raw_ = std::make_unique<RawPeer>(listener_->port());
    ASSERT_TRUE(raw_->connected());
    auto conn = listener_->Accept(Later());
    ASSERT_TRUE(conn.ok()) << conn.status();
    conn_ = std::move(*conn);
  }

  // The connection failed with `code`, closed itself, refuses later calls, and the peer
  // saw it close.
  void ExpectFailedAndClosed(const absl::Status& status, absl::StatusCode code) {
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_THAT(Msg(status), HasSubstr(conn_->peer_address()));
    EXPECT_TRUE(conn_->closed());
    EXPECT_EQ(conn_->Receive(Later()).status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(raw_->SeesClose());
  }

  std::unique_ptr<ControlListener> listener_;
  std::unique_ptr<RawPeer> raw_;
  std::unique_ptr<ControlConnection> conn_;
};

TEST_F(HostilePeerTest, GarbageIsRejected) {
  raw_->Write("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  auto got = conn_->Receive(Later());
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(Msg(got.status()), HasSubstr("magic"));
  ExpectFailedAndClosed(got.status(), absl::StatusCode::kInvalidArgument);
}

TEST_F(HostilePeerTest, HeaderAnnouncingOneGibibyteIsRejected) {
  raw_->Write(HeaderBytes(static_cast<uint16_t>(MessageType::kHello), 1u << 30));
  auto got = conn_->Receive(Later());
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(Msg(got.status()), HasSubstr("payload_len"));
  ExpectFailedAndClosed(got.status(), absl::StatusCode::kInvalidArgument);
}

TEST_F(HostilePeerTest, UnknownTypeIsRejected) {
  raw_->Write(HeaderBytes(77, 0));
  auto got = conn_->Receive(Later());
  ASSERT_FALSE(got.ok());
  ExpectFailedAndClosed(got.status(), absl::StatusCode::kInvalidArgument);
}

TEST_F(HostilePeerTest, MalformedPayloadIsRejected) {
  // Error with status code 1000.
  raw_->Write(HeaderBytes(static_cast<uint16_t>(MessageType::kError), 8) +
              std::string("\xe8\x03\x00\x00\x00\x00\x00\x00", 8));
  auto got = conn_->Receive(Later());
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(Msg(got.status()), HasSubstr("status_code"));
  ExpectFailedAndClosed(got.status(), absl::StatusCode::kInvalidArgument);
}

TEST_F(HostilePeerTest, HalfAHeaderThenStallMeetsTheDeadlineAndCloses) {
  raw_->Write(HeaderBytes(static_cast<uint16_t>(MessageType::kError), 8).substr(0, 5));
  auto got = conn_->Receive(Shortly());
  ASSERT_FALSE(got.ok());
  ExpectFailedAndClosed(got.status(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(HostilePeerTest, HalfAFrameThenStallMeetsTheDeadlineAndCloses) {
  const std::string frame = *EncodeFrame(Error(3, "a message long enough to split"));
  raw_->Write(frame.substr(0, frame.size() / 2));
  auto got = conn_->Receive(Shortly());
  ASSERT_FALSE(got.ok());
  ExpectFailedAndClosed(got.status(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(HostilePeerTest, MaximalAnnouncedPayloadThenStallMeetsTheDeadline) {
  raw_->Write(HeaderBytes(static_cast<uint16_t>(MessageType::kRequest), kMaxPayloadBytes) + "abc");
  auto got = conn_->Receive(Shortly());
  ASSERT_FALSE(got.ok());
  ExpectFailedAndClosed(got.status(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(HostilePeerTest, ClosingInTheMiddleOfAFrameIsUnavailable) {
  const std::string frame = *EncodeFrame(Error(3, "cut short"));
  raw_->Write(frame.substr(0, frame.size() - 2));
  raw_.reset();
  auto got = conn_->Receive(Later());
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_TRUE(conn_->closed());
}

TEST_F(HostilePeerTest, AFrameTrickledByteByByteIsReceived) {
  const std::string frame = *EncodeFrame(Error(3, "slowly"));
  std::thread writer([&] {
    for (char c : frame) raw_->Write(absl::string_view(&c, 1));
  });
  auto got = conn_->Receive(Later());
  writer.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::get<ErrorMsg>(*got).message, "slowly");
}

// ---- Concurrency ----

TEST(ControlConnectionTest, ConcurrentSendAndReceiveOnBothEnds) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  constexpr int kMessages = 2000;
  // Each end sends on one thread while receiving on another.
  auto send_all = [](ControlConnection* conn, absl::string_view tag) {
    for (int i = 0; i < kMessages; ++i) {
      RequestMsg m;
      m.request_id = absl::StrCat(tag, i);
      m.prompt_token_ids.assign(static_cast<size_t>(i % 300), i);
      if (!conn->Send(m, Later()).ok()) return false;
    }
    return true;
  };
  auto receive_all = [](ControlConnection* conn, absl::string_view tag) {
    for (int i = 0; i < kMessages; ++i) {
      auto got = conn->Receive(Later());
      if (!got.ok()) return false;
      const auto* m = std::get_if<RequestMsg>(&*got);
      if (m == nullptr || m->request_id != absl::StrCat(tag, i) ||
          m->prompt_token_ids != std::vector<int32_t>(static_cast<size_t>(i % 300), i)) {
        return false;
      }
    }
    return true;
  };
  bool client_sent = false, server_sent = false, client_got = false, server_got = false;
  std::thread t1([&] { client_sent = send_all(p.client.get(), "c"); });
  std::thread t2([&] { server_sent = send_all(p.server.get(), "s"); });
  std::thread t3([&] { client_got = receive_all(p.client.get(), "s"); });
  std::thread t4([&] { server_got = receive_all(p.server.get(), "c"); });
  t1.join();
  t2.join();
  t3.join();
  t4.join();
  EXPECT_TRUE(client_sent);
  EXPECT_TRUE(server_sent);
  EXPECT_TRUE(client_got);
  EXPECT_TRUE(server_got);
}

TEST(ControlConnectionTest, ConcurrentSendersNeverInterleaveFrames) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 300;
  std::atomic<int> send_failures{0};
  std::vector<std::thread> senders;
  for (int t = 0; t < kThreads; ++t) {
    senders.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        RequestMsg m;
        m.request_id = absl::StrCat(t);
        // Large enough that one frame takes several send() calls.
        m.prompt_token_ids.assign(20000, i);
        if (!p.client->Send(m, Later()).ok()) ++send_failures;
      }
    });
  }
  std::vector<int> next(kThreads, 0);
  bool in_order = true;
  for (int n = 0; n < kThreads * kPerThread; ++n) {
    auto got = p.server->Receive(Later());
    ASSERT_TRUE(got.ok()) << got.status();
    const auto& m = std::get<RequestMsg>(*got);
    const int t = std::stoi(m.request_id);
    ASSERT_TRUE(t >= 0 && t < kThreads);
    in_order = in_order && m.prompt_token_ids == std::vector<int32_t>(20000, next[t]);
    ++next[t];
  }
  for (auto& s : senders) s.join();
  EXPECT_EQ(send_failures.load(), 0);
  EXPECT_TRUE(in_order);
}

// ---- Handshake ----

HelloMsg MakeHello(std::string engine, uint64_t hash, std::string description) {
  HelloMsg h;
  h.engine_id = std::move(engine);
  h.protocol_version = 1;
  h.compat_hash = hash;
  h.compat_description = std::move(description);
  h.transport = "ucx";
  h.transport_info = "ucx-address-bytes";
  RegionDescriptor k;
  k.layer = 0;
  k.tensor = 0;
  k.descriptor = "rkey-k0";
  RegionDescriptor v;
  v.layer = 0;
  v.tensor = 1;
  v.descriptor = "rkey-v0";
  h.regions = {k, v};
  return h;
}

HandshakeOptions Options(HelloMsg local, std::string secret = "") {
  HandshakeOptions o;
  o.local = std::move(local);
  o.secret = std::move(secret);
  o.deadline = Later();
  return o;
}

// The usual check: the compatibility hashes must agree.
std::function<absl::Status(const HelloMsg&)> SameHashAs(const HelloMsg& local) {
  const uint64_t hash = local.compat_hash;
  return [hash](const HelloMsg& peer) {
    if (peer.compat_hash == hash) return absl::OkStatus();
    return absl::FailedPreconditionError("incompatible KV cache layout");
  };
}

struct Outcome {
  absl::StatusOr<HelloMsg> client = absl::UnknownError("not run");
  absl::StatusOr<HelloMsg> server = absl::UnknownError("not run");
  Pair pair;
};

Outcome RunHandshake(const HandshakeOptions& client_options,
                     const HandshakeOptions& server_options) {
  Outcome out;
  out.pair = Connect();
  if (!out.pair.server || !out.pair.client) return out;
  std::thread server([&] { out.server = HandshakeAsServer(*out.pair.server, server_options); });
  out.client = HandshakeAsClient(*out.pair.client, client_options);
  server.join();
  return out;
}

void ExpectSameHello(const HelloMsg& sent, const HelloMsg& got) {
  EXPECT_EQ(got.engine_id, sent.engine_id);
  EXPECT_EQ(got.protocol_version, sent.protocol_version);
  EXPECT_EQ(got.compat_hash, sent.compat_hash);
  EXPECT_EQ(got.compat_description, sent.compat_description);
  EXPECT_EQ(got.transport, sent.transport);
  EXPECT_EQ(got.transport_info, sent.transport_info);
  ASSERT_EQ(got.regions.size(), sent.regions.size());
  for (size_t i = 0; i < got.regions.size(); ++i) {
    EXPECT_EQ(got.regions[i].layer, sent.regions[i].layer);
    EXPECT_EQ(got.regions[i].tensor, sent.regions[i].tensor);
    EXPECT_EQ(got.regions[i].descriptor, sent.regions[i].descriptor);
  }
}

TEST(HandshakeTest, SucceedsWithoutSecretAndChecksSeeThePeersFields) {
  const HelloMsg client_hello = MakeHello("decode-0", 7, "layout A");
  const HelloMsg server_hello = MakeHello("prefill-0", 7, "layout A");
  HelloMsg seen_by_client;
  HelloMsg seen_by_server;
  HandshakeOptions c = Options(client_hello);
  c.check = [&](const HelloMsg& peer) {
    seen_by_client = peer;
    return absl::OkStatus();
  };
  HandshakeOptions s = Options(server_hello);
  s.check = [&](const HelloMsg& peer) {
    seen_by_server = peer;
    return absl::OkStatus();
  };
  Outcome out = RunHandshake(c, s);
  ASSERT_TRUE(out.client.ok()) << out.client.status();
  ASSERT_TRUE(out.server.ok()) << out.server.status();
  ExpectSameHello(server_hello, *out.client);
  ExpectSameHello(client_hello, *out.server);
  ExpectSameHello(server_hello, seen_by_client);
  ExpectSameHello(client_hello, seen_by_server);
  // Fresh nonces both ways, no tags without a secret.
  EXPECT_EQ(out.client->nonce.size(), 32u);
  EXPECT_EQ(out.server->nonce.size(), 32u);
  EXPECT_NE(out.client->nonce, out.server->nonce);
  EXPECT_TRUE(out.client->auth_tag.empty());
  EXPECT_TRUE(out.server->auth_tag.empty());
  // The connection carries traffic afterwards.
  ASSERT_TRUE(out.pair.client->Send(Error(1, "after handshake"), Later()).ok());
  auto got = out.pair.server->Receive(Later());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_FALSE(out.pair.client->closed());
}

TEST(HandshakeTest, SucceedsWithTheSameSecretAndTagsAnswerTheNonces) {
  Outcome out = RunHandshake(Options(MakeHello("decode-0", 1, "d"), "s3cret"),
                             Options(MakeHello("prefill-0", 1, "d"), "s3cret"));
  ASSERT_TRUE(out.client.ok()) << out.client.status();
  ASSERT_TRUE(out.server.ok()) << out.server.status();
  // The server's hello carries its challenge nonce; the client's tag answers it, and the
  // server's tag answers the client's nonce.
  EXPECT_EQ(out.server->auth_tag, AuthTag("s3cret", out.client->nonce, "decode-0"));
  EXPECT_EQ(out.client->auth_tag, AuthTag("s3cret", out.server->nonce, "prefill-0"));
  EXPECT_EQ(out.client->auth_tag.size(), 32u);
}

void ExpectRejectedOnBothSides(const Outcome& out, absl::StatusCode code) {
  ASSERT_FALSE(out.client.ok());
  ASSERT_FALSE(out.server.ok());
  EXPECT_EQ(out.client.status().code(), code) << out.client.status();
  EXPECT_EQ(out.server.status().code(), code) << out.server.status();
  EXPECT_TRUE(out.pair.client->closed());
  EXPECT_TRUE(out.pair.server->closed());
}

TEST(HandshakeTest, WrongSecretIsPermissionDeniedOnBothSides) {
  Outcome out = RunHandshake(Options(MakeHello("decode-0", 1, "d"), "secret-a"),
                             Options(MakeHello("prefill-0", 1, "d"), "secret-b"));
  ExpectRejectedOnBothSides(out, absl::StatusCode::kPermissionDenied);
}

TEST(HandshakeTest, ClientWithoutTheSecretIsPermissionDeniedOnBothSides) {
  Outcome out = RunHandshake(Options(MakeHello("decode-0", 1, "d")),
                             Options(MakeHello("prefill-0", 1, "d"), "secret"));
  ExpectRejectedOnBothSides(out, absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(Msg(out.server.status()), HasSubstr("no auth tag"));
}

TEST(HandshakeTest, ServerWithoutTheSecretIsPermissionDeniedOnBothSides) {
  Outcome out = RunHandshake(Options(MakeHello("decode-0", 1, "d"), "secret"),
                             Options(MakeHello("prefill-0", 1, "d")));
  ExpectRejectedOnBothSides(out, absl::StatusCode::kPermissionDenied);
}

TEST(HandshakeTest, CompatibilityMismatchNamesBothDescriptionsOnBothSides) {
  const HelloMsg client_hello = MakeHello("decode-0", 1, "NHD bf16 block 16");
  const HelloMsg server_hello = MakeHello("prefill-0", 2, "HND fp8 block 32");
  HandshakeOptions c = Options(client_hello);
  c.check = SameHashAs(client_hello);
  HandshakeOptions s = Options(server_hello);
  s.check = SameHashAs(server_hello);
  Outcome out = RunHandshake(c, s);
  ExpectRejectedOnBothSides(out, absl::StatusCode::kFailedPrecondition);
  for (const absl::Status& status : {out.client.status(), out.server.status()}) {
    EXPECT_THAT(Msg(status), HasSubstr("NHD bf16 block 16"));
    EXPECT_THAT(Msg(status), HasSubstr("HND fp8 block 32"));
    EXPECT_THAT(Msg(status), HasSubstr("incompatible KV cache layout"));
  }
}

TEST(HandshakeTest, ACheckErrorQuotingBothDescriptionsIsNotRepeated) {
  const HelloMsg client_hello = MakeHello("decode-0", 1, "desc-of-client");
  const HelloMsg server_hello = MakeHello("prefill-0", 2, "desc-of-server");
  HandshakeOptions s = Options(server_hello);
  s.check = [](const HelloMsg& peer) {
    return absl::FailedPreconditionError(
        absl::StrCat("ours [desc-of-server] theirs [", peer.compat_description, "]"));
  };
  Outcome out = RunHandshake(Options(client_hello), s);
  ExpectRejectedOnBothSides(out, absl::StatusCode::kFailedPrecondition);
  for (const absl::Status& status : {out.client.status(), out.server.status()}) {
    const std::string m = Msg(status);
    EXPECT_THAT(m, HasSubstr("ours [desc-of-server] theirs [desc-of-client]"));
    EXPECT_EQ(m.find("desc-of-server"), m.rfind("desc-of-server")) << m;
  }
}

TEST(HandshakeTest, ClientOnlyRejectionReachesTheServerAsAnError) {
  // The server has accepted before the client runs its check; the refusal then arrives as
  // the first message after the handshake.
  const HelloMsg client_hello = MakeHello("decode-0", 1, "mine");
  HandshakeOptions c = Options(client_hello);
  c.check = SameHashAs(client_hello);
  Outcome out = RunHandshake(c, Options(MakeHello("prefill-0", 2, "theirs")));
  ASSERT_FALSE(out.client.ok());
  EXPECT_EQ(out.client.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(out.client.status()), HasSubstr("mine"));
  EXPECT_THAT(Msg(out.client.status()), HasSubstr("theirs"));
  ASSERT_TRUE(out.server.ok()) << out.server.status();
  auto next = out.pair.server->Receive(Later());
  ASSERT_TRUE(next.ok()) << next.status();
  const auto* error = std::get_if<ErrorMsg>(&*next);
  ASSERT_NE(error, nullptr);
  EXPECT_EQ(error->status_code, static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(error->message, HasSubstr("theirs"));
}

TEST(HandshakeTest, DeadlineWhenTheServerNeverSpeaks) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  HandshakeOptions c = Options(MakeHello("decode-0", 1, "d"));
  c.deadline = Shortly();
  auto result = HandshakeAsClient(*p.client, c);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(p.client->closed());
}

TEST(HandshakeTest, DeadlineWhenTheClientNeverAnswers) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  HandshakeOptions s = Options(MakeHello("prefill-0", 1, "d"), "secret");
  s.deadline = Shortly();
  auto result = HandshakeAsServer(*p.server, s);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(p.server->closed());
  // The challenge had gone out.
  auto challenge = p.client->Receive(Later());
  ASSERT_TRUE(challenge.ok()) << challenge.status();
  EXPECT_EQ(std::get<ChallengeMsg>(*challenge).nonce.size(), 32u);
}

// Hand-played peers, for what a well-behaved implementation never sends.

ChallengeMsg ExpectChallenge(ControlConnection& conn) {
  auto m = conn.Receive(Later());
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok() || !std::holds_alternative<ChallengeMsg>(*m)) return ChallengeMsg();
  return std::get<ChallengeMsg>(*m);
}

void ExpectErrorFrom(ControlConnection& conn, absl::StatusCode code) {
  auto m = conn.Receive(Later());
  ASSERT_TRUE(m.ok()) << m.status();
  const auto* error = std::get_if<ErrorMsg>(&*m);
  ASSERT_NE(error, nullptr) << MessageTypeName(TypeOf(*m));
  EXPECT_EQ(error->status_code, static_cast<int32_t>(code)) << error->message;
}

TEST(HandshakeTest, ServerRejectsAHelloWithoutTag) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  absl::StatusOr<HelloMsg> server = absl::UnknownError("not run");
  std::thread t([&] {
    server = HandshakeAsServer(*p.server, Options(MakeHello("prefill-0", 1, "d"), "secret"));
  });
  ExpectChallenge(*p.client);
  HelloMsg hello = MakeHello("intruder", 1, "d");
  hello.nonce.assign(32, 'n');  // a nonce, but no tag
  ASSERT_TRUE(p.client->Send(hello, Later()).ok());
  ExpectErrorFrom(*p.client, absl::StatusCode::kPermissionDenied);
  t.join();
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(p.server->closed());
}

TEST(HandshakeTest, ServerRejectsATagWithoutNonce) {
  // A correct tag, but no nonce for the server to answer: mutual authentication impossible.
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  absl::StatusOr<HelloMsg> server = absl::UnknownError("not run");
  std::thread t([&] {
    server = HandshakeAsServer(*p.server, Options(MakeHello("prefill-0", 1, "d"), "secret"));
  });
  const ChallengeMsg challenge = ExpectChallenge(*p.client);
  HelloMsg hello = MakeHello("decode-0", 1, "d");
  hello.auth_tag = AuthTag("secret", challenge.nonce, "decode-0");
  ASSERT_TRUE(p.client->Send(hello, Later()).ok());
  ExpectErrorFrom(*p.client, absl::StatusCode::kPermissionDenied);
  t.join();
  EXPECT_EQ(server.status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(HandshakeTest, ServerRejectsAnUnexpectedMessage) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  absl::StatusOr<HelloMsg> server = absl::UnknownError("not run");
  std::thread t([&] { server = HandshakeAsServer(*p.server, Options(MakeHello("p", 1, "d"))); });
  ExpectChallenge(*p.client);
  RequestMsg request;
  request.request_id = "too early";
  ASSERT_TRUE(p.client->Send(request, Later()).ok());
  ExpectErrorFrom(*p.client, absl::StatusCode::kInvalidArgument);
  t.join();
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(p.server->closed());
}

// Plays the server up to its HelloAck, built by `make_ack` from the client's hello and the
// challenge nonce; returns the client's result and what the client sent afterwards.
struct FakeServerRun {
  absl::StatusOr<HelloMsg> client = absl::UnknownError("not run");
  absl::StatusOr<ControlMessage> after = absl::UnknownError("not run");
};

FakeServerRun PlayServer(
    const HandshakeOptions& client_options,
    const std::function<HelloAckMsg(const HelloMsg&, const std::string&)>& make_ack) {
  FakeServerRun run;
  Pair p = Connect();
  if (!p.server || !p.client) return run;
  std::thread fake([&] {
    ChallengeMsg challenge;
    challenge.nonce.assign(32, 'c');
    if (!p.server->Send(challenge, Later()).ok()) return;
    auto hello = p.server->Receive(Later());
    if (!hello.ok() || !std::holds_alternative<HelloMsg>(*hello)) return;
    if (!p.server->Send(make_ack(std::get<HelloMsg>(*hello), challenge.nonce), Later()).ok()) {
      return;
    }
    run.after = p.server->Receive(Later());
  });
  run.client = HandshakeAsClient(*p.client, client_options);
  // A failed handshake closes its connection; a successful one leaves it open.
  EXPECT_EQ(run.client.ok(), !p.client->closed());
  p.client->Close();  // ends the fake's last Receive either way
  fake.join();
  return run;
}

TEST(HandshakeTest, ClientRejectsAnAckWithoutTag) {
  FakeServerRun run = PlayServer(Options(MakeHello("decode-0", 1, "d"), "secret"),
                                 [](const HelloMsg&, const std::string& nonce) {
                                   HelloAckMsg ack;
                                   ack.hello = MakeHello("prefill-0", 1, "d");
                                   ack.hello.nonce = nonce;
                                   return ack;
                                 });
  ASSERT_FALSE(run.client.ok());
  EXPECT_EQ(run.client.status().code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(run.after.ok()) << run.after.status();
  EXPECT_EQ(std::get<ErrorMsg>(*run.after).status_code,
            static_cast<int32_t>(absl::StatusCode::kPermissionDenied));
}

TEST(HandshakeTest, ClientRejectsATagThatAnswersTheWrongNonce) {
  // A server replaying the client's own answer (a tag over its challenge, not over the
  // client's nonce) must not pass.
  FakeServerRun run = PlayServer(Options(MakeHello("decode-0", 1, "d"), "secret"),
                                 [](const HelloMsg& client, const std::string& nonce) {
                                   HelloAckMsg ack;
                                   ack.hello = MakeHello("prefill-0", 1, "d");
                                   ack.hello.auth_tag = AuthTag("secret", nonce, "prefill-0");
                                   return ack;
                                 });
  ASSERT_FALSE(run.client.ok());
  EXPECT_EQ(run.client.status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(HandshakeTest, ClientAcceptsACorrectFakeServerAndReportsAnAckStatus) {
  FakeServerRun ok = PlayServer(Options(MakeHello("decode-0", 1, "d"), "secret"),
                                [](const HelloMsg& client, const std::string&) {
                                  HelloAckMsg ack;
                                  ack.hello = MakeHello("prefill-0", 1, "d");
                                  ack.hello.auth_tag = AuthTag("secret", client.nonce, "prefill-0");
                                  return ack;
                                });
  ASSERT_TRUE(ok.client.ok()) << ok.client.status();
  EXPECT_EQ(ok.client->engine_id, "prefill-0");

  FakeServerRun refused =
      PlayServer(Options(MakeHello("decode-0", 1, "d")), [](const HelloMsg&, const std::string&) {
        HelloAckMsg ack;
        ack.status_code = static_cast<int32_t>(absl::StatusCode::kResourceExhausted);
        ack.message = "too many peers";
        return ack;
      });
  ASSERT_FALSE(refused.client.ok());
  EXPECT_EQ(refused.client.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Msg(refused.client.status()), HasSubstr("too many peers"));
}

TEST(HandshakeTest, AuthTagIsHmacSha256OfNonceThenEngineId) {
  // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
  const std::string tag = AuthTag("Jefe", "what do ya want ", "for nothing?");
  std::string hex;
  for (unsigned char c : tag) absl::StrAppend(&hex, absl::Hex(c, absl::kZeroPad2));
  EXPECT_EQ(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(AuthTag("", "n", "e").size(), 32u);
  EXPECT_NE(AuthTag("a", "n", "e"), AuthTag("b", "n", "e"));
}

}  // namespace
}  // namespace kvstream
