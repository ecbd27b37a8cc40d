// The layerwise connector under injected transport faults. A producer and a consumer, each
// created by the factory (CreateKvConnectorScheduler / CreateKvConnectorWorker) over a
// loopback transport wrapped in a FaultyTransport (tests/testing/faulty_transport.h), with
// real host caches and a real TCP control channel, stream many randomized requests while
// one kind of fault, or a mix, strikes. Whatever strikes, for every request:
//   - the consumer either loads all its layers bit-identical to what the producer's blocks
//     held when the prefill ran, and reports it finished receiving once; or reports exactly
//     one load error for it (of a kind the scenario allows) and then finished receiving, once,
//     after which nothing lands in its blocks any more;
//   - the producer reports it finished sending, once;
//   - nothing waits without bound (short deadlines, and a watchdog that ends the test as a
//     hang);
//   - after every round both sides hold no blocks in flight (stats().blocks_in_flight == 0).
// Source bytes flipped after the checksum must be DataLoss at the consumer, never KV taken.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/base/dynamic_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/connector/connector_metadata.h"
#include "kvstream/connector/factory.h"
#include "kvstream/transfer/loopback_transport.h"
#include "tests/testing/faulty_transport.h"

namespace kvstream {
namespace {

constexpr int kLayers = 3;
constexpr int kBlockSize = 4;
constexpr int kNumBlocks = 48;
constexpr int kMaxRequestsPerRound = 4;
constexpr int kMaxPromptTokens = 4 * kBlockSize;  // at most 4 blocks a request

std::string LayerName(int i) { return absl::StrCat("model.layers.", i, ".self_attn.attn"); }

// Ends the process when a scenario runs past its limit: a hang must fail the test, not
// block the suite. The limit is far above what a scenario takes, so it is no timing check.
class Watchdog {
 public:
  Watchdog(absl::Duration limit, std::string what) : what_(std::move(what)) {
    thread_ = std::thread([this, limit] {
      absl::MutexLock lock(&mu_);
      if (!mu_.AwaitWithTimeout(absl::Condition(&done_), limit)) {
        std::fprintf(stderr, "%s still running after %s (last step: %s): a hang\n",
                     what_.c_str(), absl::FormatDuration(limit).c_str(), step_.c_str());
        std::abort();
      }
    });
  }
  ~Watchdog() {
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
    }
    thread_.join();
  }
  void Step(std::string step) {
    absl::MutexLock lock(&mu_);
    step_ = std::move(step);
  }

 private:
  const std::string what_;
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::string step_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// Drives a connector's two sides as an engine does (as layerwise_connector_test.cc's
// TestConnector): scheduler calls to the scheduler side, hooks to the worker side, the
// metadata and the worker's output crossing as bytes, the output fed to the scheduler
// whenever the test looks at what happened. It also counts how often each request was
// reported finished, which must be once. A producer's scheduler side names requests by the
// consumer's id scoped by the consumer ("d/x"); this driver speaks the consumer's ids ("x")
// on both sides and maps them.
class TestConnector {
 public:
  TestConnector(std::unique_ptr<KvConnectorScheduler> scheduler,
                std::unique_ptr<KvConnectorWorker> worker)
      : scheduler_(std::move(scheduler)), worker_(std::move(worker)) {}

  KvConnectorScheduler& scheduler() { return *scheduler_; }
  KvConnectorWorker& worker() { return *worker_; }

  absl::StatusOr<KvConnectorMetadata> BuildConnectorMeta(absl::Span<const ScheduledRequest> s) {
    std::vector<ScheduledRequest> scheduled(s.begin(), s.end());
    for (ScheduledRequest& r : scheduled) r.request_id = Scoped(r.request_id);
    ASSIGN_OR_RETURN(KvConnectorMetadata meta, scheduler_->BuildConnectorMeta(scheduled));
    ASSIGN_OR_RETURN(std::string bytes, EncodeConnectorMetadata(meta));
    return DecodeConnectorMetadata(bytes);
  }
  // Incoming requests, with the ids of the consumers that sent them.
  std::vector<KvRequest> TakeIncomingRequests() {
    Pump();
    std::vector<KvRequest> in = scheduler_->TakeIncomingRequests();
    for (KvRequest& r : in) {
      const std::string own = Unscoped(r.request_id);
      scoped_[own] = r.request_id;
      r.request_id = own;
    }
    return in;
  }
  absl::StatusOr<bool> RequestFinished(const std::string& id) {
    Pump();
    return scheduler_->RequestFinished(Scoped(id));
  }
  absl::Status UpdateStateAfterAlloc(KvRequest r, absl::Span<const int32_t> blocks,
                                     int32_t external) {
    r.request_id = Scoped(r.request_id);
    return scheduler_->UpdateStateAfterAlloc(r, blocks, external);
  }
  // The scheduler side's id of a consumer's request (itself on a consumer).
  std::string Scoped(const std::string& id) const {
    auto it = scoped_.find(id);
    return it == scoped_.end() ? id : it->second;
  }
  static std::string Unscoped(const std::string& id) { return id.substr(id.find('/') + 1); }

  // What the worker reported so far, accumulated.
  void Pump() {
    auto raw = worker_->TakeOutput();
    ASSERT_TRUE(raw.ok()) << raw.status();
    auto bytes = EncodeConnectorOutput(*raw);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto out = DecodeConnectorOutput(*bytes);
    ASSERT_TRUE(out.ok()) << out.status();
    absl::Status s = scheduler_->UpdateConnectorOutput(*out);
    ASSERT_TRUE(s.ok()) << s;
    for (LoadError& e : out->load_errors) errors_[e.request_id].push_back(e.status);
    for (const std::string& id : out->finished_sending) ++sending_reports_[Unscoped(id)];
    for (const std::string& id : out->finished_recving) ++recving_reports_[id];
  }
  // Starts the counts of `id` afresh (a retried request id).
  void Forget(const std::string& id) {
    errors_.erase(id);
    sending_reports_.erase(id);
    recving_reports_.erase(id);
  }
  const std::map<std::string, std::vector<absl::Status>>& errors() const { return errors_; }
  int sending_reports(const std::string& id) const { return Count(sending_reports_, id); }
  int recving_reports(const std::string& id) const { return Count(recving_reports_, id); }

 private:
  static int Count(const std::map<std::string, int>& m, const std::string& id) {
    auto it = m.find(id);
    return it == m.end() ? 0 : it->second;
  }

  std::unique_ptr<KvConnectorScheduler> scheduler_;
  std::unique_ptr<KvConnectorWorker> worker_;
  std::map<std::string, std::vector<absl::Status>> errors_;
  std::map<std::string, int> sending_reports_;
  std::map<std::string, int> recving_reports_;
  std::map<std::string, std::string> scoped_;  // consumer's id -> the scheduler side's
};

// The caches come first so that they outlive the connector, which registered them and
// whose peers' writes may still land in them until it is destroyed.
struct Node {
  std::vector<std::unique_ptr<KvCache>> caches;  // by layer
  std::unique_ptr<TestConnector> connector;
  FaultyTransport* faults = nullptr;             // owned by the connector's worker
};

struct Timeouts {
  int64_t load_ms = 300;
  int64_t send_ms = 500;
};

std::unique_ptr<Node> MakeNode(LoopbackFabric& fabric, const std::string& name, KvRole role,
                               const FaultPlan& plan, const Timeouts& timeouts, KvLayout layout) {
  auto node = std::make_unique<Node>();
  KvTransferConfig c;
  c.kv_connector = "LayerwiseConnector";
  c.engine_id = name;
  c.kv_role = role;
  c.kv_port = 0;
  c.kvstream.transport = "loopback";
  c.kvstream.load_timeout_ms = timeouts.load_ms;
  c.kvstream.send_timeout_ms = timeouts.send_ms;
  c.kvstream.handshake_timeout_ms = 2000;
  auto transport = fabric.CreateTransport(name);
  EXPECT_TRUE(transport.ok()) << transport.status();
  if (!transport.ok()) return nullptr;
  auto faulty = FaultyTransport::Create(std::move(transport).value(), plan);
  EXPECT_TRUE(faulty.ok()) << faulty.status();
  if (!faulty.ok()) return nullptr;
  node->faults = faulty->get();
  auto scheduler = CreateKvConnectorScheduler(c, kBlockSize);
  EXPECT_TRUE(scheduler.ok()) << scheduler.status();
  auto worker = CreateKvConnectorWorker(c, std::move(faulty).value());
  EXPECT_TRUE(worker.ok()) << worker.status();
  if (!scheduler.ok() || !worker.ok()) return nullptr;
  node->connector =
      std::make_unique<TestConnector>(std::move(scheduler).value(), std::move(worker).value());
  KvCacheSpec spec;
  spec.block_size = kBlockSize;
  spec.num_kv_heads = 2;
  spec.head_size = 8;
  spec.head_size_v = 4;
  spec.dtype = DType::kBFloat16;
  std::map<std::string, KvCache*> by_name;
  for (int l = 0; l < kLayers; ++l) {
    auto cache = KvCache::Create({spec, layout, kNumBlocks});
    EXPECT_TRUE(cache.ok()) << cache.status();
    if (!cache.ok()) return nullptr;
    by_name[LayerName(l)] = cache->get();
    node->caches.push_back(std::move(cache).value());
  }
  absl::Status s = node->connector->worker().RegisterKvCaches(by_name);
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return nullptr;
  return node;
}

// Calls fn(k, k_bytes, v, v_bytes) for every (token, head) row of the first `tokens` tokens
// of `blocks`, in token order: the bytes a request's layer consists of, whatever the layout.
template <typename Fn>
void ForEachRow(const KvCache& cache, const std::vector<int32_t>& blocks, int tokens, Fn fn) {
  const KvCacheView v = cache.view();
  const size_t es = DTypeSize(v.spec.dtype);
  for (int t = 0; t < tokens; ++t) {
    const int32_t b = blocks[t / v.spec.block_size];
    const int o = t % v.spec.block_size;
    for (int h = 0; h < v.spec.num_kv_heads; ++h) {
      fn(static_cast<char*>(v.k) + v.k_strides.Offset(b, o, h, 0) * es, v.spec.head_size * es,
         static_cast<char*>(v.v) + v.v_strides.Offset(b, o, h, 0) * es, v.spec.head_size_v * es);
    }
  }
}

std::string TokenBytes(const KvCache& cache, const std::vector<int32_t>& blocks, int tokens) {
  std::string out;
  ForEachRow(cache, blocks, tokens, [&](const char* k, size_t kn, const char* v, size_t vn) {
    out.append(k, kn);
    out.append(v, vn);
  });
  return out;
}

void FillRandom(KvCache& cache, const std::vector<int32_t>& blocks, int tokens,
                std::mt19937_64& rng) {
  ForEachRow(cache, blocks, tokens, [&](char* k, size_t kn, char* v, size_t vn) {
    for (size_t i = 0; i < kn; ++i) k[i] = static_cast<char>(rng());
    for (size_t i = 0; i < vn; ++i) v[i] = static_cast<char>(rng());
  });
}

FaultRate Probability(double p) {
  FaultRate r;
  r.probability = p;
  return r;
}

struct Scenario {
  std::string name;
  FaultPlan producer;  // sender-side faults act here (its posts)
  FaultPlan consumer;  // receiver-side faults act here (its notifications)
  Timeouts timeouts;
  int rounds = 12;
  KvLayout layout = KvLayout::kNHD;
  // The load error codes this scenario may produce. Empty: every request must load.
  std::set<absl::StatusCode> allowed;
  // Faults of this scenario always fail the request they strike: when any was injected,
  // some request must have failed.
  bool strikes_fail = false;
  // Every round reuses the request ids of the first, each with the same prompt length and
  // the same consumer blocks (as an engine that retries a failed request under its id).
  bool reuse_ids = false;
  // The producer's compute time per layer (slows the prefill, widening the windows in which
  // a late notice meets a request still loading).
  absl::Duration layer_compute = absl::ZeroDuration();
};

// gtest prints a failed test's parameter: the name says it all.
void PrintTo(const Scenario& sc, std::ostream* os) { *os << sc.name; }

// One request of a round.
struct Request {
  std::string id;
  int prompt_len = 0;
  int tokens = 0;  // remote tokens: all but the last prompt token
  std::vector<int32_t> consumer_blocks;
  std::vector<int32_t> producer_blocks;
  std::vector<std::string> expected;  // by layer: the producer's bytes when its prefill ran
  bool prefilled = false;
  std::vector<std::string> at_finish;  // by layer: the consumer's bytes once reported finished
};

class ConnectorFaultTest : public ::testing::TestWithParam<Scenario> {
 protected:
  void SetUp() override {
    const Scenario& sc = GetParam();
    p_ = MakeNode(fabric_, "p", KvRole::kProducer, sc.producer, sc.timeouts, sc.layout);
    d_ = MakeNode(fabric_, "d", KvRole::kConsumer, sc.consumer, sc.timeouts, sc.layout);
    ASSERT_NE(p_, nullptr);
    ASSERT_NE(d_, nullptr);
    const std::string addr = p_->connector->worker().control_address();
    const size_t colon = addr.rfind(':');
    remote_.host = addr.substr(0, colon);
    remote_.port = std::stoi(addr.substr(colon + 1));
  }

  // Polls `c` until `done` holds or 10 s pass (far beyond any deadline of the connector).
  template <typename Done>
  static bool PollUntil(TestConnector& c, Done done) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (true) {
      c.Pump();
      if (done()) return true;
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(1));
    }
  }

  void RunRound(int round, std::mt19937_64& rng, Watchdog& watchdog);

  LoopbackFabric fabric_;
  std::unique_ptr<Node> p_;
  std::unique_ptr<Node> d_;
  RemotePrefill remote_;
  // Outcomes over the scenario.
  std::set<std::string> known_;  // request ids of the rounds so far
  int loaded_ = 0;
  std::map<absl::StatusCode, int> failed_;
};

void ConnectorFaultTest::RunRound(int round, std::mt19937_64& rng, Watchdog& watchdog) {
  const Scenario& sc = GetParam();
  SCOPED_TRACE(absl::StrCat("round ", round));
  TestConnector& dc = *d_->connector;
  TestConnector& pc = *p_->connector;

  // Requests with random lengths into random distinct blocks on both sides.
  std::vector<int32_t> dfree(kNumBlocks), pfree(kNumBlocks);
  std::iota(dfree.begin(), dfree.end(), 0);
  std::iota(pfree.begin(), pfree.end(), 0);
  std::shuffle(dfree.begin(), dfree.end(), rng);
  std::shuffle(pfree.begin(), pfree.end(), rng);
  const int n = std::uniform_int_distribution<int>(1, kMaxRequestsPerRound)(rng);
  std::vector<Request> reqs(n);
  std::map<std::string, Request*> by_id;
  std::vector<ScheduledRequest> dsched;
  for (int i = 0; i < n; ++i) {
    Request& r = reqs[i];
    r.id = sc.reuse_ids ? absl::StrCat("q-", i) : absl::StrCat("r", round, "-", i);
    r.prompt_len = sc.reuse_ids ? kMaxPromptTokens + 1 - i
                                : std::uniform_int_distribution<int>(2, kMaxPromptTokens + 1)(rng);
    r.tokens = r.prompt_len - 1;
    const int blocks = (r.tokens + kBlockSize - 1) / kBlockSize;
    for (int b = 0; b < blocks; ++b) {
      if (sc.reuse_ids) {
        r.consumer_blocks.push_back(i * kMaxPromptTokens / kBlockSize + b);
      } else {
        r.consumer_blocks.push_back(dfree.back());
        dfree.pop_back();
      }
      r.producer_blocks.push_back(pfree.back());
      pfree.pop_back();
    }
    by_id[r.id] = &r;
    dc.Forget(r.id);
    pc.Forget(r.id);
    KvRequest kr;
    kr.request_id = r.id;
    for (int t = 0; t < r.prompt_len; ++t) kr.prompt_token_ids.push_back(100 + round + t);
    kr.remote_prefill = remote_;
    auto m = dc.scheduler().GetNumNewMatchedTokens(kr, 0);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_EQ(m->num_tokens, r.tokens);
    absl::Status s = dc.scheduler().UpdateStateAfterAlloc(kr, r.consumer_blocks, m->num_tokens);
    ASSERT_TRUE(s.ok()) << s;
    dsched.push_back({r.id, 0, r.prompt_len});
  }

  // The consumer's step: hand-offs, then the forward pass on its own thread, waiting layer
  // by layer while the producer prefills (as the two engines run side by side).
  watchdog.Step(absl::StrCat(sc.name, " round ", round, ": consumer step"));
  auto dmeta = dc.BuildConnectorMeta(dsched);
  ASSERT_TRUE(dmeta.ok()) << dmeta.status();
  ASSERT_TRUE(dc.worker().BindConnectorMetadata(*dmeta).ok());
  ASSERT_TRUE(dc.worker().StartLoadKv().ok());
  // read[i][l]: what request i's layer l held when BeforeAttention(l) returned, which is
  // what the engine's attention would read.
  std::vector<std::vector<std::string>> read(n);
  std::atomic<bool> forward_ok{true};
  std::thread forward([&] {
    for (int l = 0; l < kLayers; ++l) {
      if (!dc.worker().BeforeAttention(LayerName(l), nullptr).ok()) forward_ok = false;
      for (int i = 0; i < n; ++i) {
        // The engine's attention reads every request's blocks, also those of a request
        // whose load already failed, into which the producer's later writes may still land
        // until the request is reported finished (checked below): ThreadSanitizer would
        // report that read, which the connector never promised to be quiet. Only loaded
        // requests' reads are compared, and their bytes are read again, seen by TSan,
        // once the request is reported finished.
        ABSL_ANNOTATE_IGNORE_READS_BEGIN();
        read[i].push_back(TokenBytes(*d_->caches[l], reqs[i].consumer_blocks, reqs[i].tokens));
        ABSL_ANNOTATE_IGNORE_READS_END();
      }
    }
    dc.worker().ClearConnectorMetadata();
  });

  // The producer: takes the hand-offs, fills the blocks it prefills with fresh bytes
  // (recorded: the truth the consumer must get), runs the layers' hooks. (A lambda, so
  // that a failed assertion still joins the forward pass.)
  watchdog.Step(absl::StrCat(sc.name, " round ", round, ": producer prefill"));
  auto prefill = [&] {
    std::vector<KvRequest> incoming;
    const absl::Time take_deadline = absl::Now() + absl::Seconds(10);
    while (static_cast<int>(incoming.size()) < n && absl::Now() < take_deadline) {
      for (KvRequest& r : pc.TakeIncomingRequests()) incoming.push_back(std::move(r));
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(static_cast<int>(incoming.size()), n) << "hand-offs did not reach the producer";
    std::vector<ScheduledRequest> psched;
    for (const KvRequest& kr : incoming) {
      auto it = by_id.find(kr.request_id);
      ASSERT_NE(it, by_id.end()) << "unknown request " << kr.request_id;
      Request& r = *it->second;
      ASSERT_EQ(static_cast<int>(kr.prompt_token_ids.size()), r.prompt_len);
      absl::Status s = pc.UpdateStateAfterAlloc(kr, r.producer_blocks, 0);
      ASSERT_TRUE(s.ok()) << s;
      for (int l = 0; l < kLayers; ++l) {
        FillRandom(*p_->caches[l], r.producer_blocks, r.tokens, rng);
        r.expected.push_back(TokenBytes(*p_->caches[l], r.producer_blocks, r.tokens));
      }
      r.prefilled = true;
      psched.push_back({r.id, 0, r.prompt_len});
    }
    auto pmeta = pc.BuildConnectorMeta(psched);
    ASSERT_TRUE(pmeta.ok()) << pmeta.status();
    ASSERT_TRUE(pc.worker().BindConnectorMetadata(*pmeta).ok());
    AttentionMetadata unused;
    for (int l = 0; l < kLayers; ++l) {
      absl::SleepFor(sc.layer_compute);
      absl::Status s = pc.worker().AfterAttention(LayerName(l), *p_->caches[l], unused, nullptr);
      EXPECT_TRUE(s.ok()) << s;  // a post that fails fails its request, not the hook
    }
    (void)pc.worker().WaitForSave();  // an injected post failure shows here; the request fails
    pc.worker().ClearConnectorMetadata();
    // The prefill engine is done with every request once its step ran.
    for (const Request& r : reqs) {
      if (r.prefilled) {
        ASSERT_TRUE(pc.RequestFinished(r.id).ok());
      }
    }
  };
  prefill();
  forward.join();
  if (HasFatalFailure()) return;
  EXPECT_TRUE(forward_ok) << "BeforeAttention failed";

  // Both sides report every request finished, once; the consumer's bytes at that moment are
  // kept to check that nothing lands later.
  watchdog.Step(absl::StrCat(sc.name, " round ", round, ": waiting for finished"));
  const bool recv_done = PollUntil(dc, [&] {
    for (Request& r : reqs) {
      if (dc.recving_reports(r.id) == 0) return false;
      if (r.at_finish.empty()) {
        for (int l = 0; l < kLayers; ++l) {
          r.at_finish.push_back(TokenBytes(*d_->caches[l], r.consumer_blocks, r.tokens));
        }
      }
    }
    return true;
  });
  const bool send_done = PollUntil(pc, [&] {
    for (const Request& r : reqs) {
      if (r.prefilled && pc.sending_reports(r.id) == 0) return false;
    }
    return true;
  });
  EXPECT_TRUE(recv_done) << "a request was never reported finished receiving";
  EXPECT_TRUE(send_done) << "a request was never reported finished sending";
  // Late notices and late writes would land by now.
  absl::SleepFor(absl::Milliseconds(5));
  dc.Pump();
  pc.Pump();

  for (int i = 0; i < n; ++i) {
    Request& r = reqs[i];
    SCOPED_TRACE(r.id);
    EXPECT_EQ(dc.recving_reports(r.id), 1);
    if (r.prefilled) {
      EXPECT_EQ(pc.sending_reports(r.id), 1);
    }
    auto e = dc.errors().find(r.id);
    const size_t n_errors = e == dc.errors().end() ? 0 : e->second.size();
    ASSERT_LE(n_errors, 1u) << "two load errors for one request";
    if (n_errors == 0) {
      ASSERT_TRUE(r.prefilled) << "loaded without a prefill";
      for (int l = 0; l < kLayers; ++l) {
        EXPECT_TRUE(read[i][l] == r.expected[l])
            << "layer " << l << " was not the producer's when its attention ran";
        EXPECT_TRUE(TokenBytes(*d_->caches[l], r.consumer_blocks, r.tokens) == r.expected[l])
            << "layer " << l << " was taken but differs from the producer's";
      }
      ++loaded_;
    } else {
      const absl::Status& why = e->second[0];
      EXPECT_TRUE(sc.allowed.count(why.code())) << "unexpected load error: " << why;
      ++failed_[why.code()];
    }
    for (int l = 0; l < kLayers && !r.at_finish.empty(); ++l) {
      EXPECT_TRUE(TokenBytes(*d_->caches[l], r.consumer_blocks, r.tokens) == r.at_finish[l])
          << "layer " << l << " changed after the request was reported finished";
    }
  }
  for (const Request& r : reqs) known_.insert(r.id);
  for (const auto& [id, errors] : dc.errors()) {
    EXPECT_TRUE(known_.count(id)) << "load error for unknown request " << id;
  }
  EXPECT_EQ(dc.worker().stats().blocks_in_flight, 0);
  EXPECT_EQ(pc.worker().stats().blocks_in_flight, 0);
}

TEST_P(ConnectorFaultTest, EveryRequestLoadsExactlyOrFailsCleanly) {
  const Scenario& sc = GetParam();
  Watchdog watchdog(absl::Seconds(120), sc.name);
  std::mt19937_64 rng(sc.producer.seed * 7919 + sc.consumer.seed);
  for (int round = 0; round < sc.rounds && !HasFatalFailure(); ++round) {
    RunRound(round, rng, watchdog);
  }
  EXPECT_EQ(d_->connector->worker().stats().blocks_in_flight, 0);
  EXPECT_EQ(p_->connector->worker().stats().blocks_in_flight, 0);
  FaultCounts injected = p_->faults->counts();
  injected += d_->faults->counts();
  const int failed = std::accumulate(failed_.begin(), failed_.end(), 0,
                                     [](int a, const auto& kv) { return a + kv.second; });
  std::vector<std::string> codes;
  for (const auto& [code, count] : failed_) {
    codes.push_back(absl::StrCat(absl::StatusCodeToString(code), "=", count));
  }
  std::cout << "[ faults   ] " << sc.name << ": " << loaded_ << " loaded, " << failed
            << " failed (" << absl::StrJoin(codes, " ") << "); injected "
            << injected.injected() << ": " << injected.ToString() << "\n";
  RecordProperty("faults_injected", static_cast<int>(injected.injected()));
  RecordProperty("requests_failed", failed);
  if (sc.allowed.empty()) {
    EXPECT_EQ(failed, 0);
  }
  if (sc.strikes_fail && injected.injected() > 0) {
    EXPECT_GT(failed, 0) << "faults were injected but no request failed";
  }
}

// ---- faults placed at chosen moments ----

// A producer and a consumer (each test places its faults through the nodes'
// FaultyTransports), driven one request at a time of kPromptLen tokens from the consumer's
// blocks kDBlocks and the producer's kPBlocks.
class DirectedFaultTest : public ::testing::Test {
 protected:
  static constexpr int kPromptLen = 8;
  static constexpr int kTokens = 7;  // remote tokens: all but the last prompt token

  void Start(const FaultPlan& producer = {}, const FaultPlan& consumer = {},
             const Timeouts& timeouts = {300, 500}) {
    p_ = MakeNode(fabric_, "p", KvRole::kProducer, producer, timeouts, KvLayout::kNHD);
    d_ = MakeNode(fabric_, "d", KvRole::kConsumer, consumer, timeouts, KvLayout::kNHD);
    ASSERT_TRUE(p_ != nullptr && d_ != nullptr);
    const std::string addr = pc().worker().control_address();
    remote_.host = addr.substr(0, addr.rfind(':'));
    remote_.port = std::stoi(addr.substr(addr.rfind(':') + 1));
  }

  TestConnector& pc() { return *p_->connector; }
  TestConnector& dc() { return *d_->connector; }

  // The consumer admits `id` and hands it over; returns once the producer has it.
  void HandOver(const std::string& id) {
    KvRequest kr;
    kr.request_id = id;
    for (int t = 0; t < kPromptLen; ++t) kr.prompt_token_ids.push_back(100 + t);
    kr.remote_prefill = remote_;
    ASSERT_TRUE(dc().scheduler().UpdateStateAfterAlloc(kr, kDBlocks, kTokens).ok());
    auto meta = dc().BuildConnectorMeta({{id, 0, kPromptLen}});
    ASSERT_TRUE(meta.ok());
    ASSERT_TRUE(dc().worker().BindConnectorMetadata(*meta).ok());
    ASSERT_TRUE(dc().worker().StartLoadKv().ok());
    std::vector<KvRequest> incoming;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (incoming.empty() && absl::Now() < deadline) {
      incoming = pc().TakeIncomingRequests();
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_EQ(incoming.size(), 1u);
    ASSERT_TRUE(pc().UpdateStateAfterAlloc(incoming[0], kPBlocks, 0).ok());
  }

  // The producer's prefill of `id`, with fresh bytes; returns them by layer.
  std::vector<std::string> Prefill(const std::string& id) {
    std::vector<std::string> bytes;
    for (int l = 0; l < kLayers; ++l) {
      FillRandom(*p_->caches[l], kPBlocks, kTokens, rng_);
      bytes.push_back(TokenBytes(*p_->caches[l], kPBlocks, kTokens));
    }
    auto meta = pc().BuildConnectorMeta({{id, 0, kPromptLen}});
    EXPECT_TRUE(meta.ok());
    EXPECT_TRUE(pc().worker().BindConnectorMetadata(*meta).ok());
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_TRUE(
          pc().worker().AfterAttention(LayerName(l), *p_->caches[l], unused_, nullptr).ok());
    }
    (void)pc().worker().WaitForSave();
    pc().worker().ClearConnectorMetadata();
    EXPECT_TRUE(pc().RequestFinished(id).ok());
    return bytes;
  }

  // The consumer's forward pass over every layer, without reading anything.
  void ForwardWithoutReading() {
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(dc().worker().BeforeAttention(LayerName(l), nullptr).ok());
    }
    dc().worker().ClearConnectorMetadata();
  }

  // The consumer's forward pass, on a thread of its own while the producer prefills `id`
  // (after `compute`, its time before the first layer): what attention read, by layer, and
  // what the producer wrote.
  std::pair<std::vector<std::string>, std::vector<std::string>> StreamWhileReading(
      const std::string& id, absl::Duration compute) {
    std::vector<std::string> read;
    std::thread forward([&] {
      for (int l = 0; l < kLayers; ++l) {
        EXPECT_TRUE(dc().worker().BeforeAttention(LayerName(l), nullptr).ok());
        read.push_back(TokenBytes(*d_->caches[l], kDBlocks, kTokens));
      }
      dc().worker().ClearConnectorMetadata();
    });
    absl::SleepFor(compute);
    std::vector<std::string> written = Prefill(id);
    forward.join();
    return {read, written};
  }

  // Pumps both sides until `done` holds or 10 s pass (far beyond any deadline here).
  template <typename Done>
  bool Until(Done done) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      dc().Pump();
      pc().Pump();
      if (done()) return true;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return false;
  }
  bool FinishedBoth(const std::string& id) {
    return Until([&] { return dc().recving_reports(id) > 0 && pc().sending_reports(id) > 0; });
  }

  const std::vector<int32_t> kDBlocks = {3, 4};
  const std::vector<int32_t> kPBlocks = {7, 8};
  LoopbackFabric fabric_;
  std::unique_ptr<Node> p_, d_;
  RemotePrefill remote_;
  std::mt19937_64 rng_{5};
  AttentionMetadata unused_;
};

// A notice that arrives after its request failed must not count for a later request of the
// same id (an engine retrying a request under its id, or a restarted client reusing ids).
// Attempt 1's notices are held back until its load failed at the deadline; they are let go
// once attempt 2 (same id, same blocks, same length) was handed over, before the producer
// has run attempt 2's prefill. Attempt 1's bytes are still in the blocks, so the stale
// notices verify, and the consumer must not take them for attempt 2's layers.
//
// Every hand-off carries an attempt number that the producer echoes in each layer notice
// (HandOffMsg::attempt); the consumer ignores notices of another attempt.
TEST_F(DirectedFaultTest, LateNoticeOfAFailedRequestDoesNotCountForItsRetry) {
  ASSERT_NO_FATAL_FAILURE(Start());
  // Attempt 1: its notices never come in time; its load fails at the deadline.
  d_->faults->HoldNotifications(true);
  HandOver("x");
  const std::vector<std::string> first = Prefill("x");
  ForwardWithoutReading();
  ASSERT_TRUE(FinishedBoth("x"));
  ASSERT_EQ(dc().errors().at("x").size(), 1u);
  ASSERT_EQ(dc().errors().at("x")[0].code(), absl::StatusCode::kDeadlineExceeded);

  // Attempt 2: handed over; attempt 1's notices are let go before the producer prefills.
  dc().Forget("x");
  pc().Forget("x");
  HandOver("x");
  d_->faults->HoldNotifications(false);
  absl::SleepFor(absl::Milliseconds(50));  // the consumer's progress thread takes them in
  auto [read, expected] = StreamWhileReading("x", absl::Milliseconds(100));
  ASSERT_TRUE(FinishedBoth("x"));
  auto e = dc().errors().find("x");
  if (e != dc().errors().end() && !e->second.empty()) {
    EXPECT_EQ(e->second.size(), 1u);  // failing the retry is safe
  } else {
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_TRUE(read[l] == expected[l])
          << "layer " << l << ": attention read bytes that are not the producer's for this attempt"
          << (read[l] == first[l] ? " (they are attempt 1's)" : "");
    }
  }
  EXPECT_EQ(dc().worker().stats().blocks_in_flight, 0);
  EXPECT_EQ(pc().worker().stats().blocks_in_flight, 0);
}

// A producer's writes wait in its socket (a cut link: they can no longer be taken back) when
// the consumer gives the request up: its load fails at the layer deadline, the producer
// never confirms the abort (its transfers cannot end), and the consumer closes the link at
// the abort deadline and reports the request finished, so that its blocks can be reused.
// When the writes go out at last (the partition heals), they must not land in those
// blocks: the consumer fenced the producer's transport off when it closed the link. The
// next request to the same producer (a new link, whose handshake accepts its writes again)
// loads bit-identical.
TEST_F(DirectedFaultTest, WritesOfAProducerGivenUpDoNotLandInReusedBlocks) {
  ASSERT_NO_FATAL_FAILURE(Start());
  // Request "a": its writes wait in the producer's socket; the consumer gives it up.
  p_->faults->HoldWrites(true);
  HandOver("a");
  (void)Prefill("a");
  ForwardWithoutReading();
  ASSERT_TRUE(Until([&] { return dc().recving_reports("a") > 0; }))
      << "the consumer never gave request a up";
  ASSERT_EQ(dc().errors().at("a").size(), 1u);
  EXPECT_EQ(dc().errors().at("a")[0].code(), absl::StatusCode::kDeadlineExceeded);

  // Its blocks now hold another request's KV (recomputed here); then the writes go out.
  std::vector<std::string> reused;
  for (int l = 0; l < kLayers; ++l) {
    FillRandom(*d_->caches[l], kDBlocks, kTokens, rng_);
    reused.push_back(TokenBytes(*d_->caches[l], kDBlocks, kTokens));
  }
  p_->faults->HoldWrites(false);
  ASSERT_TRUE(Until([&] { return pc().sending_reports("a") > 0; }))
      << "the producer's transfers of request a never ended";
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_TRUE(TokenBytes(*d_->caches[l], kDBlocks, kTokens) == reused[l])
        << "layer " << l << ": the given-up producer's late writes landed in reused blocks";
  }

  // Request "b" to the same producer once its reconnect backoff (200 ms) passed.
  absl::SleepFor(absl::Milliseconds(300));
  HandOver("b");
  auto [read, expected] = StreamWhileReading("b", absl::ZeroDuration());
  ASSERT_TRUE(FinishedBoth("b"));
  EXPECT_EQ(dc().errors().count("b"), 0u) << dc().errors().at("b")[0];
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_TRUE(read[l] == expected[l]) << "layer " << l << " of request b";
  }
  EXPECT_EQ(dc().worker().stats().blocks_in_flight, 0);
  EXPECT_EQ(pc().worker().stats().blocks_in_flight, 0);
}

// Over a transport whose completions do not mean delivery (UCX over TCP: a send completes in
// the socket), the producer's confirmation of an abort, on the control channel, can come
// before its writes: here they "complete" at once but wait in the producer's socket while
// the consumer's load fails at the deadline and the producer, its sends done, confirms the
// abort. The consumer must not let the request's blocks go on that confirmation, only on
// the producer's stop notice, which the transport delivers behind the writes.
TEST_F(DirectedFaultTest, AConfirmationThatOvertakesTheWritesDoesNotFreeTheBlocks) {
  FaultPlan consumer;
  consumer.completion_before_delivery = true;
  // The abort deadline (5 s) far beyond the wait below: the link is not given up meanwhile.
  ASSERT_NO_FATAL_FAILURE(Start({}, consumer, {300, 5000}));
  p_->faults->HoldWrites(true, /*report_done=*/true);
  HandOver("a");
  (void)Prefill("a");
  ASSERT_TRUE(Until([&] { return pc().sending_reports("a") > 0; }))
      << "the producer never saw its sends of request a done";
  ForwardWithoutReading();  // fails at the layer deadline; the abort goes to the producer
  ASSERT_TRUE(Until([&] { return dc().errors().count("a") > 0; }));
  EXPECT_EQ(dc().errors().at("a")[0].code(), absl::StatusCode::kDeadlineExceeded);
  // The producer confirms at once ("no transfer of it is in flight"); the writes still wait.
  const absl::Time until = absl::Now() + absl::Milliseconds(300);
  while (absl::Now() < until) {
    dc().Pump();
    ASSERT_EQ(dc().recving_reports("a"), 0)
        << "the consumer let request a's blocks go while its writes were still on their way";
    absl::SleepFor(absl::Milliseconds(1));
  }
  // The writes land (in blocks the request still holds), then the stop notice.
  p_->faults->HoldWrites(false);
  ASSERT_TRUE(Until([&] { return dc().recving_reports("a") > 0; }))
      << "the producer's stop notice never stopped request a";
  EXPECT_EQ(dc().worker().stats().blocks_in_flight, 0);
  EXPECT_EQ(pc().worker().stats().blocks_in_flight, 0);
}

// ---- the scenarios ----

std::vector<Scenario> Scenarios() {
  using C = absl::StatusCode;
  std::vector<Scenario> out;
  auto add = [&](std::string name, uint64_t seed, auto configure) {
    Scenario sc;
    sc.name = std::move(name);
    sc.producer.seed = seed;
    sc.consumer.seed = seed + 1000;
    sc.layout = out.size() % 2 == 0 ? KvLayout::kNHD : KvLayout::kHND;
    configure(sc);
    out.push_back(std::move(sc));
  };
  // Faults that must not fail anything get deadlines no healthy transfer comes near.
  const Timeouts generous{5000, 5000};

  add("NoFaults", 1, [&](Scenario& sc) {
    sc.timeouts = generous;
    sc.rounds = 6;
  });
  add("DuplicateNotifications", 2, [&](Scenario& sc) {
    sc.consumer.duplicate_notification = Probability(0.5);
    sc.timeouts = generous;
  });
  add("ReorderNotifications", 3, [&](Scenario& sc) {
    sc.consumer.reorder_notification = Probability(0.5);
    sc.consumer.max_hold = absl::Milliseconds(20);
    sc.timeouts = generous;
  });
  add("DelayNotificationsWithinTheDeadline", 4, [&](Scenario& sc) {
    sc.consumer.delay_notification = Probability(0.5);
    sc.consumer.max_delay = absl::Milliseconds(30);
    sc.timeouts = generous;
  });
  add("DelayNotificationsPastTheDeadline", 5, [&](Scenario& sc) {
    sc.consumer.delay_notification = Probability(0.25);
    sc.consumer.max_delay = absl::Milliseconds(600);  // twice the load timeout
    sc.allowed = {C::kDeadlineExceeded};
  });
  add("DropNotifications", 6, [&](Scenario& sc) {
    sc.consumer.drop_notification = Probability(0.15);
    sc.allowed = {C::kDeadlineExceeded};
    sc.strikes_fail = true;
  });
  add("TruncateNotifications", 7, [&](Scenario& sc) {
    sc.consumer.truncate_notification = Probability(0.15);
    sc.allowed = {C::kDeadlineExceeded};  // undecodable: as if lost
    sc.strikes_fail = true;
  });
  add("FlipNotificationBytes", 8, [&](Scenario& sc) {
    sc.consumer.flip_notification_byte = Probability(0.2);
    // A flipped id or header is undecodable or names no request (lost); a flipped count,
    // layer or checksum fails verification. A flipped timestamp changes nothing.
    sc.allowed = {C::kDeadlineExceeded, C::kDataLoss};
  });
  add("TruncateWrites", 9, [&](Scenario& sc) {
    sc.producer.truncate_write = Probability(0.15);
    sc.allowed = {C::kDataLoss};
    sc.strikes_fail = true;
    sc.timeouts = generous;
  });
  add("FlipSourceBytesAfterTheChecksum", 10, [&](Scenario& sc) {
    sc.producer.flip_source_byte = Probability(0.15);
    sc.allowed = {C::kDataLoss};  // checksums are verified: never KV taken
    sc.strikes_fail = true;
    sc.timeouts = generous;
  });
  // A failed post fails its request: the producer cancels the request's writes still in
  // flight and says it stopped (Aborted). It cancels a layer's K and V writes one by one, so
  // the V write (with the notice) can still go out after its K write was cancelled: that
  // layer then fails its checksum (DataLoss) first.
  add("FailPosts", 11, [&](Scenario& sc) {
    sc.producer.fail_post = Probability(0.1);
    sc.allowed = {C::kAborted, C::kDataLoss};
    sc.strikes_fail = true;
    sc.timeouts = generous;
  });
  add("FailEveryFifthPost", 12, [&](Scenario& sc) {
    sc.producer.fail_post.every_nth = 5;
    sc.allowed = {C::kAborted, C::kDataLoss};
    sc.strikes_fail = true;
    sc.timeouts = generous;
  });
  add("FailCompletionsAfterPosting", 13, [&](Scenario& sc) {
    // Cancelled at once after posting, so its data may or may not have landed; the
    // producer is told it failed. A layer whose K write never landed while its V write and
    // notice did fails its checksum; otherwise the producer stops the request.
    sc.producer.fail_completion = Probability(0.1);
    sc.allowed = {C::kAborted, C::kDataLoss};
    sc.timeouts = generous;
  });
  add("StallCompletions", 16, [&](Scenario& sc) {
    // The data lands but its completion never comes: the producer's send deadline stops the
    // request and cancels the stalled transfers. The consumer already has what it needs,
    // unless the producer's stop overtakes the last notice (or, as under FailPosts, a
    // layer's K write is cancelled before its V write).
    sc.producer.stall_completion = Probability(0.1);
    sc.timeouts = {5000, 300};
    sc.allowed = {C::kAborted, C::kDataLoss};
  });
  add("LinkDiesAfterTwentyPosts", 14, [&](Scenario& sc) {
    sc.producer.fail_posts_after = 20;
    sc.allowed = {C::kAborted, C::kDataLoss};
    sc.strikes_fail = true;
    sc.timeouts = generous;
  });
  add("DelayedNoticesOfRetriedRequestIds", 17, [&](Scenario& sc) {
    // A notice held past its request's end must not count for the next request of that id.
    sc.consumer.delay_notification = Probability(0.3);
    sc.consumer.max_delay = absl::Milliseconds(600);
    sc.reuse_ids = true;
    sc.layer_compute = absl::Milliseconds(40);
    sc.rounds = 20;
    // A late notice of the previous request of the same id, checked against the retry's
    // blocks once the retry's own bytes landed there, fails the retry's checksum (a healthy
    // request lost, though no KV is taken). DirectedFaultTest shows the worse case.
    sc.allowed = {C::kDeadlineExceeded, C::kDataLoss};
  });
  add("EverythingAtOnce", 15, [&](Scenario& sc) {
    for (FaultPlan* plan : {&sc.producer, &sc.consumer}) {
      plan->fail_post = Probability(0.03);
      plan->fail_completion = Probability(0.03);
      plan->stall_completion = Probability(0.02);
      plan->flip_source_byte = Probability(0.03);
      plan->truncate_write = Probability(0.03);
      plan->drop_notification = Probability(0.03);
      plan->truncate_notification = Probability(0.03);
      plan->flip_notification_byte = Probability(0.03);
      plan->duplicate_notification = Probability(0.1);
      plan->delay_notification = Probability(0.1);
      plan->max_delay = absl::Milliseconds(400);
      plan->reorder_notification = Probability(0.1);
    }
    sc.layer_compute = absl::Milliseconds(5);
    sc.rounds = 20;
    sc.allowed = {C::kDeadlineExceeded, C::kDataLoss, C::kAborted};
  });
  return out;
}

INSTANTIATE_TEST_SUITE_P(Faults, ConnectorFaultTest, ::testing::ValuesIn(Scenarios()),
                         [](const ::testing::TestParamInfo<Scenario>& param_info) {
                           return param_info.param.name;
                         });

}  // namespace
}  // namespace kvstream
