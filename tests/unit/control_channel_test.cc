// Tests of the TCP control channel and the handshake over real sockets on 127.0.0.1: frames
// across a connection, deadlines, peer close, hostile peers (garbage, huge announced
// lengths, stalls), concurrency, and the handshake's authentication and the caller's check
// of the peer's (opaque) payload, with its outcome on both sides. No test asserts on
// timing; deadlines only bound how long a broken implementation could hang.
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
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "absl/synchronization/mutex.h"
#include "kvstream/common/logging.h"
#include "kvstream/transfer/wire.h"

namespace kvstream {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::Not;
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

DataMsg Data(std::string payload) {
  DataMsg m;
  m.payload = std::move(payload);
  return m;
}

// n bytes covering every byte value (NULs included).
std::string Pattern(size_t n, uint8_t seed = 0) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed) & 0xff);
  return s;
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
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
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
  // Like Write, but false (instead of a test failure) once the other side is gone.
  bool TryWrite(absl::string_view bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
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
  hello.payload = std::string("\0\1\2 layout", 10);
  HelloAckMsg ack;
  ack.hello = hello;
  ack.status_code = 9;
  ack.message = "ack";
  return {challenge, hello, ack, Data(std::string("r1\0\xff", 4)), Data(""), Error(13, "boom")};
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
  const DataMsg big = Data(Pattern(12u << 20));  // 12 MiB: many reads and writes per frame
  // Sent while the other end receives: neither side buffers a whole 12 MiB frame.
  absl::Status sent;
  std::thread sender([&] { sent = p.client->Send(big, Later()); });
  auto got = p.server->Receive(Later());
  sender.join();
  ASSERT_TRUE(sent.ok()) << sent;
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(std::holds_alternative<DataMsg>(*got));
  EXPECT_EQ(std::get<DataMsg>(*got).payload.size(), big.payload.size());
  EXPECT_TRUE(std::get<DataMsg>(*got).payload == big.payload);  // not printed: 12 MiB
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
  const DataMsg big = Data(std::string(12u << 20, '\1'));  // 12 MiB per frame
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
  raw_->Write(HeaderBytes(static_cast<uint16_t>(MessageType::kData), kMaxPayloadBytes) + "abc");
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

// ---- Receive memory ----

// Waits (bounded) until `done` holds; false if it never does.
bool AwaitTrue(const std::function<bool()>& done) {
  const absl::Time deadline = Later();
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

std::shared_ptr<ReceiveBudget> Budget(size_t total) {
  ReceiveBudgetLimits limits;
  limits.max_total_bytes = total;
  limits.free_frame_bytes = size_t{64} << 10;
  return std::make_shared<ReceiveBudget>(limits);
}

TEST(ReceiveBudgetTest, ChargesWithinTheLimitAndCountsRefusals) {
  std::shared_ptr<ReceiveBudget> budget = Budget(100);
  EXPECT_TRUE(budget->TryAcquire(60));
  EXPECT_FALSE(budget->TryAcquire(41));
  EXPECT_TRUE(budget->TryAcquire(40));
  EXPECT_FALSE(budget->TryAcquire(1));
  EXPECT_FALSE(budget->TryAcquire(~size_t{0}));  // no overflow past the limit
  EXPECT_EQ(budget->in_use_bytes(), 100u);
  budget->Release(60);
  budget->Release(40);
  EXPECT_EQ(budget->in_use_bytes(), 0u);
  EXPECT_EQ(budget->peak_bytes(), 100u);
  EXPECT_EQ(budget->refusals(), 3u);
  EXPECT_EQ(ReceiveBudget::Process()->limits().max_total_bytes, size_t{64} << 20);
}

TEST(ReceiveMemoryTest, TheBufferGrowsWithTheBytesThatArriveNotWithTheAnnouncedLength) {
  std::shared_ptr<ReceiveBudget> budget = Budget(size_t{64} << 20);
  ControlChannelOptions options;
  options.budget = budget;
  auto listener = ControlListener::Listen("127.0.0.1", 0, options);
  ASSERT_TRUE(listener.ok()) << listener.status();
  RawPeer raw((*listener)->port());
  ASSERT_TRUE(raw.connected());
  auto conn = (*listener)->Accept(Later());
  ASSERT_TRUE(conn.ok()) << conn.status();
  // The maximum announced, 100 KiB sent, then a stall.
  constexpr size_t kSent = size_t{100} << 10;
  raw.Write(HeaderBytes(static_cast<uint16_t>(MessageType::kData), kMaxPayloadBytes) +
            std::string(kSent, 'x'));
  absl::StatusOr<ControlMessage> got = absl::UnknownError("not run");
  std::thread receiver([&] { got = (*conn)->Receive(Later()); });
  // 64 KiB filled, then doubled once: 128 KiB held for 100 KiB received.
  EXPECT_TRUE(AwaitTrue([&] { return budget->in_use_bytes() == (size_t{128} << 10); }))
      << budget->in_use_bytes();
  EXPECT_LE(budget->in_use_bytes(), 2 * kSent);
  EXPECT_LE(budget->peak_bytes(), 3 * kSent);  // old and new buffer while it grows
  (*conn)->Close();
  receiver.join();
  EXPECT_FALSE(got.ok());
  EXPECT_EQ(budget->in_use_bytes(), 0u);
}

TEST(ReceiveMemoryTest, AFrameOverTheConnectionsLimitIsResourceExhausted) {
  ControlChannelOptions options;
  options.budget = Budget(size_t{64} << 20);
  options.max_frame_bytes = 1u << 20;
  auto listener = ControlListener::Listen("127.0.0.1", 0, options);
  ASSERT_TRUE(listener.ok()) << listener.status();
  auto client = ConnectControl("127.0.0.1", (*listener)->port(), Later());
  ASSERT_TRUE(client.ok()) << client.status();
  auto server = (*listener)->Accept(Later());
  ASSERT_TRUE(server.ok()) << server.status();
  // At the limit: received (and charged: 1 MiB is over the free size).
  ASSERT_TRUE((*client)->Send(Data(std::string(options.max_frame_bytes - 4, 'a')), Later()).ok());
  auto at_limit = (*server)->Receive(Later());
  ASSERT_TRUE(at_limit.ok()) << at_limit.status();
  EXPECT_GE(options.budget->peak_bytes(), size_t{2} << 20);
  EXPECT_EQ(options.budget->in_use_bytes(), 0u);
  // One byte over: refused from the header alone, and the connection closed.
  ASSERT_TRUE((*client)->Send(Data(std::string(options.max_frame_bytes - 3, 'a')), Later()).ok());
  auto over = (*server)->Receive(Later());
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_THAT(Msg(over.status()), HasSubstr("this connection's limit"));
  EXPECT_TRUE((*server)->closed());
  EXPECT_EQ(options.budget->in_use_bytes(), 0u);
}

TEST(ReceiveMemoryTest, ThirtyTwoTricklersOfMaximalFramesAreRefusedAndOthersServed) {
  // 32 peers each announce a maximal frame (16 MiB) and trickle it in 64 KiB pieces. The
  // budget (8 MiB for all connections) can never hold one of them, so every one of them
  // must end in ResourceExhausted with its connection closed, while the budget never went
  // over its limit and a well-behaved connection on the same listener is served.
  constexpr size_t kTotal = size_t{8} << 20;
  constexpr int kPeers = 32;
  std::shared_ptr<ReceiveBudget> budget = Budget(kTotal);
  ControlChannelOptions options;
  options.budget = budget;
  auto listener = ControlListener::Listen("127.0.0.1", 0, options);
  ASSERT_TRUE(listener.ok()) << listener.status();
  auto good_client = ConnectControl("127.0.0.1", (*listener)->port(), Later());
  ASSERT_TRUE(good_client.ok()) << good_client.status();
  auto good_server = (*listener)->Accept(Later());
  ASSERT_TRUE(good_server.ok()) << good_server.status();

  std::vector<std::unique_ptr<RawPeer>> peers;
  std::vector<std::unique_ptr<ControlConnection>> conns;
  for (int i = 0; i < kPeers; ++i) {
    peers.push_back(std::make_unique<RawPeer>((*listener)->port()));
    ASSERT_TRUE(peers.back()->connected());
    auto conn = (*listener)->Accept(Later());
    ASSERT_TRUE(conn.ok()) << conn.status();
    conns.push_back(std::move(*conn));
  }
  std::vector<absl::Status> results(kPeers, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kPeers; ++i) {
    threads.emplace_back([&, i] {
      results[i] = conns[i]->Receive(Later()).status();
      conns[i].reset();  // unread bytes: the peer's blocked send sees a reset
    });
    threads.emplace_back([&, i] {
      const std::string piece(size_t{64} << 10, static_cast<char>('a' + i % 26));
      if (!peers[i]->TryWrite(
              HeaderBytes(static_cast<uint16_t>(MessageType::kData), kMaxPayloadBytes))) {
        return;
      }
      for (size_t sent = 0; sent < kMaxPayloadBytes; sent += piece.size()) {
        if (!peers[i]->TryWrite(piece)) return;
      }
    });
  }
  // Meanwhile a small frame (not charged) is served.
  ASSERT_TRUE((*good_client)->Send(Data("small"), Later()).ok());
  auto small = (*good_server)->Receive(Later());
  for (auto& t : threads) t.join();
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(std::get<DataMsg>(*small).payload, "small");

  for (int i = 0; i < kPeers; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(results[i].code(), absl::StatusCode::kResourceExhausted) << results[i];
    EXPECT_THAT(Msg(results[i]), HasSubstr("receive budget"));
  }
  EXPECT_GE(budget->refusals(), static_cast<uint64_t>(kPeers));
  EXPECT_LE(budget->peak_bytes(), kTotal);
  EXPECT_GT(budget->peak_bytes(), size_t{64} << 10);  // the tricklers were charged
  EXPECT_EQ(budget->in_use_bytes(), 0u);              // and all of it given back
  // Once they are gone, a large frame fits again.
  const std::string large = Pattern(size_t{1} << 20, 4);
  ASSERT_TRUE((*good_client)->Send(Data(large), Later()).ok());
  auto got = (*good_server)->Receive(Later());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(std::get<DataMsg>(*got).payload == large);
  EXPECT_EQ(budget->in_use_bytes(), 0u);
}

// ---- Concurrency ----

TEST(ControlConnectionTest, ConcurrentSendAndReceiveOnBothEnds) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  constexpr int kMessages = 2000;
  // Each end sends on one thread while receiving on another.
  // Message i from `tag`: its name, then a size and filler that vary with i.
  auto payload = [](absl::string_view tag, int i) {
    return absl::StrCat(tag, i, ":", std::string(static_cast<size_t>(i % 300) * 4,
                                                 static_cast<char>(i & 0xff)));
  };
  auto send_all = [&payload](ControlConnection* conn, absl::string_view tag) {
    for (int i = 0; i < kMessages; ++i) {
      if (!conn->Send(Data(payload(tag, i)), Later()).ok()) return false;
    }
    return true;
  };
  auto receive_all = [&payload](ControlConnection* conn, absl::string_view tag) {
    for (int i = 0; i < kMessages; ++i) {
      auto got = conn->Receive(Later());
      if (!got.ok()) return false;
      const auto* m = std::get_if<DataMsg>(&*got);
      if (m == nullptr || m->payload != payload(tag, i)) return false;
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
  // Thread t's message i: t in the first byte, then i, then filler large enough that one
  // frame takes several send() calls.
  auto payload = [](int t, int i) {
    return absl::StrCat(t, ":", i, ":", std::string(80000, static_cast<char>(i & 0xff)));
  };
  std::vector<std::thread> senders;
  for (int t = 0; t < kThreads; ++t) {
    senders.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        if (!p.client->Send(Data(payload(t, i)), Later()).ok()) ++send_failures;
      }
    });
  }
  std::vector<int> next(kThreads, 0);
  bool in_order = true;
  for (int n = 0; n < kThreads * kPerThread; ++n) {
    auto got = p.server->Receive(Later());
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(std::holds_alternative<DataMsg>(*got));
    const std::string& m = std::get<DataMsg>(*got).payload;
    ASSERT_FALSE(m.empty());
    const int t = m[0] - '0';
    ASSERT_TRUE(t >= 0 && t < kThreads);
    in_order = in_order && m == payload(t, next[t]);
    ++next[t];
  }
  for (auto& s : senders) s.join();
  EXPECT_EQ(send_failures.load(), 0);
  EXPECT_TRUE(in_order);
}

// ---- Handshake ----

// The payload the tests' checks read: a tag, a NUL (binary bytes are carried as they are),
// then the layout version the two sides must agree on. The real payload is the connector's.
const std::string& LayoutTag() {
  static const std::string* tag = new std::string("layout\0", 7);
  return *tag;
}

std::string LayoutPayload(absl::string_view layout) { return absl::StrCat(LayoutTag(), layout); }

HelloMsg MakeHello(std::string engine, absl::string_view layout) {
  HelloMsg h;
  h.engine_id = std::move(engine);
  h.payload = LayoutPayload(layout);
  return h;
}

HandshakeOptions Options(HelloMsg local, std::string secret = "") {
  HandshakeOptions o;
  o.local = std::move(local);
  o.secret = std::move(secret);
  o.deadline = Later();
  return o;
}

// The usual check: decode the peer's payload and require the same layout as ours, saying
// both layouts when they differ (the peer sees the message too).
std::function<absl::Status(const HelloMsg&)> SameLayoutAs(const HelloMsg& local) {
  const std::string ours = local.payload.substr(LayoutTag().size());
  return [ours](const HelloMsg& peer) {
    if (!absl::StartsWith(peer.payload, LayoutTag())) {
      return absl::InvalidArgumentError("peer's introduction is not a layout");
    }
    const std::string theirs = peer.payload.substr(LayoutTag().size());
    if (theirs == ours) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "incompatible KV cache layout: this side has '", ours, "', the peer has '", theirs, "'"));
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
  EXPECT_EQ(absl::BytesToHexString(got.payload), absl::BytesToHexString(sent.payload));
}

TEST(HandshakeTest, SucceedsWithoutSecretAndChecksSeeThePeersFields) {
  HelloMsg client_hello = MakeHello("decode-0", "A");
  client_hello.payload += std::string("\0\xff\x80", 3);  // opaque bytes reach the check as sent
  const HelloMsg server_hello = MakeHello("prefill-0", "A");
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

// The binding of the connection `client` as both of its ends see it.
HandshakeBinding BindingOf(const ControlConnection& client, std::string server_nonce,
                           std::string client_nonce, std::string client_id,
                           std::string server_id) {
  HandshakeBinding b;
  b.server_nonce = std::move(server_nonce);
  b.client_nonce = std::move(client_nonce);
  b.client_engine_id = std::move(client_id);
  b.server_engine_id = std::move(server_id);
  b.client_endpoint = client.local_address();
  b.server_endpoint = client.peer_address();
  return b;
}

TEST(HandshakeTest, SucceedsWithTheSameSecretAndTagsCoverTheWholeExchange) {
  const HelloMsg client_hello = MakeHello("decode-0", "d");
  const HelloMsg server_hello = MakeHello("prefill-0", "d");
  Outcome out = RunHandshake(Options(client_hello, "s3cret"), Options(server_hello, "s3cret"));
  ASSERT_TRUE(out.client.ok()) << out.client.status();
  ASSERT_TRUE(out.server.ok()) << out.server.status();
  // The payloads arrive (in the Intros, after authentication).
  ExpectSameHello(server_hello, *out.client);
  ExpectSameHello(client_hello, *out.server);
  // Both ends agree on the endpoints the tags cover.
  EXPECT_EQ(out.pair.client->local_address(), out.pair.server->peer_address());
  EXPECT_EQ(out.pair.client->peer_address(), out.pair.server->local_address());
  // The client's result holds the server's nonce, the server's the client's.
  const HandshakeBinding b = BindingOf(*out.pair.client, out.client->nonce, out.server->nonce,
                                       "decode-0", "prefill-0");
  EXPECT_EQ(out.server->auth_tag, HandshakeTag("s3cret", HandshakeStep::kClientHello, b, ""));
  EXPECT_EQ(out.client->auth_tag, HandshakeTag("s3cret", HandshakeStep::kServerHello, b, ""));
  EXPECT_EQ(out.client->auth_tag.size(), 32u);
  // Every input changes the tag: the step, each field, the payload.
  const std::string base = HandshakeTag("s3cret", HandshakeStep::kClientIntro, b, "p");
  EXPECT_NE(base, HandshakeTag("s3cret", HandshakeStep::kServerIntro, b, "p"));
  EXPECT_NE(base, HandshakeTag("s3cret", HandshakeStep::kClientIntro, b, "q"));
  EXPECT_NE(base, HandshakeTag("other", HandshakeStep::kClientIntro, b, "p"));
  for (std::string HandshakeBinding::*field :
       {&HandshakeBinding::server_nonce, &HandshakeBinding::client_nonce,
        &HandshakeBinding::client_engine_id, &HandshakeBinding::server_engine_id,
        &HandshakeBinding::client_endpoint, &HandshakeBinding::server_endpoint}) {
    HandshakeBinding changed = b;
    changed.*field += "x";
    EXPECT_NE(base, HandshakeTag("s3cret", HandshakeStep::kClientIntro, changed, "p"));
  }
  // Fields are length-prefixed: moving a byte from one to the next changes the tag.
  HandshakeBinding shifted = b;
  shifted.client_engine_id = "decode-";
  shifted.server_engine_id = "0prefill-0";
  EXPECT_NE(base, HandshakeTag("s3cret", HandshakeStep::kClientIntro, shifted, "p"));
}

TEST(HandshakeTest, DataMessagesRoundTripAfterTheHandshake) {
  HandshakeOptions c = Options(MakeHello("decode-0", "v7"), "s3cret");
  c.check = SameLayoutAs(c.local);
  HandshakeOptions s = Options(MakeHello("prefill-0", "v7"), "s3cret");
  s.check = SameLayoutAs(s.local);
  Outcome out = RunHandshake(c, s);
  ASSERT_TRUE(out.client.ok()) << out.client.status();
  ASSERT_TRUE(out.server.ok()) << out.server.status();
  // Binary payloads both ways, NULs and every byte value included, then an empty one.
  const std::string request = std::string("\0req-1\0", 7) + Pattern(1000, 3);
  const std::string reply = Pattern(70000, 9);
  ASSERT_TRUE(out.pair.client->Send(Data(request), Later()).ok());
  auto at_server = out.pair.server->Receive(Later());
  ASSERT_TRUE(at_server.ok()) << at_server.status();
  ASSERT_TRUE(std::holds_alternative<DataMsg>(*at_server)) << MessageTypeName(TypeOf(*at_server));
  EXPECT_EQ(absl::BytesToHexString(std::get<DataMsg>(*at_server).payload),
            absl::BytesToHexString(request));
  ASSERT_TRUE(out.pair.server->Send(Data(reply), Later()).ok());
  ASSERT_TRUE(out.pair.server->Send(Data(""), Later()).ok());
  auto at_client = out.pair.client->Receive(Later());
  ASSERT_TRUE(at_client.ok()) << at_client.status();
  ASSERT_TRUE(std::holds_alternative<DataMsg>(*at_client)) << MessageTypeName(TypeOf(*at_client));
  EXPECT_TRUE(std::get<DataMsg>(*at_client).payload == reply);
  auto empty = out.pair.client->Receive(Later());
  ASSERT_TRUE(empty.ok()) << empty.status();
  ASSERT_TRUE(std::holds_alternative<DataMsg>(*empty));
  EXPECT_TRUE(std::get<DataMsg>(*empty).payload.empty());
  EXPECT_FALSE(out.pair.client->closed());
  EXPECT_FALSE(out.pair.server->closed());
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
  Outcome out = RunHandshake(Options(MakeHello("decode-0", "d"), "secret-a"),
                             Options(MakeHello("prefill-0", "d"), "secret-b"));
  ExpectRejectedOnBothSides(out, absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(Msg(out.server.status()), HasSubstr("wrong shared secret"));
  EXPECT_THAT(Msg(out.client.status()), HasSubstr("wrong shared secret"));
}

TEST(HandshakeTest, ClientWithoutTheSecretIsPermissionDeniedOnBothSides) {
  Outcome out = RunHandshake(Options(MakeHello("decode-0", "d")),
                             Options(MakeHello("prefill-0", "d"), "secret"));
  ExpectRejectedOnBothSides(out, absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(Msg(out.server.status()), HasSubstr("no auth tag"));
}

TEST(HandshakeTest, ServerWithoutTheSecretIsPermissionDeniedOnBothSides) {
  Outcome out = RunHandshake(Options(MakeHello("decode-0", "d"), "secret"),
                             Options(MakeHello("prefill-0", "d")));
  ExpectRejectedOnBothSides(out, absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(Msg(out.server.status()), HasSubstr("has none configured"));
}

TEST(HandshakeTest, PayloadMismatchRefusedByTheChecksNamesBothLayoutsOnBothSides) {
  const HelloMsg client_hello = MakeHello("decode-0", "NHD bf16 block 16");
  const HelloMsg server_hello = MakeHello("prefill-0", "HND fp8 block 32");
  HandshakeOptions c = Options(client_hello, "secret");
  c.check = SameLayoutAs(client_hello);
  HandshakeOptions s = Options(server_hello, "secret");
  s.check = SameLayoutAs(server_hello);
  Outcome out = RunHandshake(c, s);
  // The server checks first and refuses; the client reports the server's refusal.
  ExpectRejectedOnBothSides(out, absl::StatusCode::kFailedPrecondition);
  const std::string words =
      "incompatible KV cache layout: this side has 'HND fp8 block 32', the peer has 'NHD "
      "bf16 block 16'";
  EXPECT_THAT(Msg(out.server.status()), HasSubstr(words));
  // The peer's words, escaped: they came over the wire.
  EXPECT_THAT(Msg(out.client.status()), HasSubstr(absl::CHexEscape(words)));
}

TEST(HandshakeTest, TheChecksOwnErrorReachesBothEndsWithNothingAdded) {
  // Whatever code and words the check chooses are what both ends report: the handshake
  // neither rewrites the code nor appends anything to the message.
  const HelloMsg client_hello = MakeHello("decode-0", "desc-of-client");
  const HelloMsg server_hello = MakeHello("prefill-0", "desc-of-server");
  std::string seen_payload;
  HandshakeOptions s = Options(server_hello);
  s.check = [&seen_payload](const HelloMsg& peer) {
    seen_payload = peer.payload;
    return absl::OutOfRangeError("the check's own words");
  };
  Outcome out = RunHandshake(Options(client_hello), s);
  ExpectRejectedOnBothSides(out, absl::StatusCode::kOutOfRange);
  EXPECT_EQ(absl::BytesToHexString(seen_payload), absl::BytesToHexString(client_hello.payload));
  EXPECT_EQ(Msg(out.server.status()), "the check's own words");
  EXPECT_THAT(Msg(out.client.status()),
              EndsWith(absl::StrCat("rejected the handshake: ",
                                    absl::CHexEscape("the check's own words"))));
  for (const absl::Status& status : {out.client.status(), out.server.status()}) {
    EXPECT_THAT(Msg(status), Not(HasSubstr("desc-of")));
  }
}

TEST(HandshakeTest, APayloadTheCheckCannotReadIsRefusedOnBothSides) {
  HelloMsg garbage;
  garbage.engine_id = "decode-0";
  garbage.payload = Pattern(64, 1);
  const HelloMsg server_hello = MakeHello("prefill-0", "v1");
  HandshakeOptions s = Options(server_hello);
  s.check = SameLayoutAs(server_hello);
  Outcome out = RunHandshake(Options(garbage), s);
  ExpectRejectedOnBothSides(out, absl::StatusCode::kInvalidArgument);
  for (const absl::Status& status : {out.client.status(), out.server.status()}) {
    EXPECT_THAT(Msg(status), HasSubstr("not a layout"));
  }
}

TEST(HandshakeTest, ACheckErrorLongerThanAnErrorFrameStillReachesThePeer) {
  // The refusal is cut to what an ErrorMsg can carry rather than failing to encode (which
  // would leave the peer with a bare end of stream).
  HandshakeOptions s = Options(MakeHello("prefill-0", "v1"));
  s.check = [](const HelloMsg&) {
    return absl::FailedPreconditionError(std::string(kMaxMessageBytes + 100, 'w'));
  };
  Outcome out = RunHandshake(Options(MakeHello("decode-0", "v1")), s);
  ExpectRejectedOnBothSides(out, absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(out.client.status()), HasSubstr(std::string(kMaxMessageBytes, 'w')));
}

TEST(HandshakeTest, ClientOnlyRejectionReachesTheServerAsAnError) {
  // The server has accepted before the client runs its check; the refusal then arrives as
  // the first message after the handshake.
  const HelloMsg client_hello = MakeHello("decode-0", "mine");
  HandshakeOptions c = Options(client_hello);
  c.check = SameLayoutAs(client_hello);
  Outcome out = RunHandshake(c, Options(MakeHello("prefill-0", "theirs")));
  ASSERT_FALSE(out.client.ok());
  EXPECT_EQ(out.client.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string expected =
      "incompatible KV cache layout: this side has 'mine', the peer has 'theirs'";
  EXPECT_EQ(Msg(out.client.status()), expected);
  EXPECT_TRUE(out.pair.client->closed());
  ASSERT_TRUE(out.server.ok()) << out.server.status();
  auto next = out.pair.server->Receive(Later());
  ASSERT_TRUE(next.ok()) << next.status();
  const auto* error = std::get_if<ErrorMsg>(&*next);
  ASSERT_NE(error, nullptr) << MessageTypeName(TypeOf(*next));
  EXPECT_EQ(error->status_code, static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(error->message, expected);
}

TEST(HandshakeTest, DeadlineWhenTheServerNeverSpeaks) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  HandshakeOptions c = Options(MakeHello("decode-0", "d"));
  c.deadline = Shortly();
  auto result = HandshakeAsClient(*p.client, c);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(p.client->closed());
}

TEST(HandshakeTest, DeadlineWhenTheClientNeverAnswers) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  HandshakeOptions s = Options(MakeHello("prefill-0", "d"), "secret");
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
    server = HandshakeAsServer(*p.server, Options(MakeHello("prefill-0", "d"), "secret"));
  });
  ExpectChallenge(*p.client);
  HelloMsg hello = MakeHello("intruder", "d");
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
    server = HandshakeAsServer(*p.server, Options(MakeHello("prefill-0", "d"), "secret"));
  });
  const ChallengeMsg challenge = ExpectChallenge(*p.client);
  HelloMsg hello;
  hello.engine_id = "decode-0";
  hello.auth_tag = HandshakeTag("secret", HandshakeStep::kClientHello,
                                BindingOf(*p.client, challenge.nonce, "", "decode-0", ""), "");
  ASSERT_TRUE(p.client->Send(hello, Later()).ok());
  ExpectErrorFrom(*p.client, absl::StatusCode::kPermissionDenied);
  t.join();
  EXPECT_EQ(server.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(Msg(server.status()), HasSubstr("sent no nonce"));
}

TEST(HandshakeTest, ServerRejectsAnIntroductionBeforeAuthentication) {
  // A correct tag, but the payload in the Hello: with a secret it must wait for the Intro.
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  absl::StatusOr<HelloMsg> server = absl::UnknownError("not run");
  std::thread t([&] {
    server = HandshakeAsServer(*p.server, Options(MakeHello("prefill-0", "d"), "secret"));
  });
  const ChallengeMsg challenge = ExpectChallenge(*p.client);
  HelloMsg hello = MakeHello("decode-0", "d");
  hello.nonce.assign(32, 'n');
  hello.auth_tag = HandshakeTag(
      "secret", HandshakeStep::kClientHello,
      BindingOf(*p.client, challenge.nonce, hello.nonce, "decode-0", ""), "");
  ASSERT_TRUE(p.client->Send(hello, Later()).ok());
  ExpectErrorFrom(*p.client, absl::StatusCode::kInvalidArgument);
  t.join();
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(server.status()), HasSubstr("before authentication"));
}

TEST(HandshakeTest, ServerRejectsAnUnexpectedMessage) {
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  absl::StatusOr<HelloMsg> server = absl::UnknownError("not run");
  std::thread t([&] { server = HandshakeAsServer(*p.server, Options(MakeHello("p", "d"))); });
  ExpectChallenge(*p.client);
  // Data before the handshake has finished.
  ASSERT_TRUE(p.client->Send(Data("too early"), Later()).ok());
  ExpectErrorFrom(*p.client, absl::StatusCode::kInvalidArgument);
  t.join();
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(server.status()), HasSubstr("expected Hello"));
  EXPECT_THAT(Msg(server.status()), HasSubstr("got Data"));
  EXPECT_TRUE(p.server->closed());
}

// Plays the server: a challenge (nonce "ccc..."), then the HelloAck that `make_ack` builds
// from the client's hello and the binding as the server sees it (server_engine_id still
// empty); then, if the client sends an Intro and `make_intro` is given, the Intro it
// builds. Returns the client's result and the first message the client sent after the ack.
struct FakeServerRun {
  absl::StatusOr<HelloMsg> client = absl::UnknownError("not run");
  absl::StatusOr<ControlMessage> after = absl::UnknownError("not run");
};

using AckMaker = std::function<HelloAckMsg(const HelloMsg&, const HandshakeBinding&)>;
using IntroMaker = std::function<IntroMsg(const IntroMsg&, const HandshakeBinding&)>;

FakeServerRun PlayServer(const HandshakeOptions& client_options, const AckMaker& make_ack,
                         const IntroMaker& make_intro = nullptr) {
  FakeServerRun run;
  Pair p = Connect();
  if (!p.server || !p.client) return run;
  std::thread fake([&] {
    ChallengeMsg challenge;
    challenge.nonce.assign(32, 'c');
    if (!p.server->Send(challenge, Later()).ok()) return;
    auto hello = p.server->Receive(Later());
    if (!hello.ok() || !std::holds_alternative<HelloMsg>(*hello)) return;
    const HelloMsg& h = std::get<HelloMsg>(*hello);
    HandshakeBinding b;
    b.server_nonce = challenge.nonce;
    b.client_nonce = h.nonce;
    b.client_engine_id = h.engine_id;
    b.client_endpoint = p.server->peer_address();
    b.server_endpoint = p.server->local_address();
    const HelloAckMsg ack = make_ack(h, b);
    if (!p.server->Send(ack, Later()).ok()) return;
    run.after = p.server->Receive(Later());
    if (make_intro && run.after.ok() && std::holds_alternative<IntroMsg>(*run.after)) {
      b.server_engine_id = ack.hello.engine_id;
      if (!p.server->Send(make_intro(std::get<IntroMsg>(*run.after), b), Later()).ok()) return;
      auto ignored = p.server->Receive(Later());  // until the client is done
    }
  });
  run.client = HandshakeAsClient(*p.client, client_options);
  // A failed handshake closes its connection; a successful one leaves it open.
  EXPECT_EQ(run.client.ok(), !p.client->closed());
  p.client->Close();  // ends the fake's last Receive either way
  fake.join();
  return run;
}

// The HelloAck of a server that knows `secret`.
HelloAckMsg GoodAck(const std::string& secret, HandshakeBinding b) {
  HelloAckMsg ack;
  ack.hello.engine_id = "prefill-0";
  ack.hello.nonce = b.server_nonce;
  b.server_engine_id = ack.hello.engine_id;
  ack.hello.auth_tag = HandshakeTag(secret, HandshakeStep::kServerHello, b, "");
  return ack;
}

TEST(HandshakeTest, ClientRejectsAnAckWithoutTag) {
  FakeServerRun run = PlayServer(Options(MakeHello("decode-0", "d"), "secret"),
                                 [](const HelloMsg&, const HandshakeBinding& b) {
                                   HelloAckMsg ack;
                                   ack.hello.engine_id = "prefill-0";
                                   ack.hello.nonce = b.server_nonce;
                                   return ack;
                                 });
  ASSERT_FALSE(run.client.ok());
  EXPECT_EQ(run.client.status().code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(run.after.ok()) << run.after.status();
  EXPECT_EQ(std::get<ErrorMsg>(*run.after).status_code,
            static_cast<int32_t>(absl::StatusCode::kPermissionDenied));
}

TEST(HandshakeTest, ClientRejectsItsOwnTagReflectedBack) {
  // A server without the secret that hands the client's own answer back (the same
  // nonces, the same engine id): the step in the tag tells the directions apart.
  FakeServerRun run = PlayServer(Options(MakeHello("decode-0", "d"), "secret"),
                                 [](const HelloMsg& client, const HandshakeBinding& b) {
                                   HelloAckMsg ack;
                                   ack.hello.engine_id = "";
                                   ack.hello.nonce = b.server_nonce;
                                   ack.hello.auth_tag = client.auth_tag;
                                   return ack;
                                 });
  ASSERT_FALSE(run.client.ok());
  EXPECT_EQ(run.client.status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(HandshakeTest, ClientRejectsATagOverTheWrongNonce) {
  FakeServerRun run = PlayServer(Options(MakeHello("decode-0", "d"), "secret"),
                                 [](const HelloMsg&, HandshakeBinding b) {
                                   b.client_nonce.assign(32, 'z');
                                   HelloAckMsg ack = GoodAck("secret", b);
                                   return ack;
                                 });
  ASSERT_FALSE(run.client.ok());
  EXPECT_EQ(run.client.status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(HandshakeTest, ClientAcceptsACorrectFakeServerAndReportsAnAckStatus) {
  const HelloMsg client_hello = MakeHello("decode-0", "d");
  FakeServerRun ok = PlayServer(
      Options(client_hello, "secret"),
      [](const HelloMsg&, const HandshakeBinding& b) { return GoodAck("secret", b); },
      [&](const IntroMsg& theirs, const HandshakeBinding& b) {
        EXPECT_EQ(theirs.payload, client_hello.payload);
        EXPECT_EQ(theirs.auth_tag,
                  HandshakeTag("secret", HandshakeStep::kClientIntro, b, theirs.payload));
        IntroMsg intro;
        intro.payload = "server payload";
        intro.auth_tag = HandshakeTag("secret", HandshakeStep::kServerIntro, b, intro.payload);
        return intro;
      });
  ASSERT_TRUE(ok.client.ok()) << ok.client.status();
  EXPECT_EQ(ok.client->engine_id, "prefill-0");
  EXPECT_EQ(ok.client->payload, "server payload");

  FakeServerRun refused =
      PlayServer(Options(MakeHello("decode-0", "d")), [](const HelloMsg&, const HandshakeBinding&) {
        HelloAckMsg ack;
        ack.status_code = static_cast<int32_t>(absl::StatusCode::kResourceExhausted);
        ack.message = "too many peers";
        return ack;
      });
  ASSERT_FALSE(refused.client.ok());
  EXPECT_EQ(refused.client.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Msg(refused.client.status()), HasSubstr("too many peers"));
}

TEST(HandshakeTest, ClientRejectsAnUnexpectedMessage) {
  // A fake server that sends Data where the challenge (step 0) or the HelloAck (step 1)
  // belongs: the client refuses with InvalidArgument, tells it so, and closes.
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(step);
    Pair p = Connect();
    ASSERT_TRUE(p.server && p.client);
    absl::StatusOr<ControlMessage> told = absl::UnknownError("not run");
    std::thread fake([&] {
      if (step == 1) {
        ChallengeMsg challenge;
        challenge.nonce.assign(32, 'c');
        if (!p.server->Send(challenge, Later()).ok()) return;
        auto hello = p.server->Receive(Later());
        if (!hello.ok() || !std::holds_alternative<HelloMsg>(*hello)) return;
      }
      if (!p.server->Send(Data(std::string("\0not now", 8)), Later()).ok()) return;
      told = p.server->Receive(Later());
    });
    auto client = HandshakeAsClient(*p.client, Options(MakeHello("decode-0", "d")));
    fake.join();
    ASSERT_FALSE(client.ok());
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument) << client.status();
    EXPECT_THAT(Msg(client.status()), HasSubstr("got Data"));
    EXPECT_TRUE(p.client->closed());
    ASSERT_TRUE(told.ok()) << told.status();
    const auto* error = std::get_if<ErrorMsg>(&*told);
    ASSERT_NE(error, nullptr) << MessageTypeName(TypeOf(*told));
    EXPECT_EQ(error->status_code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  }
}

// ---- Hostile middles and eavesdroppers ----

// A middle process: accepts one connection on its own port, connects on to `target_port`
// and forwards every frame both ways, after `edit` has seen (and possibly changed) it.
class Relay {
 public:
  using Edit = std::function<void(bool from_client, ControlMessage& message)>;

  Relay(uint16_t target_port, Edit edit) : target_port_(target_port), edit_(std::move(edit)) {
    auto listener = ControlListener::Listen("127.0.0.1", 0);
    EXPECT_TRUE(listener.ok()) << listener.status();
    if (!listener.ok()) return;
    listener_ = std::move(*listener);
    acceptor_ = std::thread([this] {
      auto from_client = listener_->Accept(Later());
      if (!from_client.ok()) return;
      auto to_server = ConnectControl("127.0.0.1", target_port_, Later());
      if (!to_server.ok()) return;
      client_side_ = std::move(*from_client);
      server_side_ = std::move(*to_server);
      pumps_.emplace_back([this] { Pump(*client_side_, *server_side_, true); });
      pumps_.emplace_back([this] { Pump(*server_side_, *client_side_, false); });
    });
  }
  ~Relay() {
    if (acceptor_.joinable()) acceptor_.join();
    if (client_side_) client_side_->Close();
    if (server_side_) server_side_->Close();
    for (auto& t : pumps_) t.join();
  }
  uint16_t port() const { return listener_ ? listener_->port() : 0; }

 private:
  void Pump(ControlConnection& from, ControlConnection& to, bool from_client) {
    for (;;) {
      auto m = from.Receive(Later());
      if (!m.ok()) break;
      if (edit_) edit_(from_client, *m);
      if (!to.Send(*m, Later()).ok()) break;
    }
    from.Close();
    to.Close();
  }

  const uint16_t target_port_;
  const Edit edit_;
  std::unique_ptr<ControlListener> listener_;
  std::unique_ptr<ControlConnection> client_side_;
  std::unique_ptr<ControlConnection> server_side_;
  std::thread acceptor_;
  std::vector<std::thread> pumps_;
};

struct RelayedOutcome {
  absl::StatusOr<HelloMsg> client = absl::UnknownError("not run");
  absl::StatusOr<HelloMsg> server = absl::UnknownError("not run");
  // The server's connection, for what the client sent after the handshake.
  std::unique_ptr<ControlConnection> server_conn;
};

// A client and a server whose connection goes through a Relay with `edit`.
RelayedOutcome RunRelayed(const HandshakeOptions& client_options,
                          const HandshakeOptions& server_options, Relay::Edit edit) {
  RelayedOutcome out;
  auto listener = ControlListener::Listen("127.0.0.1", 0);
  EXPECT_TRUE(listener.ok()) << listener.status();
  if (!listener.ok()) return out;
  std::thread server([&] {
    auto conn = (*listener)->Accept(Later());
    if (!conn.ok()) return;
    out.server_conn = std::move(*conn);
    out.server = HandshakeAsServer(*out.server_conn, server_options);
  });
  {
    Relay relay((*listener)->port(), std::move(edit));
    auto conn = ConnectControl("127.0.0.1", relay.port(), Later());
    EXPECT_TRUE(conn.ok()) << conn.status();
    if (conn.ok()) out.client = HandshakeAsClient(**conn, client_options);
    server.join();
  }
  return out;
}

// True if `needle` occurs in the encoding of any of `messages`.
bool AnyContains(const std::vector<ControlMessage>& messages, absl::string_view needle) {
  for (const ControlMessage& m : messages) {
    absl::StatusOr<std::string> bytes = EncodeFrame(m);
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    if (bytes.ok() && absl::StrContains(*bytes, needle)) return true;
  }
  return false;
}

TEST(HandshakeAttackTest, ARelayedHandshakeFailsWithASecret) {
  // The relay forwards every byte faithfully: all it changes is that the two sides are
  // on two different TCP connections.
  const HelloMsg client_hello = MakeHello("decode-0", "d");
  const HelloMsg server_hello = MakeHello("prefill-0", "d");
  RelayedOutcome out = RunRelayed(Options(client_hello, "secret"),
                                  Options(server_hello, "secret"), nullptr);
  ASSERT_FALSE(out.server.ok());
  EXPECT_EQ(out.server.status().code(), absl::StatusCode::kPermissionDenied) << out.server.status();
  EXPECT_THAT(Msg(out.server.status()), HasSubstr("relayed"));
  ASSERT_FALSE(out.client.ok());
  EXPECT_EQ(out.client.status().code(), absl::StatusCode::kPermissionDenied) << out.client.status();

  // The same relay passes without a secret (nothing can be authenticated then) and with
  // the endpoint binding turned off on both sides: it is the binding that refused it.
  RelayedOutcome open = RunRelayed(Options(client_hello), Options(server_hello), nullptr);
  EXPECT_TRUE(open.client.ok()) << open.client.status();
  EXPECT_TRUE(open.server.ok()) << open.server.status();
  HandshakeOptions c = Options(client_hello, "secret");
  HandshakeOptions s = Options(server_hello, "secret");
  c.bind_to_endpoints = false;
  s.bind_to_endpoints = false;
  RelayedOutcome unbound = RunRelayed(c, s, nullptr);
  EXPECT_TRUE(unbound.client.ok()) << unbound.client.status();
  EXPECT_TRUE(unbound.server.ok()) << unbound.server.status();
}

TEST(HandshakeAttackTest, AReplayedHelloFailsOnANewConnection) {
  // Record a real client's Hello and Intro (through a relay, with the endpoint binding off
  // so that the recorded handshake succeeds and only the nonces defend), then replay them
  // on a connection of our own.
  HandshakeOptions c = Options(MakeHello("decode-0", "d"), "secret");
  HandshakeOptions s = Options(MakeHello("prefill-0", "SERVER-CACHE-DESCRIPTION"), "secret");
  c.bind_to_endpoints = false;
  s.bind_to_endpoints = false;
  std::vector<ControlMessage> recorded;
  RelayedOutcome real = RunRelayed(c, s, [&](bool from_client, ControlMessage& m) {
    if (from_client) recorded.push_back(m);
  });
  ASSERT_TRUE(real.client.ok()) << real.client.status();
  ASSERT_TRUE(real.server.ok()) << real.server.status();
  ASSERT_EQ(recorded.size(), 2u);
  ASSERT_TRUE(std::holds_alternative<HelloMsg>(recorded[0]));

  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  bool checked = false;
  s.check = [&checked](const HelloMsg&) {
    checked = true;
    return absl::OkStatus();
  };
  absl::StatusOr<HelloMsg> server = absl::UnknownError("not run");
  std::thread t([&] { server = HandshakeAsServer(*p.server, s); });
  ExpectChallenge(*p.client);
  ASSERT_TRUE(p.client->Send(recorded[0], Later()).ok());
  std::vector<ControlMessage> received;
  for (;;) {
    auto m = p.client->Receive(Later());
    if (!m.ok()) break;
    received.push_back(*m);
    if (std::holds_alternative<HelloAckMsg>(*m)) {
      ASSERT_TRUE(p.client->Send(recorded[1], Later()).ok());  // the Intro, in case
    }
  }
  t.join();
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kPermissionDenied) << server.status();
  EXPECT_FALSE(checked);
  ASSERT_EQ(received.size(), 1u);
  ASSERT_TRUE(std::holds_alternative<ErrorMsg>(received[0]));
  EXPECT_THAT(std::get<ErrorMsg>(received[0]).message, StartsWith("authentication failed"));
  EXPECT_FALSE(AnyContains(received, "SERVER-CACHE-DESCRIPTION"));
}

TEST(HandshakeAttackTest, APeerWithoutTheSecretLearnsNothingOfTheServersPayload) {
  // A server whose check would describe its cache in a refusal. Whatever a client without
  // the secret tries, the check never runs and nothing of the description reaches it.
  const std::string kDescription = "SERVER-CACHE-DESCRIPTION";
  HandshakeOptions s = Options(MakeHello("prefill-0", kDescription), "secret");
  s.bind_to_endpoints = false;  // the eavesdropping relay is not what is tested here
  std::atomic<int> checks{0};
  s.check = [&](const HelloMsg&) {
    ++checks;
    return absl::FailedPreconditionError(absl::StrCat("this side has ", kDescription));
  };
  std::vector<HandshakeOptions> clients;
  clients.push_back(Options(MakeHello("no-secret", "d")));
  clients.push_back(Options(MakeHello("wrong-secret", "d"), "wrong"));
  for (const HandshakeOptions& c : clients) {
    SCOPED_TRACE(c.local.engine_id);
    std::vector<ControlMessage> to_client;
    RelayedOutcome out = RunRelayed(c, s, [&](bool from_client, ControlMessage& m) {
      if (!from_client) to_client.push_back(m);
    });
    ASSERT_FALSE(out.client.ok());
    EXPECT_EQ(out.client.status().code(), absl::StatusCode::kPermissionDenied)
        << out.client.status();
    EXPECT_FALSE(AnyContains(to_client, kDescription));
    EXPECT_THAT(Msg(out.client.status()), Not(HasSubstr(kDescription)));
  }
  // Hand-played: a Hello with a nonce and a made-up tag.
  Pair p = Connect();
  ASSERT_TRUE(p.server && p.client);
  absl::StatusOr<HelloMsg> server = absl::UnknownError("not run");
  std::thread t([&] { server = HandshakeAsServer(*p.server, s); });
  ExpectChallenge(*p.client);
  HelloMsg hello;
  hello.engine_id = "guesser";
  hello.nonce.assign(32, 'n');
  hello.auth_tag.assign(32, 't');
  ASSERT_TRUE(p.client->Send(hello, Later()).ok());
  std::vector<ControlMessage> received;
  for (auto m = p.client->Receive(Later()); m.ok(); m = p.client->Receive(Later())) {
    received.push_back(*m);
  }
  t.join();
  EXPECT_EQ(server.status().code(), absl::StatusCode::kPermissionDenied) << server.status();
  EXPECT_FALSE(AnyContains(received, kDescription));
  EXPECT_EQ(checks.load(), 0);
}

TEST(HandshakeAttackTest, AClientWithASecretSaysNothingToAServerWithoutIt) {
  // A fake server that does not know the secret: it sees the client's engine id and
  // nonce, never its payload.
  const HelloMsg client_hello = MakeHello("decode-0", "CLIENT-CACHE-DESCRIPTION");
  HelloMsg seen;
  FakeServerRun run = PlayServer(Options(client_hello, "secret"),
                                 [&](const HelloMsg& h, const HandshakeBinding& b) {
                                   seen = h;
                                   HelloAckMsg ack;
                                   ack.hello.engine_id = "prefill-0";
                                   ack.hello.nonce = b.server_nonce;
                                   ack.hello.auth_tag.assign(32, 't');
                                   return ack;
                                 });
  ASSERT_FALSE(run.client.ok());
  EXPECT_EQ(run.client.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(seen.engine_id, "decode-0");
  EXPECT_TRUE(seen.payload.empty()) << seen.payload;
  ASSERT_TRUE(run.after.ok()) << run.after.status();
  ASSERT_TRUE(std::holds_alternative<ErrorMsg>(*run.after));
  EXPECT_FALSE(AnyContains({*run.after}, "CLIENT-CACHE-DESCRIPTION"));
}

TEST(HandshakeAttackTest, AnythingChangedInTransitIsDetected) {
  // An on-path middle that passes the authentication (binding off, so that the relay
  // itself is allowed) and then changes one field: each change fails verification, and
  // neither check ever sees the changed value.
  struct Case {
    const char* name;
    bool from_client;
    std::function<void(ControlMessage&)> change;
  };
  const std::vector<Case> cases = {
      {"client payload", true,
       [](ControlMessage& m) {
         if (auto* intro = std::get_if<IntroMsg>(&m)) intro->payload = LayoutPayload("X");
       }},
      {"server payload", false,
       [](ControlMessage& m) {
         if (auto* intro = std::get_if<IntroMsg>(&m)) intro->payload = LayoutPayload("X");
       }},
      {"client engine id", true,
       [](ControlMessage& m) {
         if (auto* hello = std::get_if<HelloMsg>(&m)) hello->engine_id = "decode-9";
       }},
      {"server engine id", false,
       [](ControlMessage& m) {
         if (auto* ack = std::get_if<HelloAckMsg>(&m)) ack->hello.engine_id = "prefill-9";
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> checked_payloads;
    std::vector<std::string> checked_ids;
    auto record = [&](const HelloMsg& peer) {
      checked_payloads.push_back(peer.payload);
      checked_ids.push_back(peer.engine_id);
      return absl::OkStatus();
    };
    HandshakeOptions co = Options(MakeHello("decode-0", "A"), "secret");
    HandshakeOptions so = Options(MakeHello("prefill-0", "A"), "secret");
    co.bind_to_endpoints = false;
    so.bind_to_endpoints = false;
    co.check = record;
    so.check = record;
    RelayedOutcome out = RunRelayed(co, so, [&](bool from_client, ControlMessage& m) {
      if (from_client == c.from_client) c.change(m);
    });
    ASSERT_FALSE(out.client.ok());
    EXPECT_EQ(out.client.status().code(), absl::StatusCode::kPermissionDenied)
        << out.client.status();
    // A change the client detects reaches the server after it returned: as an ErrorMsg, or
    // (when the relay closes its side before forwarding the client's last bytes) as the end
    // of the stream; either way the server gets nothing more.
    if (out.server.ok()) {
      auto next = out.server_conn->Receive(Later());
      if (next.ok()) {
        ASSERT_TRUE(std::holds_alternative<ErrorMsg>(*next));
        EXPECT_EQ(std::get<ErrorMsg>(*next).status_code,
                  static_cast<int32_t>(absl::StatusCode::kPermissionDenied));
      } else {
        EXPECT_EQ(next.status().code(), absl::StatusCode::kUnavailable) << next.status();
      }
    } else {
      EXPECT_EQ(out.server.status().code(), absl::StatusCode::kPermissionDenied)
          << out.server.status();
    }
    for (const std::string& payload : checked_payloads) EXPECT_EQ(payload, LayoutPayload("A"));
    for (const std::string& id : checked_ids) EXPECT_THAT(id, EndsWith("-0"));
  }
}

TEST(HandshakeTest, AnIntroductionOverTheLimitIsRefusedBeforeTheCheck) {
  for (const std::string secret : {"", "secret"}) {
    SCOPED_TRACE(secret);
    bool checked = false;
    HandshakeOptions s = Options(MakeHello("prefill-0", "d"), secret);
    s.max_peer_payload_bytes = 16;
    s.check = [&checked](const HelloMsg&) {
      checked = true;
      return absl::OkStatus();
    };
    Outcome out = RunHandshake(Options(MakeHello("decode-0", std::string(10, 'x')), secret), s);
    ExpectRejectedOnBothSides(out, absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(Msg(out.server.status()), HasSubstr("more than this side accepts (16)"));
    EXPECT_FALSE(checked);
  }
}

// Captures what is logged while it lives.
class CapturedLog {
 public:
  CapturedLog() {
    previous_ = SetLogSink([this](LogLevel, absl::string_view line) {
      absl::MutexLock lock(&mu_);
      lines_.emplace_back(line);
    });
  }
  ~CapturedLog() { SetLogSink(previous_); }
  std::vector<std::string> lines() {
    absl::MutexLock lock(&mu_);
    return lines_;
  }

 private:
  LogSink previous_;
  absl::Mutex mu_;
  std::vector<std::string> lines_;
};

TEST(HandshakeTest, PeerStringsAreEscapedInTheLogAndInStatuses) {
  const std::string forged = "x\n[kvstream W] forged line\r";
  CapturedLog log;
  // A peer's engine id, in our own rejection.
  Outcome wrong = RunHandshake(Options(MakeHello(forged, "d"), "wrong"),
                               Options(MakeHello("prefill-0", "d"), "secret"));
  EXPECT_EQ(wrong.server.status().code(), absl::StatusCode::kPermissionDenied);
  // A careless check quoting the peer's engine id as it came, and a refusal whose text the
  // client turns into its status.
  HandshakeOptions s = Options(MakeHello("prefill-0", "d"));
  s.check = [](const HelloMsg& peer) {
    return absl::FailedPreconditionError(absl::StrCat("no room for ", peer.engine_id));
  };
  Outcome careless = RunHandshake(Options(MakeHello(forged, "d")), s);
  EXPECT_EQ(careless.server.status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_FALSE(careless.client.ok());
  EXPECT_THAT(Msg(careless.client.status()), Not(HasSubstr("\n")));
  EXPECT_THAT(Msg(careless.client.status()), HasSubstr(absl::CHexEscape(forged)));

  const std::vector<std::string> lines = log.lines();
  ASSERT_FALSE(lines.empty());
  int quoting = 0;
  for (const std::string& line : lines) {
    SCOPED_TRACE(absl::CHexEscape(line));
    EXPECT_THAT(line, Not(HasSubstr("\n")));
    EXPECT_THAT(line, Not(HasSubstr("\r")));
    if (absl::StrContains(line, "forged line")) ++quoting;
  }
  EXPECT_GE(quoting, 2);  // both rejections were logged, escaped
}

TEST(HandshakeTest, HmacSha256MatchesRfc4231) {
  // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
  const std::string tag = HmacSha256("Jefe", "what do ya want for nothing?");
  std::string hex;
  for (unsigned char c : tag) absl::StrAppend(&hex, absl::Hex(c, absl::kZeroPad2));
  EXPECT_EQ(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(HmacSha256("", "").size(), 32u);
  EXPECT_NE(HmacSha256("a", "n"), HmacSha256("b", "n"));
}

}  // namespace
}  // namespace kvstream
