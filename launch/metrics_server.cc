// The metrics endpoint (metrics_server.h).
#include "metrics_server.h"

#include <poll.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "kvstream/common/logging.h"

namespace kvstream {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    int port, std::function<std::string()> render) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics endpoint: port ", port, " is outside 0..65535"));
  }
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  s->render_ = std::move(render);
  absl::StatusOr<ScopedFd> listener = ListenTcp("0.0.0.0", static_cast<uint16_t>(port), 16);
  if (!listener.ok()) {
    return absl::Status(listener.status().code(),
                        absl::StrCat("metrics endpoint on port ", port, ": ",
                                     listener.status().message()));
  }
  s->listener_ = std::move(*listener);
  absl::StatusOr<uint16_t> bound = BoundTcpPort(s->listener_.get());
  if (!bound.ok()) return bound.status();
  s->port_ = *bound;
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

MetricsServer::~MetricsServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void MetricsServer::Loop() {
  while (!stop_) {
    absl::StatusOr<AcceptedSocket> client =
        AcceptSocket(listener_.get(), absl::Now() + kAcceptPoll, "the metrics endpoint");
    if (absl::IsDeadlineExceeded(client.status())) continue;
    if (!client.ok()) {
      // Out of descriptors, say: say so, and wait rather than spin on a listener that
      // stays readable.
      Log(LogLevel::kWarning, absl::StrCat("metrics endpoint: ", client.status().message()));
      absl::SleepFor(kAcceptPoll);
      continue;
    }
    Serve(client->fd.get(), client->peer);
  }
}

void MetricsServer::Serve(int fd, const std::string& peer) {
  // The request head, bounded in size and time; whatever came is answered (a client that
  // closed or stalled early gets a 404 it may not read).
  const absl::Time read_deadline = absl::Now() + kClientReadTimeout;
  std::string request;
  char buf[1024];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    absl::StatusOr<bool> ready = WaitFd(fd, POLLIN, read_deadline, "metrics request");
    if (!ready.ok() || !*ready) break;
    bool eof = false;
    absl::StatusOr<size_t> n = RecvSome(fd, buf, sizeof(buf), peer, &eof);
    if (!n.ok() || eof) break;
    request.append(buf, *n);
  }
  std::string response;
  if (request.rfind("GET /metrics", 0) == 0) {
    const std::string body = render_();
    response = absl::StrCat("HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                            "Content-Length: ", body.size(), "\r\n\r\n", body);
  } else {
    response = "HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n";
  }
  // A client that does not read its answer is dropped at the deadline (the error is its).
  SendAll(fd, response, absl::Now() + kClientWriteTimeout, peer).IgnoreError();
}

namespace {

// A label value in Prometheus text format: backslash, quote and newline escaped.
std::string LabelValue(absl::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string RenderConnectorMetrics(const std::vector<PeerConnectorStats>& peers,
                                   const std::string& role, const std::string& engine_id) {
  std::vector<std::string> labels;  // per peer
  for (const PeerConnectorStats& p : peers) {
    labels.push_back(absl::StrCat("role=\"", LabelValue(role), "\",engine=\"",
                                  LabelValue(engine_id), "\",peer=\"", LabelValue(p.peer), "\""));
  }
  std::string out;
  auto metric = [&](const char* name, const char* type, const char* help) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  };
  metric("kvstream_transfer_bytes_total", "counter", "KV bytes moved, by direction and peer");
  for (size_t i = 0; i < peers.size(); ++i) {
    const ConnectorStats& s = peers[i].stats;
    absl::StrAppend(&out, "kvstream_transfer_bytes_total{", labels[i], ",direction=\"sent\"} ",
                    s.bytes_sent, "\nkvstream_transfer_bytes_total{", labels[i],
                    ",direction=\"received\"} ", s.bytes_received, "\n");
  }
  metric("kvstream_layers_transferred_total", "counter",
         "Layer transfers completed, by direction and peer");
  for (size_t i = 0; i < peers.size(); ++i) {
    const ConnectorStats& s = peers[i].stats;
    absl::StrAppend(&out, "kvstream_layers_transferred_total{", labels[i],
                    ",direction=\"sent\"} ", s.layers_sent,
                    "\nkvstream_layers_transferred_total{", labels[i], ",direction=\"received\"} ",
                    s.layers_received, "\n");
  }
  metric("kvstream_exposed_transfer_seconds_total", "counter",
         "Time attention waited for layers already in flight (not hidden by prefill compute)");
  for (size_t i = 0; i < peers.size(); ++i) {
    absl::StrAppend(&out, "kvstream_exposed_transfer_seconds_total{", labels[i], "} ",
                    absl::StrFormat("%.6f", peers[i].stats.exposed_ms / 1e3), "\n");
  }
  metric("kvstream_layer_wait_seconds_total", "counter",
         "Time attention waited for remote layers the peer still owed");
  for (size_t i = 0; i < peers.size(); ++i) {
    absl::StrAppend(&out, "kvstream_layer_wait_seconds_total{", labels[i], "} ",
                    absl::StrFormat("%.6f", peers[i].stats.wait_ms / 1e3), "\n");
  }
  metric("kvstream_load_errors_total", "counter", "Requests whose remote KV failed to load");
  for (size_t i = 0; i < peers.size(); ++i) {
    absl::StrAppend(&out, "kvstream_load_errors_total{", labels[i], "} ",
                    peers[i].stats.load_errors, "\n");
  }
  metric("kvstream_handshake_failures_total", "counter",
         "Links to a producer that could not be made (no answer, refused, rejected, incompatible)");
  for (size_t i = 0; i < peers.size(); ++i) {
    absl::StrAppend(&out, "kvstream_handshake_failures_total{", labels[i], "} ",
                    peers[i].stats.handshake_failures, "\n");
  }
  metric("kvstream_handshakes_total", "counter", "Links to a producer made");
  for (size_t i = 0; i < peers.size(); ++i) {
    absl::StrAppend(&out, "kvstream_handshakes_total{", labels[i], "} ",
                    peers[i].stats.handshakes, "\n");
  }
  metric("kvstream_send_failures_total", "counter", "Requests whose KV sends failed");
  for (size_t i = 0; i < peers.size(); ++i) {
    absl::StrAppend(&out, "kvstream_send_failures_total{", labels[i], "} ",
                    peers[i].stats.send_failures, "\n");
  }
  metric("kvstream_blocks_in_flight", "gauge", "Blocks of requests still being sent or received");
  for (size_t i = 0; i < peers.size(); ++i) {
    absl::StrAppend(&out, "kvstream_blocks_in_flight{", labels[i], "} ",
                    peers[i].stats.blocks_in_flight, "\n");
  }
  metric("kvstream_layer_transfer_latency_seconds", "histogram",
         "Per-layer transfer latency (post to completion or arrival)");
  for (size_t i = 0; i < peers.size(); ++i) {
    const ConnectorStats& s = peers[i].stats;
    uint64_t cumulative = 0;
    for (int b = 0; b < ConnectorStats::kLatencyBuckets; ++b) {
      cumulative += s.latency_counts[b];
      const std::string le = b + 1 < ConnectorStats::kLatencyBuckets
                                 ? absl::StrFormat("%g", ConnectorStats::kLatencyBucketsMs[b] / 1e3)
                                 : "+Inf";
      absl::StrAppend(&out, "kvstream_layer_transfer_latency_seconds_bucket{", labels[i],
                      ",le=\"", le, "\"} ", cumulative, "\n");
    }
    absl::StrAppend(&out, "kvstream_layer_transfer_latency_seconds_sum{", labels[i], "} ",
                    absl::StrFormat("%.6f", s.latency_sum_ms / 1e3),
                    "\nkvstream_layer_transfer_latency_seconds_count{", labels[i], "} ",
                    cumulative, "\n");
  }
  return out;
}

}  // namespace kvstream
