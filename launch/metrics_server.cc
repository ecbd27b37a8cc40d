// The metrics endpoint (metrics_server.h).
#include "metrics_server.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvstream {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    int port, std::function<std::string()> render) {
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  s->render_ = std::move(render);
  s->fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s->fd_ < 0) return absl::InternalError(absl::StrCat("metrics socket: ", std::strerror(errno)));
  const int one = 1;
  setsockopt(s->fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(s->fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(s->fd_, 16) != 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics endpoint on port ", port, ": ", std::strerror(errno)));
  }
  socklen_t len = sizeof(addr);
  getsockname(s->fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  s->port_ = ntohs(addr.sin_port);
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

MetricsServer::~MetricsServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) close(fd_);
}

void MetricsServer::Loop() {
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const int c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    // Read the request line (bounded in size and time), answer, close.
    std::string request;
    char buf[1024];
    pollfd cp{c, POLLIN, 0};
    while (request.find("\r\n\r\n") == std::string::npos && request.size() < 8192 &&
           poll(&cp, 1, 1000) > 0) {
      const ssize_t n = recv(c, buf, sizeof(buf), 0);
      if (n <= 0) break;
      request.append(buf, static_cast<size_t>(n));
    }
    std::string response;
    if (request.rfind("GET /metrics", 0) == 0) {
      const std::string body = render_();
      response = absl::StrCat("HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                              "Content-Length: ", body.size(), "\r\n\r\n", body);
    } else {
      response = "HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n";
    }
    size_t off = 0;
    while (off < response.size()) {
      const ssize_t n = send(c, response.data() + off, response.size() - off, MSG_NOSIGNAL);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    close(c);
  }
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
