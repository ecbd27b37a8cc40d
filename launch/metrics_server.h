// A minimal HTTP endpoint serving Prometheus text exposition (GET /metrics) from a render
// callback, on a background thread. Off unless a worker is given --metrics-port.
//
// One client at a time, HTTP/1.0: the request head is read (at most kMaxRequestBytes, for at
// most kClientReadTimeout), the answer written (for at most kClientWriteTimeout), the
// connection closed. A client that stalls therefore delays the next scrape by a bounded time
// and never holds the server; the sockets are kvstream/transfer/socket.h's.
#ifndef KVSTREAM_LAUNCH_METRICS_SERVER_H_
#define KVSTREAM_LAUNCH_METRICS_SERVER_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvstream/connector/connector_stats.h"
#include "kvstream/transfer/socket.h"

namespace kvstream {

class MetricsServer {
 public:
  static constexpr size_t kMaxRequestBytes = 8192;
  static constexpr absl::Duration kClientReadTimeout = absl::Seconds(1);
  static constexpr absl::Duration kClientWriteTimeout = absl::Seconds(2);

  // Listens on 0.0.0.0:port (0 = any free port) and serves until destroyed. `render` is
  // called on the server's thread, once per GET /metrics. Unavailable when the port is
  // taken; InvalidArgument for a port outside 0..65535.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      int port, std::function<std::string()> render);
  // Stops the thread (within about kAcceptPoll, or the client deadlines of a request being
  // answered) and closes the socket.
  ~MetricsServer();
  int port() const { return port_; }

 private:
  // How often the thread looks at stop_ while no client connects.
  static constexpr absl::Duration kAcceptPoll = absl::Milliseconds(100);

  MetricsServer() = default;
  void Loop();
  // Reads one request from `fd` and answers it.
  void Serve(int fd, const std::string& peer);

  ScopedFd listener_;
  int port_ = 0;
  std::function<std::string()> render_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The connector's counters per peer (KvConnectorWorker::peer_stats) in Prometheus text format,
// every sample labelled role="kv_producer|kv_consumer" (this worker's), engine="<this
// worker's engine id>" and peer="<the peer's engine id>". Before any peer was seen the
// families are declared (HELP, TYPE) without samples.
std::string RenderConnectorMetrics(const std::vector<PeerConnectorStats>& peers,
                                   const std::string& role, const std::string& engine_id);

}  // namespace kvstream

#endif  // KVSTREAM_LAUNCH_METRICS_SERVER_H_
