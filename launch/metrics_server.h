// A minimal HTTP endpoint serving Prometheus text exposition (GET /metrics) from a render
// callback, on a background thread. Off unless a worker is given --metrics-port.
#ifndef KVSTREAM_LAUNCH_METRICS_SERVER_H_
#define KVSTREAM_LAUNCH_METRICS_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "kvstream/connector/connector_stats.h"

namespace kvstream {

class MetricsServer {
 public:
  // Listens on 0.0.0.0:port (0 = any free port). Unavailable when the port is taken.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      int port, std::function<std::string()> render);
  ~MetricsServer();
  int port() const { return port_; }

 private:
  MetricsServer() = default;
  void Loop();

  int fd_ = -1;
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
