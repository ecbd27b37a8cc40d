// Tests of the Prometheus exposition: per-peer series labelled with role, engine and peer,
// cumulative latency buckets, escaped label values, and the HTTP endpoint.
#include "launch/metrics_server.h"

#include <poll.h>
#include <sys/socket.h>

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvstream/transfer/socket.h"

namespace kvstream {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using ::testing::Not;

std::vector<PeerConnectorStats> TwoPeers() {
  PeerConnectorStats a;
  a.peer = "decode-0-pp0";
  a.stats.bytes_sent = 1000;
  a.stats.layers_sent = 4;
  a.stats.ObserveLatency(0.05);  // bucket le=0.0001 s
  a.stats.ObserveLatency(3);     // le=0.005
  a.stats.ObserveLatency(5000);  // +Inf
  a.stats.exposed_ms = 1.5;
  a.stats.blocks_in_flight = 6;
  PeerConnectorStats b;
  b.peer = "odd \"peer\"\\name";
  b.stats.bytes_sent = 3000;
  b.stats.layers_sent = 12;
  b.stats.load_errors = 2;
  b.stats.send_failures = 1;
  return {a, b};
}

TEST(RenderConnectorMetricsTest, SeriesPerPeerWithRoleEngineAndPeer) {
  const std::string text = RenderConnectorMetrics(TwoPeers(), "kv_producer", "prefill-0");
  const std::string a = R"(role="kv_producer",engine="prefill-0",peer="decode-0-pp0")";
  const std::string b = R"(role="kv_producer",engine="prefill-0",peer="odd \"peer\"\\name")";
  for (const std::string& line : std::vector<std::string>{
           "kvstream_transfer_bytes_total{" + a + ",direction=\"sent\"} 1000\n",
           "kvstream_transfer_bytes_total{" + b + ",direction=\"sent\"} 3000\n",
           "kvstream_layers_transferred_total{" + a + ",direction=\"sent\"} 4\n",
           "kvstream_layers_transferred_total{" + b + ",direction=\"received\"} 0\n",
           "kvstream_exposed_transfer_seconds_total{" + a + "} 0.001500\n",
           "kvstream_load_errors_total{" + b + "} 2\n",
           "kvstream_send_failures_total{" + b + "} 1\n",
           "kvstream_blocks_in_flight{" + a + "} 6\n",
           "kvstream_layer_transfer_latency_seconds_bucket{" + a + ",le=\"0.0001\"} 1\n",
           "kvstream_layer_transfer_latency_seconds_bucket{" + a + ",le=\"0.005\"} 2\n",
           "kvstream_layer_transfer_latency_seconds_bucket{" + a + ",le=\"1\"} 2\n",
           "kvstream_layer_transfer_latency_seconds_bucket{" + a + ",le=\"+Inf\"} 3\n",
           "kvstream_layer_transfer_latency_seconds_count{" + a + "} 3\n",
           "kvstream_layer_transfer_latency_seconds_sum{" + a + "} 5.003050\n",
           "kvstream_layer_transfer_latency_seconds_count{" + b + "} 0\n",
           "# TYPE kvstream_layer_transfer_latency_seconds histogram\n",
           "# TYPE kvstream_blocks_in_flight gauge\n",
       }) {
    EXPECT_THAT(text, HasSubstr(line));
  }
  // A consumer's series carry its own role.
  const std::string consumer = RenderConnectorMetrics(TwoPeers(), "kv_consumer", "decode-0");
  EXPECT_THAT(consumer, HasSubstr("kvstream_load_errors_total{role=\"kv_consumer\","
                                  "engine=\"decode-0\",peer=\"decode-0-pp0\"} 0"));
  // Before any peer: the families, no samples.
  const std::string empty = RenderConnectorMetrics({}, "kv_consumer", "decode-0");
  EXPECT_THAT(empty, HasSubstr("# TYPE kvstream_transfer_bytes_total counter"));
  EXPECT_THAT(empty, Not(HasSubstr("{")));
}

// What arrives on `fd` until the server closes it, then what went wrong if anything did; a
// missing end stops at the deadline instead of hanging the test.
std::string ReadToEnd(int fd, absl::Time deadline) {
  std::string out;
  std::vector<char> buf(1 << 16);
  for (;;) {
    absl::StatusOr<bool> ready = WaitFd(fd, POLLIN, deadline, "metrics answer");
    if (!ready.ok() || !*ready) return out + "<no end before the deadline>";
    bool eof = false;
    absl::StatusOr<size_t> n = RecvSome(fd, buf.data(), buf.size(), "the metrics server", &eof);
    if (!n.ok()) return out + std::string(n.status().message());
    if (eof) return out;
    out.append(buf.data(), *n);
  }
}

// The whole answer to "GET <path>", or what went wrong.
std::string Get(int port, const std::string& path,
                absl::Time deadline = absl::Now() + absl::Seconds(30)) {
  absl::StatusOr<ScopedFd> fd = ConnectTcp("127.0.0.1", static_cast<uint16_t>(port), deadline);
  if (!fd.ok()) return std::string(fd.status().message());
  const absl::Status sent =
      SendAll(fd->get(), "GET " + path + " HTTP/1.0\r\n\r\n", deadline, "the metrics server");
  if (!sent.ok()) return std::string(sent.message());
  return ReadToEnd(fd->get(), deadline);
}

TEST(MetricsServerTest, ServesTheRenderedTextOnMetricsOnly) {
  auto server = MetricsServer::Start(0, [] {
    return RenderConnectorMetrics(TwoPeers(), "kv_producer", "prefill-0");
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string ok = Get((*server)->port(), "/metrics");
  EXPECT_THAT(ok, HasSubstr("HTTP/1.0 200 OK"));
  EXPECT_THAT(ok, HasSubstr(R"(peer="decode-0-pp0",direction="sent"} 1000)"));
  const std::string body = RenderConnectorMetrics(TwoPeers(), "kv_producer", "prefill-0");
  EXPECT_THAT(ok, EndsWith(absl::StrCat("Content-Length: ", body.size(), "\r\n\r\n", body)));
  EXPECT_THAT(Get((*server)->port(), "/other"), HasSubstr("404"));
}

TEST(MetricsServerTest, ATakenPortOrABadOneIsRefused) {
  auto first = MetricsServer::Start(0, [] { return std::string(); });
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = MetricsServer::Start((*first)->port(), [] { return std::string(); });
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(),
              HasSubstr(absl::StrCat("metrics endpoint on port ", (*first)->port())));
  EXPECT_EQ(MetricsServer::Start(65536, [] { return std::string(); }).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Clients that send nothing, or never read their answer, are dropped at the client
// deadlines: the next scrape is still answered (the server serves one client at a time).
TEST(MetricsServerTest, StalledClientsDoNotHoldTheServer) {
  // 16 MiB: far more than the non-reading client's socket buffers hold (its receive buffer
  // is held small below), and little enough for the scrape that reads to take all of it
  // within the server's write deadline on a loaded machine.
  const std::string big(size_t{16} << 20, '#');
  auto server = MetricsServer::Start(0, [&] { return big; });
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = static_cast<uint16_t>((*server)->port());
  const absl::Time later = absl::Now() + absl::Seconds(30);

  absl::StatusOr<ScopedFd> silent = ConnectTcp("127.0.0.1", port, later);
  ASSERT_TRUE(silent.ok()) << silent.status();
  absl::StatusOr<ScopedFd> not_reading = ConnectTcp("127.0.0.1", port, later);
  ASSERT_TRUE(not_reading.ok()) << not_reading.status();
  const int small = 64 << 10;
  ASSERT_EQ(setsockopt(not_reading->get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)), 0);
  ASSERT_TRUE(SendAll(not_reading->get(), "GET /metrics HTTP/1.0\r\n\r\n", later, "server").ok());

  const std::string answer = Get(port, "/metrics", later);
  EXPECT_THAT(answer, StartsWith("HTTP/1.0 200 OK"));
  EXPECT_EQ(answer.size(), answer.find("\r\n\r\n") + 4 + big.size());
  // The silent client got the 404 for an empty request, and the one that did not read was
  // cut off before the end of its answer.
  EXPECT_EQ(ReadToEnd(silent->get(), later),
            "HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n");
  EXPECT_LT(ReadToEnd(not_reading->get(), later).size(), answer.size());
}

}  // namespace
}  // namespace kvstream
