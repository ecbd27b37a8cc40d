// The connector end to end on the GPU with device caches in two processes: this test is the
// decode worker (consumer), kvstream_connector_device_peer the prefill worker (producer).
// Both run CUDA attention layers over device caches; the producer's caches are one
// cudaMalloc each, the consumer's are sub-ranges of one allocation. The layerwise
// connector streams every layer over the transport (cuda_ipc; ucx, staged through pinned
// memory), ordered on CUDA streams by events, with checksums computed and verified on the
// GPU. Outputs must be bit-identical to a colocated run of the same inputs; a producer
// killed mid-stream must give a load error, recompute must give the colocated output, and
// no block may stay in flight.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "connector_device_model.h"
#include "kvstream/connector/factory.h"
#include "tests/integration/ucx_transport_peer.h"

namespace kvstream {
namespace {

using test::DeviceModel;
using test::DeviceSeq;
using test::kDeviceBlock;
using test::kDeviceLayers;
using ::testing::HasSubstr;

absl::Time Deadline() { return absl::Now() + absl::Seconds(60); }

struct Request {
  std::string id;
  uint32_t seed;
  int32_t prompt;
  std::vector<int32_t> blocks;  // the consumer's
};

KvRequest AsKvRequest(const Request& r, int port) {
  KvRequest k;
  k.request_id = r.id;
  k.prompt_token_ids.push_back(static_cast<int32_t>(r.seed));  // the producer's seed
  for (int32_t i = 1; i < r.prompt; ++i) k.prompt_token_ids.push_back(i);
  k.remote_prefill = RemotePrefill{"127.0.0.1", port};
  return k;
}

// The colocated run: the prompt but its last token prefilled locally, then the last token
// decoded, as the decode worker does after the hand-off. Returns the decode step's outputs.
std::vector<std::vector<uint16_t>> Colocated(const std::vector<Request>& requests) {
  DeviceModel model;
  EXPECT_TRUE(model.Init(/*one_allocation=*/false).ok());
  std::vector<DeviceSeq> prefill, decode;
  for (const Request& r : requests) {
    prefill.push_back({{0, r.prompt - 1, r.blocks}, r.seed});
    decode.push_back({{r.prompt - 1, 1, r.blocks}, r.seed});
  }
  EXPECT_TRUE(model.Step(prefill).ok());
  auto out = model.Step(decode);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : std::vector<std::vector<uint16_t>>();
}

class ConnectorDeviceGpuTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::Status gpu = CudaAvailability();
    if (!gpu.ok()) GTEST_SKIP() << "no usable GPU: " << gpu.message();
  }

  // Starts the producer and this test's consumer side.
  void Start(std::vector<std::string> peer_args, int64_t load_timeout_ms = 20000) {
    std::vector<std::string> args = {KVSTREAM_CONNECTOR_DEVICE_PEER_BINARY,
                                     absl::StrCat("--transport=", GetParam())};
    args.insert(args.end(), peer_args.begin(), peer_args.end());
    auto child = test::ChildProcess::Spawn(args);
    ASSERT_TRUE(child.ok()) << child.status();
    peer_ = std::move(*child);
    auto ready = peer_->reader().ReadLine(Deadline());
    ASSERT_TRUE(ready.ok()) << ready.status();
    absl::string_view line = *ready;
    ASSERT_TRUE(absl::ConsumePrefix(&line, "ready ")) << *ready;
    ASSERT_TRUE(absl::SimpleAtoi(line, &port_)) << *ready;

    KvTransferConfig c;
    c.kv_connector = "LayerwiseConnector";
    c.kv_role = KvRole::kConsumer;
    c.engine_id = "decode-gpu";
    c.kv_buffer_device = "cuda";
    c.kvstream.transport = GetParam();
    c.kvstream.load_timeout_ms = load_timeout_ms;
    c.kvstream.send_timeout_ms = 3000;
    ASSERT_TRUE(model_.Init(/*one_allocation=*/true).ok());
    auto scheduler = CreateKvConnectorScheduler(c, kDeviceBlock);
    ASSERT_TRUE(scheduler.ok()) << scheduler.status();
    scheduler_ = std::move(*scheduler);
    auto worker = CreateKvConnectorWorker(c);
    ASSERT_TRUE(worker.ok()) << worker.status();
    worker_ = std::move(*worker);
    ASSERT_TRUE(worker_->RegisterKvCaches(model_.Caches()).ok());
    model_.registry().SetTransferHook(worker_.get());
  }

  void TearDown() override {
    worker_.reset();  // its registrations go before the caches
    if (peer_ != nullptr) {
      (void)test::WriteLine(peer_->to_child(), "quit");
    }
  }

  // Scattered consumer blocks for each request (distinct across requests).
  void Allocate(std::vector<Request>& requests) {
    std::vector<int32_t> ids(test::kDeviceBlocks);
    for (int32_t i = 0; i < test::kDeviceBlocks; ++i) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), std::mt19937(77));
    size_t next = 0;
    for (Request& r : requests) {
      const int32_t need = (r.prompt + kDeviceBlock - 1) / kDeviceBlock;
      r.blocks.assign(ids.begin() + next, ids.begin() + next + need);
      next += need;
    }
  }

  // The decode worker's first step: hand every request over, then decode its last prompt
  // token with the hook waiting for each layer. The metadata crosses as bytes.
  absl::StatusOr<std::vector<std::vector<uint16_t>>> DisaggregatedStep(
      const std::vector<Request>& requests) {
    std::vector<ScheduledRequest> scheduled;
    std::vector<DeviceSeq> decode;
    for (const Request& r : requests) {
      const KvRequest k = AsKvRequest(r, port_);
      ASSIGN_OR_RETURN(MatchedTokens m, scheduler_->GetNumNewMatchedTokens(k, 0));
      if (m.num_tokens != r.prompt - 1) return absl::InternalError("unexpected match");
      RETURN_IF_ERROR(scheduler_->UpdateStateAfterAlloc(k, r.blocks, m.num_tokens));
      scheduled.push_back({r.id, r.prompt - 1, 1});
      decode.push_back({{r.prompt - 1, 1, r.blocks}, r.seed});
    }
    ASSIGN_OR_RETURN(KvConnectorMetadata raw, scheduler_->BuildConnectorMeta(scheduled));
    ASSIGN_OR_RETURN(std::string bytes, EncodeConnectorMetadata(raw));
    ASSIGN_OR_RETURN(KvConnectorMetadata meta, DecodeConnectorMetadata(bytes));
    RETURN_IF_ERROR(worker_->BindConnectorMetadata(meta));
    RETURN_IF_ERROR(worker_->StartLoadKv());
    auto out = model_.Step(decode);
    worker_->ClearConnectorMetadata();
    return out;
  }

  // Outputs of the worker until every id in `ids` was reported finished receiving.
  KvConnectorOutput AwaitFinished(const std::vector<Request>& requests) {
    KvConnectorOutput all;
    const absl::Time deadline = Deadline();
    while (absl::Now() < deadline) {
      auto out = worker_->TakeOutput();
      EXPECT_TRUE(out.ok());
      EXPECT_TRUE(scheduler_->UpdateConnectorOutput(*out).ok());
      all.finished_recving.insert(out->finished_recving.begin(), out->finished_recving.end());
      for (LoadError& e : out->load_errors) all.load_errors.push_back(std::move(e));
      bool done = true;
      for (const Request& r : requests) done = done && all.finished_recving.count(r.id) != 0;
      if (done) break;
      absl::SleepFor(absl::Milliseconds(2));
    }
    return all;
  }

  DeviceModel model_;
  std::unique_ptr<KvConnectorScheduler> scheduler_;
  std::unique_ptr<KvConnectorWorker> worker_;
  std::unique_ptr<test::ChildProcess> peer_;
  int port_ = 0;
};

TEST_P(ConnectorDeviceGpuTest, StreamedLayersGiveTheColocatedOutputsBitForBit) {
  ASSERT_NO_FATAL_FAILURE(Start({}));
  std::vector<Request> requests = {{"req-a", 7, 57, {}}, {"req-b", 9, 40, {}}};
  Allocate(requests);
  auto got = DisaggregatedStep(requests);
  ASSERT_TRUE(got.ok()) << got.status();
  KvConnectorOutput out = AwaitFinished(requests);
  EXPECT_TRUE(out.load_errors.empty()) << out.load_errors[0].status;
  const std::vector<std::vector<uint16_t>> want = Colocated(requests);
  ASSERT_EQ(got->size(), want.size());
  for (int l = 0; l < kDeviceLayers; ++l) {
    EXPECT_TRUE((*got)[l] == want[l]) << "layer " << l << " differs from the colocated run";
  }
  // Every streamed token's K and V are the producer's bytes: compare with a local prefill.
  DeviceModel local;
  ASSERT_TRUE(local.Init(false).ok());
  std::vector<DeviceSeq> prefill;
  for (const Request& r : requests) prefill.push_back({{0, r.prompt - 1, r.blocks}, r.seed});
  ASSERT_TRUE(local.Step(prefill).ok());
  for (const Request& r : requests) {
    for (int l = 0; l < kDeviceLayers; ++l) {
      for (int32_t t = 0; t < r.prompt - 1; ++t) {
        auto a = model_.TokenBytes(l, r.blocks[t / kDeviceBlock], t % kDeviceBlock);
        auto b = local.TokenBytes(l, r.blocks[t / kDeviceBlock], t % kDeviceBlock);
        ASSERT_TRUE(a.ok() && b.ok());
        ASSERT_TRUE(*a == *b) << r.id << " layer " << l << " token " << t;
      }
    }
  }
  const ConnectorStats s = worker_->stats();
  uint64_t tokens = 0;
  for (const Request& r : requests) tokens += r.prompt - 1;
  EXPECT_EQ(s.bytes_received, tokens * 2 * test::kDeviceKvHeads * test::kDeviceHeadSize * 2 *
                                  kDeviceLayers);
  EXPECT_EQ(s.layers_received, static_cast<uint64_t>(kDeviceLayers * requests.size()));
  EXPECT_EQ(s.load_errors, 0u);
  EXPECT_EQ(s.blocks_in_flight, 0);

  // Device caches: the producer dates each layer by the GPU's ready event, on the host
  // clock this process shares; the consumer leaves the time in flight unknown (the host
  // posts ahead of the GPU, so the post says nothing of the transfer).
  std::map<std::string, RequestTransferStats> consumer;
  for (RequestTransferStats& t : worker_->TakeRequestStats()) consumer[t.request_id] = t;
  ASSERT_EQ(consumer.size(), requests.size());
  for (const auto& [id, t] : consumer) {
    EXPECT_EQ(t.transfer_ms, 0.0) << id;
    EXPECT_EQ(t.exposed_ms, 0.0) << id;
    for (double ms : t.layer_in_flight_ms) EXPECT_EQ(ms, 0.0) << id;
  }
  ASSERT_TRUE(test::WriteLine(peer_->to_child(), "quit").ok());
  std::map<std::string, std::pair<std::vector<uint64_t>, std::vector<uint64_t>>> producer;
  for (;;) {
    auto line = peer_->reader().ReadLine(Deadline());
    ASSERT_TRUE(line.ok()) << line.status();
    if (absl::StartsWith(*line, "served")) break;
    const std::vector<std::string> f = absl::StrSplit(*line, ' ');
    ASSERT_EQ(f.size(), 5u) << *line;
    ASSERT_EQ(f[0], "timeline");
    EXPECT_EQ(f[2], "ok") << *line;
    for (int k : {3, 4}) {
      auto& times = k == 3 ? producer[f[1]].first : producer[f[1]].second;
      for (absl::string_view v : absl::StrSplit(f[k], ',')) {
        uint64_t ns = 0;
        ASSERT_TRUE(absl::SimpleAtoi(v, &ns)) << *line;
        times.push_back(ns);
      }
    }
  }
  peer_.reset();
  ASSERT_EQ(producer.size(), requests.size());
  for (const auto& [id, times] : producer) {
    SCOPED_TRACE(id);
    const auto c = consumer.find(id);
    ASSERT_NE(c, consumer.end());
    const auto& [ready, sent] = times;
    ASSERT_EQ(ready.size(), static_cast<size_t>(kDeviceLayers));
    ASSERT_EQ(sent.size(), static_cast<size_t>(kDeviceLayers));
    for (int l = 0; l < kDeviceLayers; ++l) {
      // After the hand-off, before the transfer completed and before it arrived here.
      const uint64_t arrival =
          c->second.handoff_ns + static_cast<uint64_t>(c->second.layer_arrival_ms[l] * 1e6);
      EXPECT_GT(ready[l], c->second.handoff_ns) << "layer " << l;
      EXPECT_LE(ready[l], sent[l]) << "layer " << l;
      EXPECT_LT(ready[l], arrival) << "layer " << l;
      if (l > 0) {
        EXPECT_GE(ready[l], ready[l - 1]) << "layer " << l;  // one stream
      }
    }
  }
}

TEST_P(ConnectorDeviceGpuTest, ProducerKilledMidStreamIsALoadErrorAndRecomputeIsExact) {
  ASSERT_NO_FATAL_FAILURE(Start({"--crash-after-layer=1"}, /*load_timeout_ms=*/5000));
  std::vector<Request> requests = {{"req-k", 11, 50, {}}};
  Allocate(requests);
  auto got = DisaggregatedStep(requests);
  ASSERT_TRUE(got.ok()) << got.status();  // the step runs; the failed request is a load error
  KvConnectorOutput out = AwaitFinished(requests);
  ASSERT_EQ(out.load_errors.size(), 1u);
  EXPECT_EQ(out.load_errors[0].request_id, "req-k");
  EXPECT_EQ(out.load_errors[0].block_ids, requests[0].blocks);
  EXPECT_TRUE(out.load_errors[0].status.code() == absl::StatusCode::kUnavailable ||
              out.load_errors[0].status.code() == absl::StatusCode::kDeadlineExceeded)
      << out.load_errors[0].status;
  EXPECT_TRUE(out.finished_recving.count("req-k"));  // nothing can land any more
  EXPECT_EQ(worker_->stats().blocks_in_flight, 0);
  // Recompute: the decode worker prefills the prompt itself into the same blocks.
  model_.registry().SetTransferHook(nullptr);
  std::vector<DeviceSeq> prefill = {{{0, requests[0].prompt - 1, requests[0].blocks}, 11}};
  std::vector<DeviceSeq> decode = {{{requests[0].prompt - 1, 1, requests[0].blocks}, 11}};
  ASSERT_TRUE(model_.Step(prefill).ok());
  auto again = model_.Step(decode);
  ASSERT_TRUE(again.ok()) << again.status();
  const auto want = Colocated(requests);
  for (int l = 0; l < kDeviceLayers; ++l) {
    EXPECT_TRUE((*again)[l] == want[l]) << "layer " << l;
  }
  peer_.reset();  // already dead: reap it
}

// Passes the forward pass's calls to the worker, but first, at `layer`, waits until the
// producer's bytes of one token are in place in this cache and flips a bit of them: the
// layer has landed, and its checksum is not verified yet (the consumer verifies a device
// layer when the forward pass reaches it), so the verification must see the flipped bit.
class CorruptingHook : public TransferHook {
 public:
  CorruptingHook(TransferHook* inner, DeviceModel* model, int layer, int32_t block,
                 std::vector<char> expected)
      : inner_(inner), model_(model), layer_(layer), block_(block),
        expected_(std::move(expected)) {}

  absl::Status BeforeAttention(absl::string_view name, void* stream) override {
    if (name == test::DeviceLayerName(layer_)) {
      const absl::Time deadline = Deadline();
      for (;;) {
        ASSIGN_OR_RETURN(std::vector<char> got, model_->TokenBytes(layer_, block_, 0));
        if (got == expected_) break;
        if (absl::Now() > deadline) return absl::DeadlineExceededError("the token never landed");
        absl::SleepFor(absl::Microseconds(200));
      }
      const KvCacheView v = model_->cache(layer_).view();
      char* at = static_cast<char*>(v.k) + v.k_strides.Offset(block_, 0, 0, 0) * 2;
      const char flipped = static_cast<char>(expected_[0] ^ 0x10);
      RETURN_IF_ERROR(test::CudaCheck(cudaMemcpy(at, &flipped, 1, cudaMemcpyHostToDevice),
                                      "corrupting a token"));
      corrupted_ = true;
    }
    return inner_->BeforeAttention(name, stream);
  }
  absl::Status AfterAttention(absl::string_view name, const KvCache& cache,
                              const AttentionMetadata& md, void* stream) override {
    return inner_->AfterAttention(name, cache, md, stream);
  }
  bool corrupted() const { return corrupted_; }

 private:
  TransferHook* inner_;
  DeviceModel* model_;
  int layer_;
  int32_t block_;
  std::vector<char> expected_;
  bool corrupted_ = false;
};

TEST_P(ConnectorDeviceGpuTest, ALayerCorruptedAfterItLandedIsADataLossLoadError) {
  ASSERT_NO_FATAL_FAILURE(Start({}));
  std::vector<Request> requests = {{"req-c", 13, 45, {}}};
  Allocate(requests);
  // The producer's bytes of layer 2's first token, from a local prefill into the same blocks.
  DeviceModel local;
  ASSERT_TRUE(local.Init(false).ok());
  ASSERT_TRUE(local.Step({{{0, requests[0].prompt - 1, requests[0].blocks}, 13}}).ok());
  auto expected = local.TokenBytes(2, requests[0].blocks[0], 0);
  ASSERT_TRUE(expected.ok()) << expected.status();
  CorruptingHook hook(worker_.get(), &model_, 2, requests[0].blocks[0], *expected);
  model_.registry().SetTransferHook(&hook);
  auto got = DisaggregatedStep(requests);
  ASSERT_TRUE(got.ok()) << got.status();  // the step runs; the corrupt request is a load error
  EXPECT_TRUE(hook.corrupted());
  KvConnectorOutput out = AwaitFinished(requests);
  ASSERT_EQ(out.load_errors.size(), 1u);
  EXPECT_EQ(out.load_errors[0].request_id, "req-c");
  EXPECT_EQ(out.load_errors[0].status.code(), absl::StatusCode::kDataLoss)
      << out.load_errors[0].status;
  EXPECT_THAT(std::string(out.load_errors[0].status.message()),
              ::testing::HasSubstr("layer 2: checksum mismatch"));
  EXPECT_TRUE(out.finished_recving.count("req-c"));
  EXPECT_EQ(worker_->stats().blocks_in_flight, 0);
  model_.registry().SetTransferHook(worker_.get());
}

INSTANTIATE_TEST_SUITE_P(Transports, ConnectorDeviceGpuTest,
                         ::testing::Values(std::string("cuda_ipc"), std::string("ucx")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace kvstream
