// Tests of transfer/include/kvstream/transfer/socket.h: TCP and Unix-domain listen, connect
// and accept; whole-buffer sends and receives bounded by deadlines; the non-blocking calls;
// a peer that closes; deadlines that expire; no SIGPIPE; errors that name the peer.
#include "kvstream/transfer/socket.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;

absl::Time Later() { return absl::Now() + absl::Seconds(20); }

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

std::string UniqueUnixName(absl::string_view what) {
  static int counter = 0;
  return absl::StrCat("kvstream-socket-test-", getpid(), "-", what, "-", ++counter);
}

// A connected pair: `client` from Connect*, `server` from AcceptSocket.
struct Pair {
  ScopedFd client;
  AcceptedSocket server;
};

Pair TcpPair() {
  Pair p;
  auto listener = ListenTcp("127.0.0.1", 0);
  EXPECT_TRUE(listener.ok()) << listener.status();
  if (!listener.ok()) return p;
  auto port = BoundTcpPort(listener->get());
  EXPECT_TRUE(port.ok()) << port.status();
  auto client = ConnectTcp("localhost", *port, Later());
  EXPECT_TRUE(client.ok()) << client.status();
  auto server = AcceptSocket(listener->get(), Later(), "test listener");
  EXPECT_TRUE(server.ok()) << server.status();
  if (client.ok()) p.client = std::move(client).value();
  if (server.ok()) p.server = std::move(server).value();
  return p;
}

Pair UnixPair() {
  Pair p;
  const std::string name = UniqueUnixName("pair");
  auto listener = ListenUnix(name);
  EXPECT_TRUE(listener.ok()) << listener.status();
  if (!listener.ok()) return p;
  auto client = ConnectUnix(name, Later());
  EXPECT_TRUE(client.ok()) << client.status();
  auto server = AcceptSocket(listener->get(), Later(), UnixSocketLabel(name));
  EXPECT_TRUE(server.ok()) << server.status();
  if (client.ok()) p.client = std::move(client).value();
  if (server.ok()) p.server = std::move(server).value();
  return p;
}

class SocketPairTest : public ::testing::TestWithParam<std::string> {
 protected:
  Pair Make() { return GetParam() == "tcp" ? TcpPair() : UnixPair(); }
};

TEST_P(SocketPairTest, SendAllAndRecvAllMoveEveryByteBothWays) {
  Pair p = Make();
  ASSERT_TRUE(p.client.valid() && p.server.fd.valid());
  // Larger than any socket buffer, so both calls must wait for the other side.
  const std::string data = RandomBytes(8 << 20, 1);
  std::string got(data.size(), '\0');
  absl::Status recv_status;
  std::thread reader([&] {
    recv_status = RecvAll(p.server.fd.get(), got.data(), got.size(), Later(), p.server.peer);
  });
  size_t sent = 0;
  EXPECT_TRUE(SendAll(p.client.get(), data, Later(), "server", &sent).ok());
  reader.join();
  EXPECT_TRUE(recv_status.ok()) << recv_status;
  EXPECT_EQ(sent, data.size());
  EXPECT_TRUE(got == data);

  const std::string back = "reply";
  ASSERT_TRUE(SendAll(p.server.fd.get(), back, Later(), p.server.peer).ok());
  std::string reply(back.size(), '\0');
  size_t n = 0;
  ASSERT_TRUE(RecvAll(p.client.get(), reply.data(), reply.size(), Later(), "server", &n).ok());
  EXPECT_EQ(n, back.size());
  EXPECT_EQ(reply, back);
}

TEST_P(SocketPairTest, RecvAllStopsAtTheDeadlineAndCountsWhatCame) {
  Pair p = Make();
  ASSERT_TRUE(p.client.valid() && p.server.fd.valid());
  char buf[16];
  size_t got = 99;
  absl::Status none = RecvAll(p.server.fd.get(), buf, sizeof(buf),
                              absl::Now() + absl::Milliseconds(50), "the client", &got);
  EXPECT_EQ(none.code(), absl::StatusCode::kDeadlineExceeded) << none;
  EXPECT_THAT(none.message(), HasSubstr("the client"));
  EXPECT_EQ(got, 0u);
  // A deadline already passed still reads what is there.
  ASSERT_TRUE(SendAll(p.client.get(), "abcd", Later(), "server").ok());
  absl::Status partial =
      RecvAll(p.server.fd.get(), buf, sizeof(buf), absl::InfinitePast(), "the client", &got);
  EXPECT_EQ(partial.code(), absl::StatusCode::kDeadlineExceeded) << partial;
  EXPECT_EQ(got, 4u);
  EXPECT_EQ(std::string(buf, 4), "abcd");
  EXPECT_THAT(partial.message(), HasSubstr("4 of 16"));
}

TEST_P(SocketPairTest, PeerCloseIsUnavailableNamingThePeer) {
  Pair p = Make();
  ASSERT_TRUE(p.client.valid() && p.server.fd.valid());
  ASSERT_TRUE(SendAll(p.client.get(), "xy", Later(), "server").ok());
  p.client.Reset();
  char buf[8];
  size_t got = 0;
  absl::Status status = RecvAll(p.server.fd.get(), buf, sizeof(buf), Later(), "peer 7", &got);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(status.message(), HasSubstr("peer 7 closed the connection after 2 of 8 bytes"));
  EXPECT_EQ(got, 2u);
  // RecvSome reports the end of stream the same way.
  auto more = RecvSome(p.server.fd.get(), buf, sizeof(buf), "peer 7");
  EXPECT_EQ(more.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(more.status().message(), HasSubstr("peer 7 closed the connection"));
  // Or as a value, when the caller asks for it.
  bool eof = false;
  auto at_end = RecvSome(p.server.fd.get(), buf, sizeof(buf), "peer 7", &eof);
  ASSERT_TRUE(at_end.ok()) << at_end.status();
  EXPECT_EQ(*at_end, 0u);
  EXPECT_TRUE(eof);
}

TEST_P(SocketPairTest, WritingToAClosedPeerFailsWithoutSigpipe) {
  Pair p = Make();
  ASSERT_TRUE(p.client.valid() && p.server.fd.valid());
  p.server.fd.Reset();
  // The first writes may still be buffered; within a few the peer's reset shows. A SIGPIPE
  // would kill this test program.
  absl::Status status;
  const std::string chunk(64 << 10, 'z');
  for (int i = 0; i < 100 && status.ok(); ++i) {
    status = SendAll(p.client.get(), chunk, Later(), "the gone server");
  }
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(status.message(), HasSubstr("the gone server"));
}

TEST_P(SocketPairTest, NonBlockingCallsNeverWait) {
  Pair p = Make();
  ASSERT_TRUE(p.client.valid() && p.server.fd.valid());
  char buf[64];
  bool eof = true;
  auto nothing = RecvSome(p.server.fd.get(), buf, sizeof(buf), "client", &eof);
  ASSERT_TRUE(nothing.ok()) << nothing.status();
  EXPECT_EQ(*nothing, 0u);
  EXPECT_FALSE(eof);
  // Nobody reads: the socket fills and SendSome returns a short count, then 0.
  const std::string big(64 << 20, 'q');
  auto first = SendSome(p.client.get(), big, "server");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_GT(*first, 0u);
  EXPECT_LT(*first, big.size());
  auto full = SendSome(p.client.get(), big, "server");
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(*full, 0u);
  // SendAll waits no longer than its deadline and says how far it got.
  size_t sent = 0;
  absl::Status late =
      SendAll(p.client.get(), big, absl::Now() + absl::Milliseconds(50), "server", &sent);
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  EXPECT_LT(sent, big.size());
  EXPECT_THAT(late.message(), HasSubstr("server"));
  // What was written arrives in order.
  auto some = RecvSome(p.server.fd.get(), buf, sizeof(buf), "client");
  ASSERT_TRUE(some.ok());
  EXPECT_EQ(*some, sizeof(buf));
  EXPECT_EQ(std::string(buf, sizeof(buf)), std::string(sizeof(buf), 'q'));
}

INSTANTIATE_TEST_SUITE_P(Kinds, SocketPairTest, ::testing::Values("tcp", "unix"),
                         [](const ::testing::TestParamInfo<std::string>& param) {
                           return param.param;
                         });

TEST(SocketTest, TcpConnectToNobodyIsRefusedNamingTheAddress) {
  auto listener = ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok());
  auto port = BoundTcpPort(listener->get());
  ASSERT_TRUE(port.ok());
  listener->Reset();
  auto conn = ConnectTcp("127.0.0.1", *port, Later());
  ASSERT_FALSE(conn.ok());
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(conn.status().message(), HasSubstr("refused"));
  EXPECT_THAT(conn.status().message(), HasSubstr(absl::StrCat("127.0.0.1:", *port)));
}

TEST(SocketTest, TcpBadHostsAndPortsAreInvalidArguments) {
  EXPECT_EQ(ListenTcp("example.com", 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConnectTcp("300.1.1.1", 5, Later()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConnectTcp("127.0.0.1", 0, Later()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SocketTest, TcpPortInUseIsUnavailable) {
  auto first = ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(first.ok());
  auto port = BoundTcpPort(first->get());
  ASSERT_TRUE(port.ok());
  auto second = ListenTcp("127.0.0.1", *port);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("in use"));
  EXPECT_THAT(second.status().message(), HasSubstr(absl::StrCat("127.0.0.1:", *port)));
}

TEST(SocketTest, AcceptWithNothingPendingStopsAtTheDeadline) {
  auto listener = ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(listener.ok());
  auto none = AcceptSocket(listener->get(), absl::InfinitePast(), "idle listener");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(none.status().message(), HasSubstr("idle listener"));
  const absl::Time start = absl::Now();
  none = AcceptSocket(listener->get(), start + absl::Milliseconds(30), "idle listener");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now(), start + absl::Milliseconds(30));
}

TEST(SocketTest, UnixAcceptReportsTheConnectingProcess) {
  Pair p = UnixPair();
  ASSERT_TRUE(p.server.fd.valid());
  EXPECT_EQ(p.server.pid, static_cast<int>(getpid()));
  EXPECT_EQ(p.server.uid, static_cast<int>(getuid()));
  EXPECT_THAT(p.server.peer, HasSubstr("unix:@kvstream-socket-test-"));
}

TEST(SocketTest, UnixNamesAreCheckedAndUnique) {
  EXPECT_EQ(ListenUnix("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ListenUnix(std::string(kMaxUnixSocketNameBytes + 1, 'n')).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ListenUnix(std::string("a\0b", 3)).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string name = UniqueUnixName("taken");
  auto first = ListenUnix(name);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ListenUnix(name);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr(UnixSocketLabel(name)));
  // The abstract name is released with its descriptor.
  first->Reset();
  EXPECT_TRUE(ListenUnix(name).ok());
}

TEST(SocketTest, UnixConnectToNobodyIsRefused) {
  const std::string name = UniqueUnixName("nobody");
  auto conn = ConnectUnix(name, Later());
  ASSERT_FALSE(conn.ok());
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(conn.status().message(), HasSubstr("refused"));
  EXPECT_THAT(conn.status().message(), HasSubstr(name));
}

TEST(SocketTest, SocketErrorCodes) {
  EXPECT_EQ(SocketError(ECONNRESET, "recv from", "p").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(SocketError(EMFILE, "socket for", "p").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(SocketError(EBADF, "send to", "p").code(), absl::StatusCode::kInternal);
  absl::Status s = SocketError(ECONNREFUSED, "connect to", "10.0.0.1:80");
  EXPECT_THAT(s.message(), HasSubstr("connect to 10.0.0.1:80: "));
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("errno ", ECONNREFUSED)));
}

}  // namespace
}  // namespace kvstream
