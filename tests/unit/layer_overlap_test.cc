// LayerOverlap (launch/layer_overlap.h): the per-layer timeline of a request from both
// workers' measurements, and the prefill worker's report it reads them from.
#include "layer_overlap.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace kvstream {
namespace {

constexpr uint64_t kHandoffNs = 5'000'000'000;
constexpr uint64_t kMs = 1'000'000;

// Three layers: ready at 10, 20, 30 ms after the hand-off; the second one's copy queues
// behind the first's (which ends at 22 ms).
struct Fixture {
  RequestTransferStats consumer;
  ProducerTimeline producer;
  Fixture() {
    consumer.request_id = "req-0";
    consumer.handoff_ns = kHandoffNs;
    consumer.layer_arrival_ms = {12.5, 24.5, 33.0};
    producer.consumer_request_id = "req-0";
    producer.prefill_ms = 29.0;
    producer.prefill_start_ns = kHandoffNs + 1 * kMs;
    producer.layer_ready_ns = {kHandoffNs + 10 * kMs, kHandoffNs + 20 * kMs,
                               kHandoffNs + 30 * kMs};
    producer.layer_sent_ns = {kHandoffNs + 22 * kMs, kHandoffNs + 24 * kMs,
                              kHandoffNs + 32 * kMs};
  }
};

TEST(LayerOverlapTest, CopiesStartWhenReadyAndThePreviousCopyIsDone) {
  Fixture f;
  absl::StatusOr<LayerOverlap> o = ComputeLayerOverlap(f.consumer, f.producer);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_DOUBLE_EQ(o->prefill_start_ms, 1.0);
  EXPECT_EQ(o->ready_ms, (std::vector<double>{10, 20, 30}));
  EXPECT_EQ(o->copy_start_ms, (std::vector<double>{10, 22, 30}));
  EXPECT_EQ(o->copy_ms, (std::vector<double>{12, 2, 2}));
  EXPECT_DOUBLE_EQ(o->transfer_ms, 16.0);
  EXPECT_DOUBLE_EQ(o->median_copy_ms, 2.0);
  // The last layer was ready at 30 ms and reached the consumer at 33 ms.
  EXPECT_DOUBLE_EQ(o->last_exposed_ms, 3.0);
  const nlohmann::json j = LayerOverlapJson(*o);
  EXPECT_EQ(j["layer_arrival_ms"].size(), 3u);
  EXPECT_DOUBLE_EQ(j["last_layer_exposed_ms"].get<double>(), 3.0);
}

TEST(LayerOverlapTest, DisagreeingLayerCountsAndUnknownTimesAreErrors) {
  Fixture f;
  f.producer.layer_sent_ns.pop_back();
  absl::StatusOr<LayerOverlap> o = ComputeLayerOverlap(f.consumer, f.producer);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("3 layer arrivals"), std::string::npos) << o.status();

  Fixture g;
  g.producer.layer_ready_ns[1] = 0;
  o = ComputeLayerOverlap(g.consumer, g.producer);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("layer 1"), std::string::npos) << o.status();

  Fixture h;
  h.consumer.handoff_ns = 0;
  EXPECT_EQ(ComputeLayerOverlap(h.consumer, h.producer).status().code(),
            absl::StatusCode::kInvalidArgument);
}

std::string WriteTemp(const std::string& text) {
  char path[] = "/tmp/kvstream-overlap-XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << text;
  return path;
}

TEST(LayerOverlapTest, ReadsThePrefillReportByConsumerId) {
  const std::string path = WriteTemp(R"({"role": "prefill", "requests": [
      {"id": "d/req-0", "consumer_request_id": "req-0", "prefill_ms": 29.5,
       "prefill_start_ns": 7, "layer_ready_ns": [10, 20], "layer_sent_ns": [15, 25]},
      {"id": "d/req-1", "prefill_ms": 3.0, "prefill_start_ns": 1}]})");
  absl::StatusOr<std::map<std::string, ProducerTimeline>> r = ReadPrefillReport(path);
  std::remove(path.c_str());
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 1u);  // req-1 sent nothing
  const ProducerTimeline& t = r->at("req-0");
  EXPECT_DOUBLE_EQ(t.prefill_ms, 29.5);
  EXPECT_EQ(t.prefill_start_ns, 7u);
  EXPECT_EQ(t.layer_ready_ns, (std::vector<uint64_t>{10, 20}));
  EXPECT_EQ(t.layer_sent_ns, (std::vector<uint64_t>{15, 25}));
}

TEST(LayerOverlapTest, MalformedReportsAreErrorsNamingTheFile) {
  EXPECT_EQ(ReadPrefillReport("/nonexistent/prefill.json").status().code(),
            absl::StatusCode::kNotFound);
  for (const char* text :
       {"not json", R"({"requests": 3})", R"([1, 2])",
        R"({"requests": [{"consumer_request_id": "a", "prefill_ms": 1}]})",
        R"({"requests": [{"consumer_request_id": "a", "prefill_ms": 1, "prefill_start_ns": 2,
            "layer_ready_ns": [-1], "layer_sent_ns": [3]}]})",
        R"({"requests": [{"consumer_request_id": 5, "prefill_ms": 1, "prefill_start_ns": 2,
            "layer_ready_ns": [], "layer_sent_ns": []}]})"}) {
    const std::string path = WriteTemp(text);
    absl::StatusOr<std::map<std::string, ProducerTimeline>> r = ReadPrefillReport(path);
    std::remove(path.c_str());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status();
  }
}

}  // namespace
}  // namespace kvstream
