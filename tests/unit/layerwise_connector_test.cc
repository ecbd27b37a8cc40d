// Tests of LayerwiseConnector: a producer and a consumer in one process, joined by the
// loopback transport (data) and a real TCP control channel on 127.0.0.1.
#include "kvstream/connector/layerwise_connector.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/connector/block_copy_plan.h"
#include "kvstream/connector/connector_metadata.h"
#include "kvstream/connector/factory.h"
#include "kvstream/connector/layer_routing.h"
#include "kvstream/transfer/control_channel.h"
#include "kvstream/transfer/loopback_transport.h"
#include "tests/testing/transport_wrapper.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;

constexpr int kLayers = 3;

std::string LayerName(int i) { return absl::StrCat("model.layers.", i, ".self_attn.attn"); }

// Flips one byte of the source before a write is posted (after the connector computed its
// checksum), to check that the consumer notices: every write, or only the first `limit`.
class CorruptingTransport : public TransportWrapper {
 public:
  explicit CorruptingTransport(std::unique_ptr<Transport> inner, int limit = -1)
      : TransportWrapper(std::move(inner)), left_(limit) {}
  using Transport::PostWrite;
  absl::StatusOr<TransferId> PostWrite(PeerId peer, const MemoryRegistration& local,
                                       const RemoteMemory& remote,
                                       absl::Span<const Segment> segments,
                                       absl::string_view notification,
                                       const WriteOrder& order) override {
    if (!segments.empty() && !notification.empty() && left_.load() != 0) {
      if (left_.load() > 0) --left_;
      static_cast<uint8_t*>(local.base())[segments[0].local_offset] ^= 0x5a;
    }
    return TransportWrapper::PostWrite(peer, local, remote, segments, notification, order);
  }

 private:
  std::atomic<int> left_;  // writes still to corrupt; < 0: all
};

// Drives a connector's two sides as an engine does: scheduler calls go to the scheduler
// side, hook and step calls to the worker side, and the worker's output reaches the
// scheduler side (as bytes, as between vLLM's processes) whenever the test looks at what
// happened. The metadata crosses as bytes too.
class TestConnector {
 public:
  TestConnector(std::unique_ptr<KvConnectorScheduler> scheduler,
                std::unique_ptr<KvConnectorWorker> worker)
      : scheduler_(std::move(scheduler)), worker_(std::move(worker)) {}

  KvConnectorWorker& worker() { return *worker_; }

  // ---- scheduler side ----
  absl::StatusOr<MatchedTokens> GetNumNewMatchedTokens(const KvRequest& r, int32_t computed) {
    return scheduler_->GetNumNewMatchedTokens(r, computed);
  }
  absl::Status UpdateStateAfterAlloc(const KvRequest& r, absl::Span<const int32_t> blocks,
                                     int32_t external) {
    return scheduler_->UpdateStateAfterAlloc(r, blocks, external);
  }
  absl::StatusOr<KvConnectorMetadata> BuildConnectorMeta(absl::Span<const ScheduledRequest> s) {
    ASSIGN_OR_RETURN(KvConnectorMetadata meta, scheduler_->BuildConnectorMeta(s));
    ASSIGN_OR_RETURN(std::string bytes, EncodeConnectorMetadata(meta));
    return DecodeConnectorMetadata(bytes);
  }
  absl::StatusOr<bool> RequestFinished(const std::string& id) {
    Pump();
    return scheduler_->RequestFinished(id);
  }
  std::vector<KvRequest> TakeIncomingRequests() {
    Pump();
    return scheduler_->TakeIncomingRequests();
  }

  // ---- worker side ----
  absl::Status RegisterKvCaches(const std::map<std::string, KvCache*>& caches) {
    return worker_->RegisterKvCaches(caches);
  }
  absl::Status BindConnectorMetadata(const KvConnectorMetadata& m) {
    return worker_->BindConnectorMetadata(m);
  }
  absl::Status StartLoadKv() { return worker_->StartLoadKv(); }
  absl::Status BeforeAttention(absl::string_view layer, void* stream) {
    return worker_->BeforeAttention(layer, stream);
  }
  absl::Status AfterAttention(absl::string_view layer, const KvCache& cache,
                              const AttentionMetadata& md, void* stream) {
    return worker_->AfterAttention(layer, cache, md, stream);
  }
  absl::Status WaitForSave() { return worker_->WaitForSave(); }
  void ClearConnectorMetadata() { worker_->ClearConnectorMetadata(); }
  std::string control_address() const { return worker_->control_address(); }
  ConnectorStats stats() const { return worker_->stats(); }
  std::vector<PeerConnectorStats> peer_stats() const { return worker_->peer_stats(); }
  std::vector<RequestTransferStats> TakeRequestStats() { return worker_->TakeRequestStats(); }
  std::vector<RequestSendStats> TakeSendStats() { return worker_->TakeSendStats(); }

  // ---- what happened (from the worker's outputs) ----
  std::vector<LoadError> TakeLoadErrors() {
    Pump();
    return std::move(errors_);
  }
  // Blocks of loads that failed and were not yet reported finished by GetFinished.
  std::set<int32_t> GetBlockIdsWithLoadErrors() {
    Pump();
    std::set<int32_t> ids;
    for (const auto& [id, blocks] : failed_blocks_) ids.insert(blocks.begin(), blocks.end());
    return ids;
  }
  absl::StatusOr<FinishedRequests> GetFinished() {
    Pump();
    FinishedRequests f = std::move(finished_);
    finished_ = FinishedRequests();
    for (const std::string& id : f.finished_recving) failed_blocks_.erase(id);
    return f;
  }

 private:
  void Pump() {
    auto raw = worker_->TakeOutput();
    ASSERT_TRUE(raw.ok()) << raw.status();
    auto bytes = EncodeConnectorOutput(*raw);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto out = DecodeConnectorOutput(*bytes);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE(scheduler_->UpdateConnectorOutput(*out).ok());
    for (LoadError& e : out->load_errors) {
      failed_blocks_[e.request_id] = e.block_ids;
      errors_.push_back(std::move(e));
    }
    finished_.finished_sending.insert(out->finished_sending.begin(), out->finished_sending.end());
    finished_.finished_recving.insert(out->finished_recving.begin(), out->finished_recving.end());
  }

  std::unique_ptr<KvConnectorScheduler> scheduler_;
  std::unique_ptr<KvConnectorWorker> worker_;
  std::vector<LoadError> errors_;
  std::map<std::string, std::vector<int32_t>> failed_blocks_;
  FinishedRequests finished_;
};

struct NodeOptions {
  KvRole role = KvRole::kConsumer;
  int block_size = 4;
  KvLayout layout = KvLayout::kNHD;
  std::string secret;
  int64_t load_timeout_ms = 5000;
  int64_t send_timeout_ms = 5000;
  bool corrupt = false;
  int corrupt_writes = -1;  // with `corrupt`: only the first this many writes (< 0: all)
  // The layers this node has caches for (empty: all kLayers) and its pipeline settings.
  std::vector<int> layers;
  int pipeline_parallel_size = 1;
  int pipeline_rank = 0;
  std::string pipeline_layers;  // e.g. "0,1-2"
  bool register_may_fail = false;
  int64_t num_blocks = 16;
  // Told to the worker with SetModelInfo when any is set.
  KvModelInfo model;
  int32_t max_connections = 256;
  int32_t max_requests_per_consumer = 1024;
  int64_t max_tokens_per_consumer = int64_t{1} << 22;
  std::string pipeline_group;
  int64_t handshake_timeout_ms = 2000;
  int64_t reconnect_backoff_ms = 200;
  int64_t reconnect_backoff_max_ms = 5000;
  int32_t port = 0;  // producer: the control port (0: any free one)
};

// One worker: a connector and its layers' caches (null for layers it does not own).
// The caches come first so that they outlive the connector, which registered them and
// whose peers' writes may still land in them until it is destroyed.
struct Node {
  std::vector<std::unique_ptr<KvCache>> caches;
  std::unique_ptr<TestConnector> connector;
  absl::Status register_status;
};

std::unique_ptr<Node> MakeNode(LoopbackFabric& fabric, const std::string& name,
                               const NodeOptions& o) {
  auto node = std::make_unique<Node>();
  KvTransferConfig c;
  c.kv_connector = "LayerwiseConnector";
  c.engine_id = name;
  c.kv_role = o.role;
  c.kv_port = o.port;
  c.kvstream.transport = "loopback";
  c.kvstream.secret = o.secret;
  c.kvstream.load_timeout_ms = o.load_timeout_ms;
  c.kvstream.send_timeout_ms = o.send_timeout_ms;
  c.kvstream.handshake_timeout_ms = o.handshake_timeout_ms;
  c.kvstream.reconnect_backoff_ms = o.reconnect_backoff_ms;
  c.kvstream.reconnect_backoff_max_ms = o.reconnect_backoff_max_ms;
  c.kvstream.max_connections = o.max_connections;
  c.kvstream.max_requests_per_consumer = o.max_requests_per_consumer;
  c.kvstream.max_tokens_per_consumer = o.max_tokens_per_consumer;
  c.kvstream.pipeline_group = o.pipeline_group;
  c.kvstream.pipeline_parallel_size = o.pipeline_parallel_size;
  c.kvstream.pipeline_rank = o.pipeline_rank;
  if (!o.pipeline_layers.empty()) {
    auto ranges = ParseLayerRanges(o.pipeline_layers);
    EXPECT_TRUE(ranges.ok()) << ranges.status();
    if (ranges.ok()) c.kvstream.pipeline_layers = *ranges;
  }
  auto transport = fabric.CreateTransport(name);
  EXPECT_TRUE(transport.ok()) << transport.status();
  std::unique_ptr<Transport> t = std::move(transport).value();
  if (o.corrupt) t = std::make_unique<CorruptingTransport>(std::move(t), o.corrupt_writes);
  auto scheduler = CreateKvConnectorScheduler(c, o.block_size);
  EXPECT_TRUE(scheduler.ok()) << scheduler.status();
  auto worker = CreateKvConnectorWorker(c, std::move(t));
  EXPECT_TRUE(worker.ok()) << worker.status();
  node->connector =
      std::make_unique<TestConnector>(std::move(scheduler).value(), std::move(worker).value());
  KvCacheSpec spec;
  spec.block_size = o.block_size;
  spec.num_kv_heads = 2;
  spec.head_size = 8;
  spec.head_size_v = 4;
  spec.dtype = DType::kBFloat16;
  std::map<std::string, KvCache*> by_name;
  node->caches.resize(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    if (!o.layers.empty() && std::find(o.layers.begin(), o.layers.end(), l) == o.layers.end()) {
      continue;
    }
    auto cache = KvCache::Create({spec, o.layout, o.num_blocks});
    EXPECT_TRUE(cache.ok());
    by_name[LayerName(l)] = cache->get();
    node->caches[l] = std::move(cache).value();
  }
  if (o.model.vocab_size != 0 || o.model.max_model_len != 0 || !o.model.fingerprint.empty()) {
    EXPECT_TRUE(node->connector->worker().SetModelInfo(o.model).ok());
  }
  node->register_status = node->connector->RegisterKvCaches(by_name);
  if (!o.register_may_fail) {
    EXPECT_TRUE(node->register_status.ok()) << node->register_status;
  }
  return node;
}

void FillRandom(KvCache& cache, uint32_t seed) {
  std::mt19937 rng(seed);
  const KvCacheView v = cache.view();
  const size_t kb = v.num_blocks * v.spec.KBytesPerBlock();
  const size_t vb = v.num_blocks * v.spec.VBytesPerBlock();
  for (size_t i = 0; i < kb; ++i) static_cast<uint8_t*>(v.k)[i] = static_cast<uint8_t>(rng());
  for (size_t i = 0; i < vb; ++i) static_cast<uint8_t*>(v.v)[i] = static_cast<uint8_t>(rng());
}

// Whether `tokens` tokens of the request match between the two caches.
bool TokensEqual(const KvCache& src, const std::vector<int32_t>& sb, const KvCache& dst,
                 const std::vector<int32_t>& db, int tokens) {
  const KvCacheView s = src.view(), d = dst.view();
  const size_t es = DTypeSize(s.spec.dtype);
  for (int t = 0; t < tokens; ++t) {
    const int b = t / s.spec.block_size, o = t % s.spec.block_size;
    for (int h = 0; h < s.spec.num_kv_heads; ++h) {
      if (std::memcmp(static_cast<char*>(s.k) + s.k_strides.Offset(sb[b], o, h, 0) * es,
                      static_cast<char*>(d.k) + d.k_strides.Offset(db[b], o, h, 0) * es,
                      s.spec.head_size * es) != 0 ||
          std::memcmp(static_cast<char*>(s.v) + s.v_strides.Offset(sb[b], o, h, 0) * es,
                      static_cast<char*>(d.v) + d.v_strides.Offset(db[b], o, h, 0) * es,
                      s.spec.head_size_v * es) != 0) {
        return false;
      }
    }
  }
  return true;
}

bool TokenIsZero(const KvCache& cache, int32_t block, int offset) {
  const KvCacheView v = cache.view();
  const size_t es = DTypeSize(v.spec.dtype);
  for (int h = 0; h < v.spec.num_kv_heads; ++h) {
    const char* p = static_cast<char*>(v.k) + v.k_strides.Offset(block, offset, h, 0) * es;
    for (size_t i = 0; i < v.spec.head_size * es; ++i) {
      if (p[i] != 0) return false;
    }
  }
  return true;
}

class LayerwiseConnectorTest : public ::testing::TestWithParam<KvLayout> {
 protected:
  void Start(NodeOptions producer, NodeOptions consumer) {
    producer.role = KvRole::kProducer;
    consumer.role = KvRole::kConsumer;
    producer.layout = consumer.layout = GetParam();
    p_ = MakeNode(fabric_, "p", producer);
    d_ = MakeNode(fabric_, "d", consumer);
    for (int l = 0; l < kLayers; ++l) FillRandom(*p_->caches[l], 100 + l);
    const std::string addr = p_->connector->control_address();
    const size_t colon = addr.rfind(':');
    remote_.host = addr.substr(0, colon);
    remote_.port = std::stoi(addr.substr(colon + 1));
  }

  // Consumer side: a request of `prompt_len` tokens into `blocks`, handed to the producer.
  KvRequest ConsumerAdmit(const std::string& id, int prompt_len, const std::vector<int32_t>& blocks) {
    return AdmitOn(*d_, id, prompt_len, blocks);
  }
  KvRequest AdmitOn(Node& node, const std::string& id, int prompt_len,
                    const std::vector<int32_t>& blocks) {
    KvRequest r;
    r.request_id = id;
    for (int i = 0; i < prompt_len; ++i) r.prompt_token_ids.push_back(1000 + i);
    r.remote_prefill = remote_;
    auto m = node.connector->GetNumNewMatchedTokens(r, 0);
    EXPECT_TRUE(m.ok());
    EXPECT_EQ(m->num_tokens, prompt_len - 1);
    EXPECT_TRUE(node.connector->UpdateStateAfterAlloc(r, blocks, m->num_tokens).ok());
    return r;
  }

  KvConnectorMetadata ConsumerStep(const std::vector<ScheduledRequest>& scheduled) {
    return StepOn(*d_, scheduled);
  }
  KvConnectorMetadata StepOn(Node& node, const std::vector<ScheduledRequest>& scheduled) {
    auto meta = node.connector->BuildConnectorMeta(scheduled);
    EXPECT_TRUE(meta.ok());
    EXPECT_TRUE(node.connector->BindConnectorMetadata(*meta).ok());
    EXPECT_TRUE(node.connector->StartLoadKv().ok());
    return *meta;
  }

  // Consumer side: load errors, waiting up to 10 s for the first one.
  static std::vector<LoadError> AwaitLoadErrors(TestConnector& c) {
    std::vector<LoadError> errors;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (errors.empty() && absl::Now() < deadline) {
      errors = c.TakeLoadErrors();
      absl::SleepFor(absl::Milliseconds(2));
    }
    return errors;
  }

  // Consumer d_: request `id` failed with one load error whose message says `why`, no
  // request reached the producer's engine, and the request is reported finished.
  void ExpectConsumerRequestFailed(const std::string& id, const std::string& why) {
    std::vector<LoadError> errors = AwaitLoadErrors(*d_->connector);
    ASSERT_EQ(errors.size(), 1u);
    EXPECT_EQ(errors[0].request_id, id);
    EXPECT_THAT(errors[0].status.message(), HasSubstr(why));
    EXPECT_TRUE(p_->connector->TakeIncomingRequests().empty());
    EXPECT_TRUE(PollFinished(*d_->connector, id, false).finished_recving.count(id));
  }

  // Producer side: waits for `n` requests to arrive.
  std::vector<KvRequest> ProducerTake(size_t n) {
    std::vector<KvRequest> got;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (got.size() < n && absl::Now() < deadline) {
      for (KvRequest& r : p_->connector->TakeIncomingRequests()) got.push_back(std::move(r));
      absl::SleepFor(absl::Milliseconds(1));
    }
    return got;
  }

  // Producer: allocate, schedule the whole prompt, run `layers` layers' hooks.
  void ProducerPrefill(const KvRequest& r, const std::vector<int32_t>& blocks, int layers) {
    ASSERT_TRUE(p_->connector->UpdateStateAfterAlloc(r, blocks, 0).ok());
    const int n = static_cast<int>(r.prompt_token_ids.size());
    auto meta = p_->connector->BuildConnectorMeta({{r.request_id, 0, n}});
    ASSERT_TRUE(meta.ok());
    ASSERT_EQ(meta->saves.size(), 1u);
    ASSERT_TRUE(p_->connector->BindConnectorMetadata(*meta).ok());
    AttentionMetadata unused;
    for (int l = 0; l < layers; ++l) {
      ASSERT_TRUE(p_->connector->AfterAttention(LayerName(l), *p_->caches[l], unused, nullptr).ok());
    }
    EXPECT_TRUE(p_->connector->WaitForSave().ok());
    p_->connector->ClearConnectorMetadata();
  }

  FinishedRequests PollFinished(TestConnector& c, const std::string& id, bool sending) {
    FinishedRequests all;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      auto f = c.GetFinished();
      EXPECT_TRUE(f.ok());
      all.finished_sending.insert(f->finished_sending.begin(), f->finished_sending.end());
      all.finished_recving.insert(f->finished_recving.begin(), f->finished_recving.end());
      if ((sending ? all.finished_sending : all.finished_recving).count(id)) break;
      absl::SleepFor(absl::Milliseconds(2));
    }
    return all;
  }

  LoopbackFabric fabric_;
  std::unique_ptr<Node> p_;
  std::unique_ptr<Node> d_;
  RemotePrefill remote_;
};

TEST_P(LayerwiseConnectorTest, StreamsEveryLayerIntoScatteredBlocks) {
  Start({}, {});
  const std::vector<int32_t> d_blocks = {9, 2, 14};   // 11 remote tokens of block size 4
  const std::vector<int32_t> p_blocks = {5, 6, 0};
  KvRequest r = ConsumerAdmit("req-1", 12, d_blocks);
  KvConnectorMetadata dm = ConsumerStep({{"req-1", 0, 12}});
  ASSERT_EQ(dm.loads.size(), 1u);
  ASSERT_EQ(dm.waits.size(), 1u);

  auto incoming = ProducerTake(1);
  ASSERT_EQ(incoming.size(), 1u);
  // The engine knows it by an id scoped by its consumer.
  EXPECT_EQ(incoming[0].request_id, "d/req-1");
  EXPECT_EQ(incoming[0].prompt_token_ids, r.prompt_token_ids);
  ProducerPrefill(incoming[0], p_blocks, kLayers);

  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(d_->connector->BeforeAttention(LayerName(l), nullptr).ok());
    EXPECT_TRUE(TokensEqual(*p_->caches[l], p_blocks, *d_->caches[l], d_blocks, 11)) << l;
    // The last prompt token is the consumer's own: its slot is not written.
    EXPECT_TRUE(TokenIsZero(*d_->caches[l], 14, 3)) << l;
  }
  d_->connector->ClearConnectorMetadata();
  EXPECT_TRUE(d_->connector->TakeLoadErrors().empty());
  EXPECT_TRUE(d_->connector->GetBlockIdsWithLoadErrors().empty());
  // 11 tokens x (K: 2 heads x 8 + V: 2 heads x 4) bf16 x 3 layers.
  const uint64_t expected_bytes = 11u * (2 * 8 + 2 * 4) * 2 * kLayers;
  EXPECT_EQ(d_->connector->stats().bytes_received, expected_bytes);
  EXPECT_EQ(d_->connector->stats().layers_received, static_cast<uint64_t>(kLayers));
  std::vector<RequestTransferStats> rs = d_->connector->TakeRequestStats();
  ASSERT_EQ(rs.size(), 1u);
  EXPECT_EQ(rs[0].request_id, "req-1");
  EXPECT_EQ(rs[0].bytes, expected_bytes);
  ASSERT_EQ(rs[0].layer_arrival_ms.size(), static_cast<size_t>(kLayers));
  for (double ms : rs[0].layer_arrival_ms) EXPECT_GT(ms, 0.0);
  EXPECT_GT(rs[0].transfer_ms, 0.0);
  // Every layer's time in flight, which together make the transfer time.
  ASSERT_EQ(rs[0].layer_in_flight_ms.size(), static_cast<size_t>(kLayers));
  double in_flight = 0;
  for (double ms : rs[0].layer_in_flight_ms) {
    EXPECT_GT(ms, 0.0);
    in_flight += ms;
  }
  EXPECT_NEAR(in_flight, rs[0].transfer_ms, 1e-6);
  EXPECT_TRUE(d_->connector->TakeRequestStats().empty());
  FinishedRequests df = PollFinished(*d_->connector, "req-1", false);
  EXPECT_TRUE(df.finished_recving.count("req-1"));

  auto delay = p_->connector->RequestFinished("d/req-1");
  ASSERT_TRUE(delay.ok());
  if (*delay) {
    FinishedRequests pf = PollFinished(*p_->connector, "d/req-1", true);
    EXPECT_TRUE(pf.finished_sending.count("d/req-1"));
  }
  EXPECT_EQ(p_->connector->stats().bytes_sent, expected_bytes);
  EXPECT_EQ(p_->connector->stats().layers_sent, static_cast<uint64_t>(kLayers));
  // The producer's timeline of the request, on the clock of the consumer's hand-off: every
  // layer ready (host caches: posted) after the hand-off, sent after it was ready and no
  // later than the consumer saw it arrive.
  std::vector<RequestSendStats> ss = p_->connector->TakeSendStats();
  ASSERT_EQ(ss.size(), 1u);
  EXPECT_EQ(ss[0].request_id, "d/req-1");
  EXPECT_EQ(ss[0].consumer_request_id, "req-1");
  EXPECT_TRUE(ss[0].ok);
  EXPECT_EQ(ss[0].bytes, expected_bytes);
  ASSERT_EQ(ss[0].layer_ready_ns.size(), static_cast<size_t>(kLayers));
  ASSERT_EQ(ss[0].layer_sent_ns.size(), static_cast<size_t>(kLayers));
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_GT(ss[0].layer_ready_ns[l], rs[0].handoff_ns) << l;
    EXPECT_GE(ss[0].layer_sent_ns[l], ss[0].layer_ready_ns[l]) << l;
    const uint64_t arrival_ns =
        rs[0].handoff_ns + static_cast<uint64_t>(rs[0].layer_arrival_ms[l] * 1e6);
    EXPECT_GT(arrival_ns, ss[0].layer_ready_ns[l]) << l;
  }
  EXPECT_TRUE(p_->connector->TakeSendStats().empty());
  EXPECT_TRUE(d_->connector->TakeSendStats().empty());  // a consumer sends nothing
}

TEST_P(LayerwiseConnectorTest, SeveralRequestsInFlight) {
  Start({}, {});
  const std::vector<std::vector<int32_t>> d_blocks = {{0, 1}, {7}, {3, 12, 13, 4}};
  const std::vector<std::vector<int32_t>> p_blocks = {{10, 11}, {2}, {6, 5, 4, 3}};
  const int lens[] = {6, 3, 16};
  std::vector<ScheduledRequest> sched;
  for (int i = 0; i < 3; ++i) {
    ConsumerAdmit(absl::StrCat("r", i), lens[i], d_blocks[i]);
    sched.push_back({absl::StrCat("r", i), 0, lens[i]});
  }
  KvConnectorMetadata dm = ConsumerStep(sched);
  EXPECT_EQ(dm.waits.size(), 3u);
  auto incoming = ProducerTake(3);
  ASSERT_EQ(incoming.size(), 3u);
  std::map<std::string, int> index = {{"d/r0", 0}, {"d/r1", 1}, {"d/r2", 2}};
  std::vector<ScheduledRequest> psched;
  for (const KvRequest& r : incoming) {
    ASSERT_TRUE(p_->connector->UpdateStateAfterAlloc(r, p_blocks[index[r.request_id]], 0).ok());
    psched.push_back({r.request_id, 0, static_cast<int32_t>(r.prompt_token_ids.size())});
  }
  auto meta = p_->connector->BuildConnectorMeta(psched);
  ASSERT_EQ(meta->saves.size(), 3u);
  ASSERT_TRUE(p_->connector->BindConnectorMetadata(*meta).ok());
  AttentionMetadata unused;
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(p_->connector->AfterAttention(LayerName(l), *p_->caches[l], unused, nullptr).ok());
  }
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(d_->connector->BeforeAttention(LayerName(l), nullptr).ok());
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(TokensEqual(*p_->caches[l], p_blocks[i], *d_->caches[l], d_blocks[i], lens[i] - 1));
    }
  }
  EXPECT_TRUE(d_->connector->TakeLoadErrors().empty());
}

TEST_P(LayerwiseConnectorTest, PrefillSlowerThanTheSendTimeoutStillStreams) {
  // The send timeout bounds transfers in flight, not the prefill's compute: layers posted
  // 300 ms apart under a 100 ms send timeout all arrive.
  NodeOptions producer;
  producer.send_timeout_ms = 100;
  Start(producer, {});
  const std::vector<int32_t> d_blocks = {3, 8, 1}, p_blocks = {0, 7, 12};
  ConsumerAdmit("slow-prefill", 10, d_blocks);
  ConsumerStep({{"slow-prefill", 0, 10}});
  auto incoming = ProducerTake(1);
  ASSERT_EQ(incoming.size(), 1u);
  ASSERT_TRUE(p_->connector->UpdateStateAfterAlloc(incoming[0], p_blocks, 0).ok());
  auto meta = p_->connector->BuildConnectorMeta({{"d/slow-prefill", 0, 10}});
  ASSERT_TRUE(meta.ok());
  ASSERT_TRUE(p_->connector->BindConnectorMetadata(*meta).ok());
  AttentionMetadata unused;
  for (int l = 0; l < kLayers; ++l) {
    absl::SleepFor(absl::Milliseconds(300));  // the layer's compute
    ASSERT_TRUE(p_->connector->AfterAttention(LayerName(l), *p_->caches[l], unused, nullptr).ok());
  }
  EXPECT_TRUE(p_->connector->WaitForSave().ok());
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(d_->connector->BeforeAttention(LayerName(l), nullptr).ok());
    EXPECT_TRUE(TokensEqual(*p_->caches[l], p_blocks, *d_->caches[l], d_blocks, 9)) << l;
  }
  EXPECT_TRUE(d_->connector->TakeLoadErrors().empty());
}

TEST_P(LayerwiseConnectorTest, LayerThatNeverArrivesIsALoadErrorAtTheDeadline) {
  NodeOptions consumer;
  consumer.load_timeout_ms = 200;
  Start({}, consumer);
  ConsumerAdmit("slow", 9, {1, 2, 3});
  ConsumerStep({{"slow", 0, 9}});
  auto incoming = ProducerTake(1);
  ASSERT_EQ(incoming.size(), 1u);
  ASSERT_TRUE(p_->connector->UpdateStateAfterAlloc(incoming[0], {4, 5, 6}, 0).ok());
  // The producer never runs the prefill. The consumer's wait returns at its deadline and the
  // request becomes a load error; the layer still runs for the rest of the batch.
  EXPECT_TRUE(d_->connector->BeforeAttention(LayerName(0), nullptr).ok());
  auto errors = d_->connector->TakeLoadErrors();
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].request_id, "slow");
  EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(errors[0].block_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(d_->connector->GetBlockIdsWithLoadErrors(), (std::set<int32_t>{1, 2, 3}));
  // Later layers do not wait again for a failed request.
  EXPECT_TRUE(d_->connector->BeforeAttention(LayerName(1), nullptr).ok());
  // The consumer aborted; the producer stops and confirms, so both sides can free blocks.
  EXPECT_TRUE(PollFinished(*d_->connector, "slow", false).finished_recving.count("slow"));
  auto delay = p_->connector->RequestFinished("d/slow");
  ASSERT_TRUE(delay.ok());
  if (*delay) {
    EXPECT_TRUE(PollFinished(*p_->connector, "d/slow", true).finished_sending.count("d/slow"));
  }
}

TEST_P(LayerwiseConnectorTest, LostProducerFailsTheRequestFast) {
  Start({}, {});
  ConsumerAdmit("orphan", 9, {1, 2, 3});
  ConsumerStep({{"orphan", 0, 9}});
  auto incoming = ProducerTake(1);
  ASSERT_EQ(incoming.size(), 1u);
  ASSERT_TRUE(p_->connector->UpdateStateAfterAlloc(incoming[0], {4, 5, 6}, 0).ok());
  auto meta = p_->connector->BuildConnectorMeta({{"d/orphan", 0, 9}});
  ASSERT_TRUE(p_->connector->BindConnectorMetadata(*meta).ok());
  AttentionMetadata unused;
  ASSERT_TRUE(p_->connector->AfterAttention(LayerName(0), *p_->caches[0], unused, nullptr).ok());
  ASSERT_TRUE(d_->connector->BeforeAttention(LayerName(0), nullptr).ok());
  p_.reset();  // the producer goes away mid-stream (its control connection closes)
  ASSERT_TRUE(d_->connector->BeforeAttention(LayerName(1), nullptr).ok());
  auto errors = d_->connector->TakeLoadErrors();
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(PollFinished(*d_->connector, "orphan", false).finished_recving.count("orphan"));
}

// The producer goes away with a request in flight and comes back at the same address (a
// restarted prefill worker): the consumer, never restarted, fails the request that was in
// flight, then hands the next one to the new producer over a new link (a second handshake)
// and gets its KV.
TEST_P(LayerwiseConnectorTest, RestartedProducerAtTheSameAddressIsUsedAgain) {
  NodeOptions consumer;
  consumer.reconnect_backoff_ms = 0;  // the first load after the loss may reconnect
  consumer.reconnect_backoff_max_ms = 0;
  Start({}, consumer);
  ConsumerAdmit("before", 9, {1, 2, 3});
  ConsumerStep({{"before", 0, 9}});
  ASSERT_EQ(ProducerTake(1).size(), 1u);
  d_->connector->ClearConnectorMetadata();
  p_.reset();  // killed with the request in flight
  std::vector<LoadError> lost = AwaitLoadErrors(*d_->connector);
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].request_id, "before");
  EXPECT_EQ(lost[0].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(lost[0].status.message(), HasSubstr("lost producer"));
  ASSERT_TRUE(PollFinished(*d_->connector, "before", false).finished_recving.count("before"));
  EXPECT_EQ(d_->connector->stats().handshakes, 1u);

  NodeOptions restarted;
  restarted.role = KvRole::kProducer;
  restarted.layout = GetParam();
  restarted.port = remote_.port;
  p_ = MakeNode(fabric_, "p", restarted);
  for (int l = 0; l < kLayers; ++l) FillRandom(*p_->caches[l], 200 + l);
  ASSERT_EQ(p_->connector->control_address(),
            absl::StrCat(remote_.host, ":", remote_.port));

  const std::vector<int32_t> d_blocks = {4, 11, 7};
  const std::vector<int32_t> p_blocks = {3, 8, 1};
  ConsumerAdmit("after", 12, d_blocks);
  ConsumerStep({{"after", 0, 12}});
  auto incoming = ProducerTake(1);
  ASSERT_EQ(incoming.size(), 1u);
  EXPECT_EQ(incoming[0].request_id, "d/after");
  ProducerPrefill(incoming[0], p_blocks, kLayers);
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(d_->connector->BeforeAttention(LayerName(l), nullptr).ok());
    EXPECT_TRUE(TokensEqual(*p_->caches[l], p_blocks, *d_->caches[l], d_blocks, 11)) << l;
  }
  d_->connector->ClearConnectorMetadata();
  EXPECT_TRUE(d_->connector->TakeLoadErrors().empty());
  EXPECT_TRUE(PollFinished(*d_->connector, "after", false).finished_recving.count("after"));
  EXPECT_EQ(d_->connector->stats().handshakes, 2u);
  EXPECT_EQ(d_->connector->stats().handshake_failures, 0u);
  EXPECT_EQ(d_->connector->stats().layers_received, static_cast<uint64_t>(kLayers));
}

// While a producer is down and its backoff has not passed, loads to it fail at once with an
// error that says so, without trying to reach it (no handshake attempt is made).
TEST_P(LayerwiseConnectorTest, LoadsToADownProducerFailAtOnceWithinTheBackoff) {
  NodeOptions consumer;
  consumer.reconnect_backoff_ms = 3600000;  // never due within the test
  consumer.reconnect_backoff_max_ms = 3600000;
  Start({}, consumer);
  ConsumerAdmit("first", 5, {1, 2});
  ConsumerStep({{"first", 0, 5}});
  ASSERT_EQ(ProducerTake(1).size(), 1u);
  d_->connector->ClearConnectorMetadata();
  p_.reset();
  ASSERT_EQ(AwaitLoadErrors(*d_->connector).size(), 1u);  // "first": the link was lost
  ASSERT_TRUE(PollFinished(*d_->connector, "first", false).finished_recving.count("first"));

  ConsumerAdmit("second", 5, {3, 4});
  ConsumerStep({{"second", 0, 5}});
  // StartLoadKv failed it before returning: no wait.
  std::vector<LoadError> errors = d_->connector->TakeLoadErrors();
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].request_id, "second");
  EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(errors[0].status.message(),
              HasSubstr(absl::StrCat("producer ", remote_.host, ":", remote_.port, " is down")));
  EXPECT_THAT(errors[0].status.message(), HasSubstr("next connection attempt in"));
  EXPECT_TRUE(PollFinished(*d_->connector, "second", false).finished_recving.count("second"));
  EXPECT_EQ(d_->connector->stats().handshakes, 1u);
  EXPECT_EQ(d_->connector->stats().handshake_failures, 0u);  // it was not tried
  EXPECT_TRUE(d_->connector->GetBlockIdsWithLoadErrors().empty());
  // Both load errors are charged to the producer by the engine id it gave when it was up.
  std::vector<PeerConnectorStats> peers = d_->connector->peer_stats();
  ASSERT_EQ(peers.size(), 1u);
  EXPECT_EQ(peers[0].peer, "p");
  EXPECT_EQ(peers[0].stats.load_errors, 2u);
}

// A producer that does not answer: the first load's attempt fails (one handshake failure);
// the next loads within the backoff fail at once without another attempt.
TEST_P(LayerwiseConnectorTest, UnreachableProducerIsTriedOncePerBackoff) {
  NodeOptions consumer;
  consumer.reconnect_backoff_ms = 3600000;
  consumer.reconnect_backoff_max_ms = 3600000;
  Start({}, consumer);
  p_.reset();  // nothing listens at its address any more
  for (const char* id : {"a", "b", "c"}) {
    ConsumerAdmit(id, 5, {1, 2});
    ConsumerStep({{id, 0, 5}});
    std::vector<LoadError> errors = d_->connector->TakeLoadErrors();
    ASSERT_EQ(errors.size(), 1u) << id;
    EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kUnavailable) << id;
    if (std::string(id) == "a") {
      EXPECT_THAT(errors[0].status.message(), HasSubstr("cannot reach producer"));
    } else {
      EXPECT_THAT(errors[0].status.message(), HasSubstr("is down")) << id;
      EXPECT_THAT(errors[0].status.message(), HasSubstr("cannot reach producer")) << id;
    }
    ASSERT_TRUE(PollFinished(*d_->connector, id, false).finished_recving.count(id)) << id;
    d_->connector->ClearConnectorMetadata();
  }
  EXPECT_EQ(d_->connector->stats().handshake_failures, 1u);
  EXPECT_EQ(d_->connector->stats().handshakes, 0u);
}

TEST_P(LayerwiseConnectorTest, ChecksumMismatchIsDataLoss) {
  NodeOptions producer;
  producer.corrupt = true;
  Start(producer, {});
  ConsumerAdmit("bad", 5, {7, 8});
  ConsumerStep({{"bad", 0, 5}});
  auto incoming = ProducerTake(1);
  ASSERT_EQ(incoming.size(), 1u);
  ProducerPrefill(incoming[0], {1, 2}, kLayers);
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(d_->connector->BeforeAttention(LayerName(l), nullptr).ok());
  auto errors = d_->connector->TakeLoadErrors();
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(errors[0].status.message(), HasSubstr("checksum"));
}

// A request whose KV arrives corrupt fails alone: the consumer tells the producer to stop
// and the producer confirms (at once when it has already finished and forgotten the
// request), so another request handed over on the same link still completes after the
// consumer's confirmation deadline, instead of failing when that deadline closes the link.
TEST_P(LayerwiseConnectorTest, CorruptRequestFailsAloneAndTheLinkSurvives) {
  NodeOptions producer;
  producer.corrupt = true;
  producer.corrupt_writes = 1;  // the first request's first layer, nothing after
  NodeOptions consumer;
  consumer.send_timeout_ms = 300;  // how long the consumer waits for a confirmation
  Start(producer, consumer);
  ConsumerAdmit("bad", 5, {7, 8});
  ConsumerAdmit("good", 5, {3, 4});
  ConsumerStep({{"bad", 0, 5}, {"good", 0, 5}});
  auto incoming = ProducerTake(2);
  ASSERT_EQ(incoming.size(), 2u);
  const KvRequest& bad = incoming[0].request_id == "d/bad" ? incoming[0] : incoming[1];
  const KvRequest& good = incoming[0].request_id == "d/bad" ? incoming[1] : incoming[0];
  ProducerPrefill(bad, {1, 2}, kLayers);
  auto delay = p_->connector->RequestFinished("d/bad");
  ASSERT_TRUE(delay.ok());
  if (*delay) {
    ASSERT_TRUE(PollFinished(*p_->connector, "d/bad", true).finished_sending.count("d/bad"));
  }
  auto errors = AwaitLoadErrors(*d_->connector);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].request_id, "bad");
  EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kDataLoss);

  // Past the deadline by which the consumer needs the producer's confirmation.
  absl::SleepFor(absl::Milliseconds(3 * consumer.send_timeout_ms));
  ProducerPrefill(good, {5, 6}, kLayers);
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(d_->connector->BeforeAttention(LayerName(l), nullptr).ok());
    EXPECT_TRUE(TokensEqual(*p_->caches[l], {5, 6}, *d_->caches[l], {3, 4}, 4)) << l;
  }
  EXPECT_TRUE(d_->connector->TakeLoadErrors().empty());
  d_->connector->ClearConnectorMetadata();
  FinishedRequests f = PollFinished(*d_->connector, "good", false);
  EXPECT_TRUE(f.finished_recving.count("good"));
}

TEST_P(LayerwiseConnectorTest, CompatibilityMismatchRejectedAtHandshake) {
  NodeOptions consumer;
  consumer.block_size = 8;  // the producer uses 4
  Start({}, consumer);
  ConsumerAdmit("x", 9, {1, 2});
  ConsumerStep({{"x", 0, 9}});
  auto errors = d_->connector->TakeLoadErrors();
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(errors[0].status.message(), HasSubstr("compatibility"));
  EXPECT_TRUE(ProducerTake(0).empty());
  EXPECT_TRUE(p_->connector->TakeIncomingRequests().empty());
}

TEST_P(LayerwiseConnectorTest, WrongSecretRejected) {
  NodeOptions producer, consumer;
  producer.secret = "right";
  consumer.secret = "wrong";
  Start(producer, consumer);
  ConsumerAdmit("x", 5, {1, 2});
  ConsumerStep({{"x", 0, 5}});
  auto errors = d_->connector->TakeLoadErrors();
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kPermissionDenied);
}

TEST_P(LayerwiseConnectorTest, DestinationBlocksOutsideTheCacheRejected) {
  Start({}, {});
  ConsumerAdmit("oob", 5, {999, 1});
  ConsumerStep({{"oob", 0, 5}});
  // The producer rejects the hand-off; the consumer learns it asynchronously.
  std::vector<LoadError> errors = AwaitLoadErrors(*d_->connector);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(errors[0].status.message(), HasSubstr("999"));
  EXPECT_TRUE(p_->connector->TakeIncomingRequests().empty());
}

// A prompt token outside the prefill model's vocabulary fails that request alone (its
// consumer gets the producer's InvalidArgument); the producer's engine never sees it and
// the next request on the same link streams.
TEST_P(LayerwiseConnectorTest, TokenOutsideTheVocabularyFailsOnlyItsRequest) {
  NodeOptions producer, consumer;
  producer.model.vocab_size = consumer.model.vocab_size = 1010;  // prompts are 1000, 1001, ...
  Start(producer, consumer);
  ConsumerAdmit("bad", 12, {1, 2, 3});  // token 1010 at position 10
  ConsumerAdmit("good", 9, {4, 5, 6});
  ConsumerStep({{"bad", 0, 12}, {"good", 0, 9}});
  std::vector<LoadError> errors = AwaitLoadErrors(*d_->connector);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].request_id, "bad");
  EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(errors[0].status.message(), HasSubstr("outside the vocabulary of the prefill model, [0, 1010)"));
  auto incoming = ProducerTake(1);
  ASSERT_EQ(incoming.size(), 1u);
  EXPECT_EQ(incoming[0].prompt_token_ids.size(), 9u);
  ProducerPrefill(incoming[0], {7, 8, 9}, kLayers);
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(d_->connector->BeforeAttention(LayerName(l), nullptr).ok());
    EXPECT_TRUE(TokensEqual(*p_->caches[l], {7, 8, 9}, *d_->caches[l], {4, 5, 6}, 8)) << l;
  }
  EXPECT_TRUE(d_->connector->TakeLoadErrors().empty());
  EXPECT_TRUE(PollFinished(*d_->connector, "bad", false).finished_recving.count("bad"));
}

// The vocabulary and the model's fingerprint are in the compatibility hash.
TEST_P(LayerwiseConnectorTest, OtherVocabularyOrModelRejectedAtHandshake) {
  for (const bool vocabulary : {true, false}) {
    SCOPED_TRACE(vocabulary ? "larger vocabulary" : "other model");
    NodeOptions producer, consumer;
    producer.model = {32000, 0, "weights A"};
    consumer.model = vocabulary ? KvModelInfo{128256, 0, "weights A"}
                                : KvModelInfo{32000, 0, "weights B"};
    Start(producer, consumer);
    ConsumerAdmit("x", 9, {1, 2, 3});
    ConsumerStep({{"x", 0, 9}});
    std::vector<LoadError> errors = d_->connector->TakeLoadErrors();
    ASSERT_EQ(errors.size(), 1u);
    EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(errors[0].status.message(), HasSubstr("compatibility mismatch"));
    EXPECT_THAT(errors[0].status.message(),
                HasSubstr(vocabulary ? "vocabulary 128256" : "weights B"));
    EXPECT_TRUE(p_->connector->TakeIncomingRequests().empty());
    d_.reset();
    p_.reset();
  }
}

// A prompt that the producer could never prefill (longer than its model allows, or than its
// whole cache holds) is refused at hand-off instead of being queued for good; a prompt that
// fits still goes through.
TEST_P(LayerwiseConnectorTest, PromptsBeyondTheModelOrTheCacheRejectedAtHandOff) {
  for (const bool model_limit : {true, false}) {
    SCOPED_TRACE(model_limit ? "max_model_len" : "cache size");
    NodeOptions producer, consumer;
    consumer.num_blocks = 64;
    if (model_limit) {
      producer.model.max_model_len = 16;
    } else {
      producer.num_blocks = 4;  // 16 tokens of block size 4
    }
    Start(producer, consumer);
    ConsumerAdmit("huge", 17, {1, 2, 3, 4, 5});
    ConsumerAdmit("fits", 16, {6, 7, 8, 9});
    ConsumerStep({{"huge", 0, 17}, {"fits", 0, 16}});
    std::vector<LoadError> errors = AwaitLoadErrors(*d_->connector);
    ASSERT_EQ(errors.size(), 1u);
    EXPECT_EQ(errors[0].request_id, "huge");
    EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(errors[0].status.message(),
                HasSubstr(model_limit ? "longer than the maximum model length of the prefill worker, 16"
                                      : "more than the whole cache of the prefill worker (4 blocks"));
    auto incoming = ProducerTake(1);
    ASSERT_EQ(incoming.size(), 1u);
    EXPECT_EQ(incoming[0].prompt_token_ids.size(), 16u);
    EXPECT_TRUE(p_->connector->TakeIncomingRequests().empty());
    d_.reset();
    p_.reset();
  }
}

// One consumer's requests (or prompt tokens) in flight are bounded: beyond, a hand-off is
// refused with ResourceExhausted; once requests finished, there is room again.
TEST_P(LayerwiseConnectorTest, RequestsInFlightPerConsumerBounded) {
  for (const bool by_requests : {true, false}) {
    SCOPED_TRACE(by_requests ? "max_requests_per_consumer" : "max_tokens_per_consumer");
    NodeOptions producer;
    if (by_requests) {
      producer.max_requests_per_consumer = 2;
    } else {
      producer.max_tokens_per_consumer = 12;  // two 5-token prompts, not three
    }
    Start(producer, {});
    ConsumerAdmit("r0", 5, {0, 1});
    ConsumerAdmit("r1", 5, {2, 3});
    ConsumerAdmit("r2", 5, {4, 5});
    ConsumerStep({{"r0", 0, 5}, {"r1", 0, 5}, {"r2", 0, 5}});
    std::vector<LoadError> errors = AwaitLoadErrors(*d_->connector);
    ASSERT_EQ(errors.size(), 1u);
    EXPECT_EQ(errors[0].request_id, "r2");
    EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(errors[0].status.message(),
                HasSubstr(by_requests ? "max_requests_per_consumer 2"
                                      : "max_tokens_per_consumer 12"));
    auto incoming = ProducerTake(2);
    ASSERT_EQ(incoming.size(), 2u);
    int next_block = 8;
    for (const KvRequest& r : incoming) {
      ProducerPrefill(r, {next_block, next_block + 1}, kLayers);
      next_block += 2;
    }
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(d_->connector->BeforeAttention(LayerName(l), nullptr).ok());
    }
    d_->connector->ClearConnectorMetadata();
    for (const KvRequest& r : incoming) {
      auto delay = p_->connector->RequestFinished(r.request_id);
      ASSERT_TRUE(delay.ok());
      if (*delay) {
        EXPECT_TRUE(
            PollFinished(*p_->connector, r.request_id, true).finished_sending.count(r.request_id));
      }
    }
    // Both done: a new request is accepted.
    ConsumerAdmit("r3", 5, {6, 7});
    ConsumerStep({{"r3", 0, 5}});
    EXPECT_EQ(ProducerTake(1).size(), 1u);
    EXPECT_TRUE(d_->connector->TakeLoadErrors().empty());
    d_.reset();
    p_.reset();
  }
}

// Request ids are each consumer's own: two consumers handing over "req-0" at once both get
// their own KV, and every message back to each uses its own id.
TEST_P(LayerwiseConnectorTest, TwoConsumersMayUseTheSameRequestId) {
  Start({}, {});
  NodeOptions other;
  other.layout = GetParam();
  auto d2 = MakeNode(fabric_, "d2", other);
  const std::vector<int32_t> b1 = {9, 2, 14}, b2 = {4, 11, 7};
  AdmitOn(*d_, "req-0", 12, b1);
  AdmitOn(*d2, "req-0", 10, b2);  // another prompt under the same id
  StepOn(*d_, {{"req-0", 0, 12}});
  StepOn(*d2, {{"req-0", 0, 10}});
  auto incoming = ProducerTake(2);
  ASSERT_EQ(incoming.size(), 2u);
  std::sort(incoming.begin(), incoming.end(),
            [](const KvRequest& a, const KvRequest& b) { return a.request_id < b.request_id; });
  EXPECT_EQ(incoming[0].request_id, "d/req-0");
  EXPECT_EQ(incoming[0].prompt_token_ids.size(), 12u);
  EXPECT_EQ(incoming[1].request_id, "d2/req-0");
  EXPECT_EQ(incoming[1].prompt_token_ids.size(), 10u);
  // Distinct source blocks, so that each consumer's data is its own request's.
  const std::vector<int32_t> p1 = {5, 6, 0}, p2 = {1, 3, 8};
  ASSERT_TRUE(p_->connector->UpdateStateAfterAlloc(incoming[0], p1, 0).ok());
  ASSERT_TRUE(p_->connector->UpdateStateAfterAlloc(incoming[1], p2, 0).ok());
  auto meta = p_->connector->BuildConnectorMeta({{"d/req-0", 0, 12}, {"d2/req-0", 0, 10}});
  ASSERT_TRUE(meta.ok());
  ASSERT_EQ(meta->saves.size(), 2u);
  ASSERT_TRUE(p_->connector->BindConnectorMetadata(*meta).ok());
  AttentionMetadata unused;
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(p_->connector->AfterAttention(LayerName(l), *p_->caches[l], unused, nullptr).ok());
  }
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(d_->connector->BeforeAttention(LayerName(l), nullptr).ok());
    ASSERT_TRUE(d2->connector->BeforeAttention(LayerName(l), nullptr).ok());
    EXPECT_TRUE(TokensEqual(*p_->caches[l], p1, *d_->caches[l], b1, 11)) << l;
    EXPECT_TRUE(TokensEqual(*p_->caches[l], p2, *d2->caches[l], b2, 9)) << l;
  }
  EXPECT_TRUE(d_->connector->TakeLoadErrors().empty());
  EXPECT_TRUE(d2->connector->TakeLoadErrors().empty());
  EXPECT_TRUE(PollFinished(*d_->connector, "req-0", false).finished_recving.count("req-0"));
  EXPECT_TRUE(PollFinished(*d2->connector, "req-0", false).finished_recving.count("req-0"));
  for (const KvRequest& r : incoming) {
    auto delay = p_->connector->RequestFinished(r.request_id);
    ASSERT_TRUE(delay.ok());
    if (*delay) {
      EXPECT_TRUE(
          PollFinished(*p_->connector, r.request_id, true).finished_sending.count(r.request_id));
    }
  }
}

TEST_P(LayerwiseConnectorTest, AbortOfOneConsumersRequestLeavesTheOthersSameId) {
  NodeOptions consumer;
  consumer.load_timeout_ms = 200;
  Start({}, consumer);
  NodeOptions other;
  other.layout = GetParam();
  auto d2 = MakeNode(fabric_, "d2", other);
  AdmitOn(*d_, "req-0", 9, {1, 2, 3});
  AdmitOn(*d2, "req-0", 9, {4, 5, 6});
  StepOn(*d_, {{"req-0", 0, 9}});
  StepOn(*d2, {{"req-0", 0, 9}});
  auto incoming = ProducerTake(2);
  ASSERT_EQ(incoming.size(), 2u);
  // d gives up on its req-0 (its wait times out, it aborts): d2's req-0 still streams.
  EXPECT_TRUE(d_->connector->BeforeAttention(LayerName(0), nullptr).ok());
  ASSERT_EQ(d_->connector->TakeLoadErrors().size(), 1u);
  ASSERT_TRUE(PollFinished(*d_->connector, "req-0", false).finished_recving.count("req-0"));
  ASSERT_TRUE(p_->connector->UpdateStateAfterAlloc(incoming[0], {7, 8, 9}, 0).ok());
  ASSERT_TRUE(p_->connector->UpdateStateAfterAlloc(incoming[1], {10, 11, 12}, 0).ok());
  auto meta = p_->connector->BuildConnectorMeta({{"d2/req-0", 0, 9}});
  ASSERT_TRUE(meta.ok());
  ASSERT_EQ(meta->saves.size(), 1u);
  ASSERT_TRUE(p_->connector->BindConnectorMetadata(*meta).ok());
  AttentionMetadata unused;
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(p_->connector->AfterAttention(LayerName(l), *p_->caches[l], unused, nullptr).ok());
  }
  const std::vector<int32_t> p2 = incoming[0].request_id == "d2/req-0"
                                      ? std::vector<int32_t>{7, 8, 9}
                                      : std::vector<int32_t>{10, 11, 12};
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(d2->connector->BeforeAttention(LayerName(l), nullptr).ok());
    EXPECT_TRUE(TokensEqual(*p_->caches[l], p2, *d2->caches[l], {4, 5, 6}, 8)) << l;
  }
  EXPECT_TRUE(d2->connector->TakeLoadErrors().empty());
  // The producer's timelines: d2's request, every layer sent; none for d's, which was
  // stopped before any layer left.
  std::vector<RequestSendStats> sends;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (sends.empty() && absl::Now() < deadline) {
    sends = p_->connector->TakeSendStats();
    if (sends.empty()) absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_EQ(sends.size(), 1u);
  EXPECT_EQ(sends[0].request_id, "d2/req-0");
  EXPECT_EQ(sends[0].consumer_request_id, "req-0");
  EXPECT_TRUE(sends[0].ok);
  for (uint64_t ns : sends[0].layer_sent_ns) EXPECT_GT(ns, 0u);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(p_->connector->TakeSendStats().empty());
}

// Waits (up to 20 s) until the worker serves `n` control connections; returns the last count.
int64_t AwaitConnections(TestConnector& c, int64_t n) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  int64_t now = c.stats().control_connections;
  while (now != n && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
    now = c.stats().control_connections;
  }
  return now;
}

// Connections that come and go leave nothing behind (each one's thread is joined once it
// is done), and no more than max_connections are served at once: beyond, a connection is
// closed at once; stalled handshakes end at the handshake deadline. The producer still
// serves a real consumer afterwards.
TEST_P(LayerwiseConnectorTest, ConnectionsAreBoundedAndReleasedOnClose) {
  NodeOptions producer;
  producer.max_connections = 8;
  producer.handshake_timeout_ms = 2000;
  Start(producer, {});
  int64_t most = 0;
  for (int i = 0; i < 3000; ++i) {
    auto conn = ConnectControl(remote_.host, static_cast<uint16_t>(remote_.port),
                               absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(conn.ok()) << conn.status();
    (*conn)->Close();
    if (i % 100 == 0) most = std::max(most, p_->connector->stats().control_connections);
  }
  EXPECT_LE(most, 8);
  EXPECT_EQ(AwaitConnections(*p_->connector, 0), 0);

  // 40 peers that connect and never say hello, all at once.
  std::vector<std::unique_ptr<ControlConnection>> stalled;
  for (int i = 0; i < 40; ++i) {
    auto conn = ConnectControl(remote_.host, static_cast<uint16_t>(remote_.port),
                               absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(conn.ok()) << conn.status();
    stalled.push_back(std::move(conn).value());
  }
  int challenged = 0, closed = 0;
  for (auto& conn : stalled) {
    // A served one gets the handshake's challenge; a refused one is closed at once. The
    // deadline is generous: on a loaded machine (sanitizers, two suites side by side) the
    // accept loop may still be draining the backlog of the connections above.
    auto frame = conn->Receive(absl::Now() + absl::Seconds(30));
    if (frame.ok()) {
      ++challenged;
    } else if (absl::IsUnavailable(frame.status())) {
      ++closed;
    } else {
      ADD_FAILURE() << "a stalled peer got neither the challenge nor the close: "
                    << frame.status();
    }
  }
  EXPECT_LE(challenged, 8);
  EXPECT_EQ(challenged + closed, 40);
  EXPECT_LE(p_->connector->stats().control_connections, 8);
  EXPECT_GE(p_->connector->stats().connections_refused, 32u);
  // The served ones end at the handshake deadline.
  EXPECT_EQ(AwaitConnections(*p_->connector, 0), 0);
  stalled.clear();

  const std::vector<int32_t> d_blocks = {9, 2, 14}, p_blocks = {5, 6, 0};
  ConsumerAdmit("after", 12, d_blocks);
  ConsumerStep({{"after", 0, 12}});
  auto incoming = ProducerTake(1);
  ASSERT_EQ(incoming.size(), 1u);
  ProducerPrefill(incoming[0], p_blocks, kLayers);
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(d_->connector->BeforeAttention(LayerName(l), nullptr).ok());
    EXPECT_TRUE(TokensEqual(*p_->caches[l], p_blocks, *d_->caches[l], d_blocks, 11)) << l;
  }
  EXPECT_TRUE(d_->connector->TakeLoadErrors().empty());
  EXPECT_EQ(d_->connector->stats().control_connections, 1);
}

// A consumer's links to producers are bounded too, and a lost link's reader is joined: with
// max_connections 1, a second producer is refused while the first link lives and reached
// once it is gone.
TEST_P(LayerwiseConnectorTest, ConsumerLinksAreBoundedAndReleased) {
  NodeOptions consumer;
  consumer.max_connections = 1;
  Start({}, consumer);
  NodeOptions second;
  second.role = KvRole::kProducer;
  second.layout = GetParam();
  auto p2 = MakeNode(fabric_, "p2", second);
  const std::string addr = p2->connector->control_address();
  RemotePrefill remote2;
  remote2.host = addr.substr(0, addr.rfind(':'));
  remote2.port = std::stoi(addr.substr(addr.rfind(':') + 1));

  ConsumerAdmit("first", 5, {1, 2});
  ConsumerStep({{"first", 0, 5}});
  ASSERT_EQ(ProducerTake(1).size(), 1u);
  EXPECT_EQ(d_->connector->stats().control_connections, 1);
  auto admit2 = [&](const std::string& id) {
    KvRequest r;
    r.request_id = id;
    for (int i = 0; i < 5; ++i) r.prompt_token_ids.push_back(i);
    r.remote_prefill = remote2;
    ASSERT_TRUE(d_->connector->UpdateStateAfterAlloc(r, {3, 4}, 4).ok());
    ConsumerStep({{id, 0, 5}});
  };
  admit2("second");
  std::vector<LoadError> errors = d_->connector->TakeLoadErrors();
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(errors[0].status.message(), HasSubstr("max_connections 1"));
  ASSERT_TRUE(PollFinished(*d_->connector, "second", false).finished_recving.count("second"));

  p_.reset();  // the first producer goes: its link is lost, its reader ends
  std::vector<LoadError> lost = AwaitLoadErrors(*d_->connector);
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].status.code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(PollFinished(*d_->connector, "first", false).finished_recving.count("first"));
  admit2("third");
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::vector<KvRequest> got;
  while (got.empty() && absl::Now() < deadline) {
    got = p2->connector->TakeIncomingRequests();
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].request_id, "d/third");
  EXPECT_TRUE(d_->connector->TakeLoadErrors().empty());
  EXPECT_EQ(d_->connector->stats().control_connections, 1);
}

// Strings from peers (engine ids, request ids, reasons) reach the log escaped: a peer cannot
// write lines that look like the worker's own.
TEST_P(LayerwiseConnectorTest, PeerStringsAreEscapedInTheLog) {
  absl::Mutex mu;
  std::vector<std::string> lines;
  LogSink previous = SetLogSink([&](LogLevel, absl::string_view message) {
    absl::MutexLock lock(&mu);
    lines.emplace_back(message);
  });
  NodeOptions consumer;
  consumer.load_timeout_ms = 200;
  Start({}, consumer);
  const std::string forged = "\n[kvstream E] forged\r\x1b[2J";
  NodeOptions hostile_options = consumer;
  hostile_options.layout = GetParam();
  auto hostile = MakeNode(fabric_, "h" + forged, hostile_options);
  // Refused by the producer (a destination block outside the cache), then one that the
  // consumer gives up on and aborts.
  AdmitOn(*hostile, "r1" + forged, 5, {999, 1});
  StepOn(*hostile, {{"r1" + forged, 0, 5}});
  ASSERT_EQ(AwaitLoadErrors(*hostile->connector).size(), 1u);
  AdmitOn(*hostile, "r2" + forged, 5, {2, 3});
  StepOn(*hostile, {{"r2" + forged, 0, 5}});
  ASSERT_EQ(ProducerTake(1).size(), 1u);
  ASSERT_TRUE(hostile->connector->BeforeAttention(LayerName(0), nullptr).ok());
  ASSERT_EQ(hostile->connector->TakeLoadErrors().size(), 1u);
  ASSERT_TRUE(PollFinished(*hostile->connector, "r2" + forged, false)
                  .finished_recving.count("r2" + forged));
  hostile.reset();  // the producer loses it
  absl::SleepFor(absl::Milliseconds(200));
  SetLogSink(previous);
  absl::MutexLock lock(&mu);
  int forged_lines = 0;
  for (const std::string& line : lines) {
    EXPECT_EQ(line.find_first_of("\n\r\x1b"), std::string::npos) << absl::CHexEscape(line);
    if (line.find("forged") != std::string::npos) ++forged_lines;
  }
  EXPECT_GE(forged_lines, 3);  // the refusal, the timeout and the producer's side of the abort
}

// Pipeline-parallel decode: stage 0 owns layer 0, stage 1 layers 1-2 (of kLayers = 3).
NodeOptions Stage(int rank, const std::string& partition, std::vector<int> layers) {
  NodeOptions o;
  o.pipeline_parallel_size = 2;
  o.pipeline_rank = rank;
  o.pipeline_layers = partition;
  o.layers = std::move(layers);
  o.pipeline_group = "dgroup";  // the stages' engine ids are "d" and "d1"
  return o;
}

TEST_P(LayerwiseConnectorTest, PipelineStagesReceiveOnlyTheirLayers) {
  Start({}, Stage(0, "0,1-2", {0}));
  NodeOptions stage1 = Stage(1, "0,1-2", {1, 2});
  stage1.layout = GetParam();
  auto d1 = MakeNode(fabric_, "d1", stage1);
  const std::vector<int32_t> b0 = {9, 2, 14}, b1 = {3, 4, 5}, pb = {5, 6, 0};
  AdmitOn(*d_, "req", 12, b0);
  StepOn(*d_, {{"req", 0, 12}});
  AdmitOn(*d1, "req", 12, b1);
  StepOn(*d1, {{"req", 0, 12}});

  // One prefill serves both stages.
  auto incoming = ProducerTake(1);
  ASSERT_EQ(incoming.size(), 1u);
  ProducerPrefill(incoming[0], pb, kLayers);
  EXPECT_TRUE(p_->connector->TakeIncomingRequests().empty());

  // Each stage waits for, and gets, only its own layers.
  ASSERT_TRUE(d_->connector->BeforeAttention(LayerName(0), nullptr).ok());
  EXPECT_TRUE(TokensEqual(*p_->caches[0], pb, *d_->caches[0], b0, 11));
  for (int l = 1; l < kLayers; ++l) {
    ASSERT_TRUE(d1->connector->BeforeAttention(LayerName(l), nullptr).ok());
    EXPECT_TRUE(TokensEqual(*p_->caches[l], pb, *d1->caches[l], b1, 11)) << l;
  }
  EXPECT_TRUE(d_->connector->TakeLoadErrors().empty());
  EXPECT_TRUE(d1->connector->TakeLoadErrors().empty());
  const uint64_t layer_bytes = 11u * (2 * 8 + 2 * 4) * 2;  // 11 tokens, bf16
  EXPECT_EQ(d_->connector->stats().bytes_received, layer_bytes);
  EXPECT_EQ(d_->connector->stats().layers_received, 1u);
  EXPECT_EQ(d1->connector->stats().bytes_received, 2 * layer_bytes);
  EXPECT_EQ(d1->connector->stats().layers_received, 2u);
  EXPECT_TRUE(PollFinished(*d_->connector, "req", false).finished_recving.count("req"));
  EXPECT_TRUE(PollFinished(*d1->connector, "req", false).finished_recving.count("req"));

  // One request of the group's namespace.
  EXPECT_EQ(incoming[0].request_id, "dgroup/req");
  auto delay = p_->connector->RequestFinished("dgroup/req");
  ASSERT_TRUE(delay.ok());
  if (*delay) {
    EXPECT_TRUE(
        PollFinished(*p_->connector, "dgroup/req", true).finished_sending.count("dgroup/req"));
  }
  // The producer's counters per consumer, and each consumer's for the producer.
  std::vector<PeerConnectorStats> peers = p_->connector->peer_stats();
  ASSERT_EQ(peers.size(), 2u);
  EXPECT_EQ(peers[0].peer, "d");
  EXPECT_EQ(peers[0].stats.bytes_sent, layer_bytes);
  EXPECT_EQ(peers[0].stats.layers_sent, 1u);
  EXPECT_EQ(peers[1].peer, "d1");
  EXPECT_EQ(peers[1].stats.bytes_sent, 2 * layer_bytes);
  EXPECT_EQ(peers[1].stats.layers_sent, 2u);
  EXPECT_EQ(p_->connector->stats().bytes_sent, 3 * layer_bytes);
  uint64_t observed = 0;
  for (uint64_t c : peers[1].stats.latency_counts) observed += c;
  EXPECT_EQ(observed, 2u);
  std::vector<PeerConnectorStats> from = d1->connector->peer_stats();
  ASSERT_EQ(from.size(), 1u);
  EXPECT_EQ(from[0].peer, "p");
  EXPECT_EQ(from[0].stats.bytes_received, 2 * layer_bytes);
  EXPECT_EQ(from[0].stats.load_errors, 0u);
}

TEST_P(LayerwiseConnectorTest, MissingPipelineStageFailsTheRequest) {
  NodeOptions producer;
  producer.send_timeout_ms = 300;
  Start(producer, Stage(0, "0,1-2", {0}));
  AdmitOn(*d_, "req", 9, {1, 2, 3});
  StepOn(*d_, {{"req", 0, 9}});
  // Stage 1 never hands the request over: the producer gives up on it and says why.
  ExpectConsumerRequestFailed("req", "no consumer asked for layers 1-2");
  std::vector<PeerConnectorStats> peers = d_->connector->peer_stats();
  ASSERT_EQ(peers.size(), 1u);
  EXPECT_EQ(peers[0].peer, "p");
  EXPECT_EQ(peers[0].stats.load_errors, 1u);
}

// One stage's hand-off is rejected (a destination block outside its cache): the other stage
// learns at once that the request failed, whichever stage handed it over first, instead of
// at the producer's gather deadline (a minute here: AwaitLoadErrors gives up after 10 s).
TEST_P(LayerwiseConnectorTest, RejectedStageFailsTheRequestForTheOtherStage) {
  for (const bool bad_stage_first : {false, true}) {
    SCOPED_TRACE(bad_stage_first ? "rejected stage first" : "rejected stage second");
    NodeOptions producer;
    producer.send_timeout_ms = 60000;
    Start(producer, Stage(0, "0,1-2", {0}));
    NodeOptions stage1 = Stage(1, "0,1-2", {1, 2});
    stage1.layout = GetParam();
    auto d1 = MakeNode(fabric_, "d1", stage1);
    auto good_stage = [&] {
      AdmitOn(*d_, "req", 9, {1, 2, 3});
      StepOn(*d_, {{"req", 0, 9}});
    };
    auto bad_stage = [&] {
      AdmitOn(*d1, "req", 9, {1, 999, 3});
      StepOn(*d1, {{"req", 0, 9}});
      std::vector<LoadError> own = AwaitLoadErrors(*d1->connector);
      ASSERT_EQ(own.size(), 1u);
      EXPECT_EQ(own[0].status.code(), absl::StatusCode::kOutOfRange);
    };
    if (bad_stage_first) {
      bad_stage();
      good_stage();
    } else {
      good_stage();
      bad_stage();
    }
    ExpectConsumerRequestFailed("req", "999");
    d1.reset();  // the next round starts its nodes afresh
    d_.reset();
    p_.reset();
  }
}

TEST_P(LayerwiseConnectorTest, OverlappingPipelineStagesRejected) {
  NodeOptions producer;
  producer.send_timeout_ms = 300;
  // Each stage's own configuration is valid, but they disagree: both claim layer 1.
  Start(producer, Stage(0, "0-1,2", {0, 1}));
  NodeOptions stage1 = Stage(1, "0,1-2", {1, 2});
  stage1.layout = GetParam();
  auto d1 = MakeNode(fabric_, "d1", stage1);
  AdmitOn(*d_, "req", 9, {1, 2, 3});
  StepOn(*d_, {{"req", 0, 9}});
  AdmitOn(*d1, "req", 9, {4, 5, 6});
  StepOn(*d1, {{"req", 0, 9}});
  // Whichever hand-off reaches the producer second is refused, and the request fails for
  // the first stage too, naming the refusal.
  std::vector<LoadError> e0 = AwaitLoadErrors(*d_->connector);
  std::vector<LoadError> e1 = AwaitLoadErrors(*d1->connector);
  ASSERT_EQ(e0.size(), 1u);
  ASSERT_EQ(e1.size(), 1u);
  const LoadError& refused =
      e0[0].status.code() == absl::StatusCode::kInvalidArgument ? e0[0] : e1[0];
  const LoadError& stopped =
      e0[0].status.code() == absl::StatusCode::kInvalidArgument ? e1[0] : e0[0];
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status.message(), HasSubstr("layer ranges overlap"));
  EXPECT_EQ(stopped.status.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(stopped.status.message(), HasSubstr("was rejected"));
  EXPECT_THAT(stopped.status.message(), HasSubstr("layer ranges overlap"));
  EXPECT_TRUE(p_->connector->TakeIncomingRequests().empty());
}

TEST_P(LayerwiseConnectorTest, EvenSplitStageWithOtherLayersRejectedAtHandshake) {
  // pipeline_parallel_size 2 without pipeline_layers splits the producer's 3 layers as
  // vLLM does (0-1, 2); a stage 0 with only layer 0 is misconfigured.
  NodeOptions stage0;
  stage0.pipeline_parallel_size = 2;
  stage0.layers = {0};
  Start({}, stage0);
  AdmitOn(*d_, "req", 9, {1, 2, 3});
  StepOn(*d_, {{"req", 0, 9}});
  std::vector<LoadError> errors = d_->connector->TakeLoadErrors();
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(errors[0].status.message(), HasSubstr("should receive layers 0-1"));
  EXPECT_TRUE(p_->connector->TakeIncomingRequests().empty());
}

TEST_P(LayerwiseConnectorTest, ConsumerWithFewerLayersRejectedAtHandshake) {
  NodeOptions consumer;
  consumer.layers = {0, 1};  // the producer has 0-2, and this is no pipeline stage
  Start({}, consumer);
  AdmitOn(*d_, "req", 9, {1, 2, 3});
  StepOn(*d_, {{"req", 0, 9}});
  std::vector<LoadError> errors = d_->connector->TakeLoadErrors();
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(errors[0].status.message(), HasSubstr("compatibility mismatch"));
  EXPECT_THAT(errors[0].status.message(), HasSubstr("it has layers 0-2, we have layers 0-1"));
}

TEST_P(LayerwiseConnectorTest, StageRegisteringLayersOutsideItsRangeRejected) {
  NodeOptions stage0 = Stage(0, "0,1-2", {0, 1});
  stage0.register_may_fail = true;
  auto node = MakeNode(fabric_, "d", stage0);
  EXPECT_EQ(node->register_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(node->register_status.message(), HasSubstr("layer 1"));
}

INSTANTIATE_TEST_SUITE_P(Layouts, LayerwiseConnectorTest,
                         ::testing::Values(KvLayout::kNHD, KvLayout::kHND),
                         [](const ::testing::TestParamInfo<KvLayout>& param_info) {
                           return std::string(KvLayoutName(param_info.param));
                         });

TEST(LayerwiseConnectorConfigTest, PipelineParallelProducerRejected) {
  LoopbackFabric fabric;
  KvTransferConfig c;
  c.kv_connector = "LayerwiseConnector";
  c.kv_role = KvRole::kProducer;
  c.kvstream.pipeline_parallel_size = 2;
  auto connector = CreateKvConnectorWorker(c, fabric.CreateTransport("p").value());
  EXPECT_EQ(connector.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(connector.status().message(), HasSubstr("kv_consumer"));
}

TEST(LayerwiseConnectorConfigTest, BadLayerNamesAndFactoryErrors) {
  LoopbackFabric fabric;
  KvTransferConfig c;
  c.kv_connector = "NixlConnector";
  EXPECT_EQ(CreateKvConnectorWorker(c, fabric.CreateTransport("a").value()).status().code(),
            absl::StatusCode::kNotFound);
  c.kv_connector = "LayerwiseConnector";
  c.kv_role = KvRole::kConsumer;
  auto connector = CreateKvConnectorWorker(c, fabric.CreateTransport("b").value());
  ASSERT_TRUE(connector.ok());
  KvCacheSpec spec;
  spec.num_kv_heads = 1;
  spec.head_size = spec.head_size_v = 4;
  auto cache = KvCache::Create({spec, KvLayout::kNHD, 4});
  auto s = (*connector)->RegisterKvCaches({{"model.attn", cache->get()}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model.attn"));
  s = (*connector)->RegisterKvCaches({{"a.1.x", cache->get()}, {"b.1.y", cache->get()}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST(LayerwiseConnectorConfigTest, FailedRegistrationLeavesNothingBehind) {
  // A registration that fails after some layers were taken (here: the second layer's cache
  // differs) leaves no half-registered layers: registering again with good caches works.
  LoopbackFabric fabric;
  KvTransferConfig c;
  c.kv_connector = "LayerwiseConnector";
  c.kv_role = KvRole::kProducer;
  auto connector = CreateKvConnectorWorker(c, fabric.CreateTransport("p").value());
  ASSERT_TRUE(connector.ok()) << connector.status();
  KvCacheSpec spec;
  spec.num_kv_heads = 1;
  spec.head_size = spec.head_size_v = 4;
  KvCacheSpec other = spec;
  other.head_size = other.head_size_v = 8;
  auto a = KvCache::Create({spec, KvLayout::kNHD, 4});
  auto b = KvCache::Create({other, KvLayout::kNHD, 4});
  auto b_good = KvCache::Create({spec, KvLayout::kNHD, 4});
  absl::Status s = (*connector)->RegisterKvCaches(
      {{"model.layers.0.attn", a->get()}, {"model.layers.1.attn", b->get()}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  s = (*connector)->RegisterKvCaches(
      {{"model.layers.0.attn", a->get()}, {"model.layers.1.attn", b_good->get()}});
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ((*connector)->RegisterKvCaches({{"model.layers.0.attn", a->get()}}).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(LayerwiseConnectorConfigTest, PipelineSettingsBuiltInCodeAreChecked) {
  LoopbackFabric fabric;
  KvTransferConfig c;
  c.kv_connector = "LayerwiseConnector";
  c.kv_role = KvRole::kConsumer;
  c.kvstream.pipeline_parallel_size = 2;
  c.kvstream.pipeline_layers = {{0, 2}, {2, 4}};
  c.kvstream.pipeline_rank = 3;  // past the two stages
  auto bad_rank = CreateKvConnectorWorker(c, fabric.CreateTransport("d1").value());
  EXPECT_EQ(bad_rank.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_rank.status().message(), HasSubstr("pipeline_rank 3"));
  c.kvstream.pipeline_rank = 1;
  c.kvstream.pipeline_layers = {{0, 2}, {2, 4}, {4, 6}};  // three ranges, two stages
  auto bad_ranges = CreateKvConnectorWorker(c, fabric.CreateTransport("d2").value());
  EXPECT_EQ(bad_ranges.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_ranges.status().message(), HasSubstr("pipeline_layers"));
  c.kvstream.pipeline_layers = {{0, 2}, {1, 4}};  // overlapping
  EXPECT_EQ(CreateKvConnectorWorker(c, fabric.CreateTransport("d3").value()).status().code(),
            absl::StatusCode::kInvalidArgument);
  c.kvstream.pipeline_layers = {{0, 2}, {2, 4}};
  EXPECT_TRUE(CreateKvConnectorWorker(c, fabric.CreateTransport("d4").value()).ok());
}

}  // namespace
}  // namespace kvstream
