// LayerOverlap: one disaggregated request's layers on one time axis, from what its two
// workers measured: the prefill worker's (when each layer was ready to send, when its
// transfer completed, from its --json report) and the decode worker's (when each layer's
// notice arrived, RequestTransferStats). Both workers must share the host's monotonic
// clock (monotonic_clock.h), that is run on one host, as the demo's do.
//
// From these: how long each layer's transfer took once it could start (the copy of layer l
// starts when it is ready and the copy of layer l-1 is done), and the transfer that no
// prefill compute can hide: from the moment the last layer was ready to its arrival at the
// decode worker.
#ifndef KVSTREAM_LAUNCH_LAYER_OVERLAP_H_
#define KVSTREAM_LAUNCH_LAYER_OVERLAP_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "kvstream/connector/connector_stats.h"

namespace kvstream {

// One request of a prefill worker's --json report (PrefillReportJson, worker.h).
struct ProducerTimeline {
  std::string consumer_request_id;
  double prefill_ms = 0;          // RequestResult::prefill_ms at the prefill worker
  uint64_t prefill_start_ns = 0;  // RequestResult::prefill_start_ns
  std::vector<uint64_t> layer_ready_ns;
  std::vector<uint64_t> layer_sent_ns;
};

// The requests of a prefill worker's report that had sends, by the consumer's request id.
// Errors name the file and what is missing or malformed.
absl::StatusOr<std::map<std::string, ProducerTimeline>> ReadPrefillReport(
    const std::string& path);

// Times in ms after the consumer's hand-off, per layer index.
struct LayerOverlap {
  double prefill_start_ms = 0;      // the prefill worker's first forward pass began
  std::vector<double> ready_ms;     // the layer was ready to send at the prefill worker
  std::vector<double> copy_start_ms;  // max(ready, the previous layer's sent)
  std::vector<double> sent_ms;      // its transfer completed (as the prefill worker saw it)
  std::vector<double> arrival_ms;   // its notice reached the decode worker
  std::vector<double> copy_ms;      // sent - copy_start
  double median_copy_ms = 0;        // one layer's transfer time
  double transfer_ms = 0;           // sum of copy_ms
  // arrival of the last layer - its ready: the transfer after the prefill compute ended.
  double last_exposed_ms = 0;
};

// InvalidArgument when the two disagree on the layer count or a time is unknown (0).
absl::StatusOr<LayerOverlap> ComputeLayerOverlap(const RequestTransferStats& consumer,
                                                 const ProducerTimeline& producer);

nlohmann::json LayerOverlapJson(const LayerOverlap& overlap);

}  // namespace kvstream

#endif  // KVSTREAM_LAUNCH_LAYER_OVERLAP_H_
