// What a connector's worker side moved, for reports and metrics.
#ifndef KVSTREAM_CONNECTOR_CONNECTOR_STATS_H_
#define KVSTREAM_CONNECTOR_CONNECTOR_STATS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace kvstream {

struct ConnectorStats {
  uint64_t bytes_sent = 0;       // producer: bytes of layers whose transfer completed
  uint64_t layers_sent = 0;
  uint64_t bytes_received = 0;   // consumer: bytes of layers that arrived and verified
  uint64_t layers_received = 0;
  uint64_t load_errors = 0;
  uint64_t send_failures = 0;
  double wait_ms = 0;            // consumer: time BeforeAttention blocked
  double exposed_ms = 0;         // consumer: of which layers were already in flight
  int64_t blocks_in_flight = 0;  // blocks of requests still being sent or received
  // Control connections served right now (one thread each; totals only, 0 per peer) and
  // those refused because max_connections were being served.
  int64_t control_connections = 0;
  uint64_t connections_refused = 0;
  // Consumer: links to producers made (connect and handshake succeeded), and attempts that
  // failed (no answer, refused, rejected handshake, incompatible peer). Failures with no
  // success at all mean disaggregation is not happening.
  uint64_t handshakes = 0;
  uint64_t handshake_failures = 0;
  // Per-layer transfer latency (producer: post to completion; consumer: post to verified
  // arrival, same-host clocks), as a histogram over kLatencyBucketsMs (+Inf last).
  static constexpr double kLatencyBucketsMs[] = {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 1000};
  static constexpr int kLatencyBuckets = sizeof(kLatencyBucketsMs) / sizeof(double) + 1;
  uint64_t latency_counts[kLatencyBuckets] = {};  // non-cumulative
  double latency_sum_ms = 0;
  void ObserveLatency(double ms) {
    int b = 0;
    while (b < kLatencyBuckets - 1 && ms > kLatencyBucketsMs[b]) ++b;
    ++latency_counts[b];
    latency_sum_ms += ms;
  }
};

// The counters of the traffic with one peer. On a producer the peers are its consumers, on
// a consumer its producers, named by the engine id they gave at handshake (or by their
// control address while no handshake succeeded).
struct PeerConnectorStats {
  std::string peer;
  ConnectorStats stats;
};

// Consumer: one request's transfer, once all its layers arrived.
struct RequestTransferStats {
  std::string request_id;
  uint64_t bytes = 0;
  std::vector<double> layer_arrival_ms;  // per layer index, ms after the hand-off
  double wait_ms = 0;                    // time BeforeAttention blocked while it waited
  // Sum over layers of (arrival - post) on one host's monotonic clock: the time the bytes
  // spent in flight (meaningless across hosts).
  double transfer_ms = 0;
  // The part of wait_ms spent on layers already posted and in flight: transfer time the
  // prefill compute did not hide.
  double exposed_ms = 0;
  // Per layer index, arrival - post (ms, one host's monotonic clock; 0 where unknown). The
  // last layer's is the transfer no prefill compute can hide: it starts when the producer's
  // last layer has been computed.
  std::vector<double> layer_in_flight_ms;
  // The hand-off on the host's monotonic clock (monotonic_clock.h): layer l arrived at
  // handoff_ns + layer_arrival_ms[l] * 1e6, comparable with a producer's RequestSendStats on
  // the same host.
  uint64_t handoff_ns = 0;
  // Ms after the hand-off when every layer had arrived and been verified (0: it did not).
  double complete_ms = 0;
};

// Producer: one request's sends to its consumers, once they all ended.
struct RequestSendStats {
  std::string request_id;           // the engine's id for it
  std::string consumer_request_id;  // the consumer's own
  bool ok = true;                   // false: the request failed or was stopped
  uint64_t bytes = 0;               // of the layers sent
  // Per layer index, on the host's monotonic clock (monotonic_clock.h), 0 where unknown:
  // when the layer was ready to send (device caches: when the progress loop first saw the
  // event after its cache update and checksum complete, within one loop period, tens of
  // microseconds; host caches: the post), and when its transfer completed, as the producer
  // saw it.
  std::vector<uint64_t> layer_ready_ns;
  std::vector<uint64_t> layer_sent_ns;
};

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_CONNECTOR_STATS_H_
