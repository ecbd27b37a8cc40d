// LayerOverlap (layer_overlap.h).
#include "layer_overlap.h"

#include <algorithm>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace kvstream {

absl::StatusOr<std::map<std::string, ProducerTimeline>> ReadPrefillReport(
    const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read the prefill report ", path));
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("requests") ||
      !j["requests"].is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the prefill report ", path, " is not a JSON object with \"requests\""));
  }
  std::map<std::string, ProducerTimeline> out;
  for (const nlohmann::json& r : j["requests"]) {
    if (!r.is_object() || !r.contains("consumer_request_id")) continue;  // nothing sent
    ProducerTimeline t;
    const auto field = [&](const char* name) -> const nlohmann::json* {
      return r.contains(name) ? &r[name] : nullptr;
    };
    const nlohmann::json* id = field("consumer_request_id");
    const nlohmann::json* prefill = field("prefill_ms");
    const nlohmann::json* start = field("prefill_start_ns");
    const nlohmann::json* ready = field("layer_ready_ns");
    const nlohmann::json* sent = field("layer_sent_ns");
    if (!id->is_string() || prefill == nullptr || !prefill->is_number() || start == nullptr ||
        !start->is_number_unsigned() || ready == nullptr || !ready->is_array() ||
        sent == nullptr || !sent->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the prefill report ", path, ": a request without consumer_request_id, prefill_ms, "
          "prefill_start_ns, layer_ready_ns and layer_sent_ns of the right types"));
    }
    t.consumer_request_id = id->get<std::string>();
    t.prefill_ms = prefill->get<double>();
    t.prefill_start_ns = start->get<uint64_t>();
    for (const nlohmann::json* list : {ready, sent}) {
      for (const nlohmann::json& v : *list) {
        if (!v.is_number_unsigned()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "the prefill report ", path, ": request ", t.consumer_request_id,
              " has a layer time that is not an unsigned integer"));
        }
        (list == ready ? t.layer_ready_ns : t.layer_sent_ns).push_back(v.get<uint64_t>());
      }
    }
    out[t.consumer_request_id] = std::move(t);
  }
  return out;
}

absl::StatusOr<LayerOverlap> ComputeLayerOverlap(const RequestTransferStats& consumer,
                                                 const ProducerTimeline& producer) {
  const size_t n = consumer.layer_arrival_ms.size();
  if (n == 0 || producer.layer_ready_ns.size() != n || producer.layer_sent_ns.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request ", consumer.request_id, ": ", n, " layer arrivals at the decode worker but ",
        producer.layer_ready_ns.size(), " ready and ", producer.layer_sent_ns.size(),
        " sent times at the prefill worker"));
  }
  if (consumer.handoff_ns == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", consumer.request_id, ": the hand-off time is unknown"));
  }
  const auto ms = [&](uint64_t ns) {
    return (static_cast<double>(ns) - static_cast<double>(consumer.handoff_ns)) / 1e6;
  };
  LayerOverlap o;
  o.prefill_start_ms = ms(producer.prefill_start_ns);
  for (size_t l = 0; l < n; ++l) {
    if (producer.layer_ready_ns[l] == 0 || producer.layer_sent_ns[l] == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", consumer.request_id, ": layer ", l,
          " has no ready or sent time at the prefill worker"));
    }
    o.ready_ms.push_back(ms(producer.layer_ready_ns[l]));
    o.sent_ms.push_back(ms(producer.layer_sent_ns[l]));
    o.arrival_ms.push_back(consumer.layer_arrival_ms[l]);
    const double start = l == 0 ? o.ready_ms[l] : std::max(o.ready_ms[l], o.sent_ms[l - 1]);
    o.copy_start_ms.push_back(start);
    o.copy_ms.push_back(std::max(0.0, o.sent_ms[l] - start));
    o.transfer_ms += o.copy_ms.back();
  }
  std::vector<double> sorted = o.copy_ms;
  std::sort(sorted.begin(), sorted.end());
  o.median_copy_ms = sorted[sorted.size() / 2];
  o.last_exposed_ms = o.arrival_ms.back() - o.ready_ms.back();
  return o;
}

nlohmann::json LayerOverlapJson(const LayerOverlap& o) {
  return {{"prefill_start_ms", o.prefill_start_ms}, {"layer_ready_ms", o.ready_ms},
          {"layer_copy_start_ms", o.copy_start_ms}, {"layer_sent_ms", o.sent_ms},
          {"layer_arrival_ms", o.arrival_ms},       {"layer_copy_ms", o.copy_ms},
          {"median_layer_copy_ms", o.median_copy_ms}, {"transfer_ms", o.transfer_ms},
          {"last_layer_exposed_ms", o.last_exposed_ms}};
}

}  // namespace kvstream
