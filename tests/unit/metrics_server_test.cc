// Tests of the Prometheus exposition: per-peer series labelled with role, engine and peer,
// cumulative latency buckets, escaped label values, and the HTTP endpoint.
#include "launch/metrics_server.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvstream {
namespace {

using ::testing::HasSubstr;
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

std::string Get(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = "GET " + path + " HTTP/1.0\r\n\r\n";
    if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
        static_cast<ssize_t>(request.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return out;
}

TEST(MetricsServerTest, ServesTheRenderedTextOnMetricsOnly) {
  auto server = MetricsServer::Start(0, [] {
    return RenderConnectorMetrics(TwoPeers(), "kv_producer", "prefill-0");
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string ok = Get((*server)->port(), "/metrics");
  EXPECT_THAT(ok, HasSubstr("HTTP/1.0 200 OK"));
  EXPECT_THAT(ok, HasSubstr(R"(peer="decode-0-pp0",direction="sent"} 1000)"));
  EXPECT_THAT(Get((*server)->port(), "/other"), HasSubstr("404"));
}

}  // namespace
}  // namespace kvstream
