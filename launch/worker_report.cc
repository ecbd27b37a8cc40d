// The JSON reports of `kvstream worker` (worker.h): the connector's counters and a prefill
// worker's requests.
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "worker.h"

namespace kvstream {

nlohmann::json ConnectorStatsJson(const ConnectorStats& s,
                                  const std::vector<PeerConnectorStats>& peers) {
  nlohmann::json buckets = nlohmann::json::array();
  uint64_t count = 0;
  for (int b = 0; b < ConnectorStats::kLatencyBuckets; ++b) {
    count += s.latency_counts[b];
    nlohmann::json le = b + 1 < ConnectorStats::kLatencyBuckets
                            ? nlohmann::json(ConnectorStats::kLatencyBucketsMs[b])
                            : nlohmann::json("+Inf");
    buckets.push_back({{"le_ms", le}, {"count", count}});  // cumulative, as in Prometheus
  }
  nlohmann::json j = {{"bytes_sent", s.bytes_sent},
                      {"bytes_received", s.bytes_received},
                      {"layers_sent", s.layers_sent},
                      {"layers_received", s.layers_received},
                      {"load_errors", s.load_errors},
                      {"handshakes", s.handshakes},
                      {"handshake_failures", s.handshake_failures},
                      {"send_failures", s.send_failures},
                      {"wait_ms", s.wait_ms},
                      {"exposed_transfer_ms", s.exposed_ms},
                      {"blocks_in_flight", s.blocks_in_flight},
                      {"layer_latency_sum_ms", s.latency_sum_ms},
                      {"layer_latency_count", count},
                      {"layer_latency_buckets", buckets}};
  if (!peers.empty()) {
    nlohmann::json by_peer = nlohmann::json::object();
    for (const PeerConnectorStats& p : peers) by_peer[p.peer] = ConnectorStatsJson(p.stats);
    j["peers"] = by_peer;
  }
  return j;
}

nlohmann::json PrefillReportJson(const std::vector<RequestResult>& served,
                                 const std::map<std::string, RequestSendStats>& sends,
                                 const ConnectorStats& stats,
                                 const std::vector<PeerConnectorStats>& peers) {
  nlohmann::json requests = nlohmann::json::array();
  for (const RequestResult& r : served) {
    nlohmann::json j = {{"id", r.id},
                        {"prompt_tokens", r.prompt_tokens},
                        {"prefill_ms", r.prefill_ms},
                        {"prefill_start_ns", r.prefill_start_ns},
                        {"status", r.status.ToString()}};
    const auto t = sends.find(r.id);
    if (t != sends.end()) {
      j["consumer_request_id"] = t->second.consumer_request_id;
      j["sent_ok"] = t->second.ok;
      j["bytes_sent"] = t->second.bytes;
      j["layer_ready_ns"] = t->second.layer_ready_ns;
      j["layer_sent_ns"] = t->second.layer_sent_ns;
    }
    requests.push_back(std::move(j));
  }
  return {{"role", "prefill"},
          {"requests", std::move(requests)},
          {"connector", ConnectorStatsJson(stats, peers)}};
}

}  // namespace kvstream
