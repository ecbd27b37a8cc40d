// Tests of the demo engine as pipeline stages: stages joined by an in-process channel give
// exactly the outputs of the whole model in one engine, and stages that disagree about a
// batch stop with an error.
#include "kvstream/serving/engine.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;

// Messages between two neighbouring stages, one queue per direction.
class Wire {
 public:
  void Push(int dir, StageMessage m) {
    std::lock_guard<std::mutex> lock(mu_);
    q_[dir].push_back(std::move(m));
    cv_.notify_all();
  }
  absl::StatusOr<StageMessage> Pop(int dir, absl::Time deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    while (q_[dir].empty()) {
      if (closed_) return absl::UnavailableError("the other stage closed");
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("no message");
      cv_.wait_for(lock, absl::ToChronoMilliseconds(left) + std::chrono::milliseconds(1));
    }
    StageMessage m = std::move(q_[dir].front());
    q_[dir].pop_front();
    return m;
  }
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<StageMessage> q_[2];  // 0: forward, 1: backward
  bool closed_ = false;
};

class LocalStageChannel : public StageChannel {
 public:
  LocalStageChannel(int stage, int num_stages, std::shared_ptr<Wire> prev,
                    std::shared_ptr<Wire> next)
      : stage_(stage), num_stages_(num_stages), prev_(prev), next_(next) {}
  int stage() const override { return stage_; }
  int num_stages() const override { return num_stages_; }
  absl::Status SendForward(const StageMessage& m, absl::Time) override {
    if (!next_) return absl::FailedPreconditionError("no next stage");
    next_->Push(0, m);
    return absl::OkStatus();
  }
  absl::StatusOr<StageMessage> ReceiveForward(absl::Time deadline) override {
    if (!prev_) return absl::FailedPreconditionError("no previous stage");
    return prev_->Pop(0, deadline);
  }
  absl::Status SendBackward(const StageMessage& m, absl::Time) override {
    if (!prev_) return absl::FailedPreconditionError("no previous stage");
    prev_->Push(1, m);
    return absl::OkStatus();
  }
  absl::StatusOr<StageMessage> ReceiveBackward(absl::Time deadline) override {
    if (!next_) return absl::FailedPreconditionError("no next stage");
    return next_->Pop(1, deadline);
  }
  // What a stage process does when it exits: its neighbours see the link go away.
  void Close() {
    if (prev_) prev_->Close();
    if (next_) next_->Close();
  }

 private:
  int stage_, num_stages_;
  std::shared_ptr<Wire> prev_, next_;
};

ToyModelConfig Model() {
  ToyModelConfig c;
  c.num_layers = 4;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_size = 16;
  c.intermediate_size = 64;
  c.vocab_size = 97;
  c.block_size = 8;
  return c;
}

std::vector<RequestSpec> Requests(int n) {
  std::vector<RequestSpec> out;
  for (int i = 0; i < n; ++i) {
    RequestSpec r;
    r.id = absl::StrCat("r", i);
    for (int t = 0; t < 5 + 13 * i; ++t) r.prompt.push_back((t * 7 + i) % 97);
    r.max_new_tokens = 4;
    out.push_back(std::move(r));
  }
  return out;
}

// Runs the engine until it has no work; closes the channel when it fails.
absl::Status RunEngine(Engine& engine, LocalStageChannel* channel) {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (engine.HasWork() && absl::Now() < deadline) {
    absl::StatusOr<bool> ran = engine.Step();
    if (!ran.ok()) {
      if (channel != nullptr) channel->Close();
      return ran.status();
    }
  }
  return engine.HasWork() ? absl::DeadlineExceededError("engine did not finish")
                          : absl::OkStatus();
}

std::vector<RequestResult> Sorted(std::vector<RequestResult> v) {
  std::sort(v.begin(), v.end(),
            [](const RequestResult& a, const RequestResult& b) { return a.id < b.id; });
  return v;
}

struct Stages {
  std::vector<std::unique_ptr<LocalStageChannel>> channels;
  std::vector<std::unique_ptr<Engine>> engines;
};

Stages MakeStages(const std::vector<LayerRange>& ranges) {
  Stages s;
  std::vector<std::shared_ptr<Wire>> wires;
  for (size_t i = 0; i + 1 < ranges.size(); ++i) wires.push_back(std::make_shared<Wire>());
  const int n = static_cast<int>(ranges.size());
  for (int i = 0; i < n; ++i) {
    s.channels.push_back(std::make_unique<LocalStageChannel>(
        i, n, i > 0 ? wires[i - 1] : nullptr, i + 1 < n ? wires[i] : nullptr));
    EngineOptions o;
    o.model = Model();
    o.num_blocks = 64;
    o.layers = ranges[i];
    o.pipeline = s.channels.back().get();
    o.stage_timeout = absl::Seconds(30);
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    s.engines.push_back(std::move(e).value());
  }
  return s;
}

TEST(EnginePipelineTest, StagesGiveTheOutputsOfTheWholeModel) {
  EngineOptions whole;
  whole.model = Model();
  whole.num_blocks = 64;
  auto colocated = Engine::Create(whole);
  ASSERT_TRUE(colocated.ok());
  for (const RequestSpec& r : Requests(3)) ASSERT_TRUE((*colocated)->AddRequest(r).ok());
  ASSERT_TRUE(RunEngine(**colocated, nullptr).ok());
  const std::vector<RequestResult> expected = Sorted((*colocated)->TakeFinished());
  ASSERT_EQ(expected.size(), 3u);

  Stages stages = MakeStages({{0, 1}, {1, 3}, {3, 4}});
  std::vector<absl::Status> status(3);
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    for (const RequestSpec& r : Requests(3)) ASSERT_TRUE(stages.engines[i]->AddRequest(r).ok());
    threads.emplace_back(
        [&, i] { status[i] = RunEngine(*stages.engines[i], stages.channels[i].get()); });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(status[i].ok()) << "stage " << i << ": " << status[i];
    const std::vector<RequestResult> got = Sorted(stages.engines[i]->TakeFinished());
    ASSERT_EQ(got.size(), expected.size());
    for (size_t r = 0; r < got.size(); ++r) {
      EXPECT_EQ(got[r].id, expected[r].id);
      EXPECT_EQ(got[r].output_tokens, expected[r].output_tokens) << "stage " << i;
      ASSERT_EQ(got[r].logits.size(), expected[r].logits.size());
      EXPECT_EQ(std::memcmp(got[r].logits.data(), expected[r].logits.data(),
                            got[r].logits.size() * sizeof(float)),
                0)
          << "stage " << i << " " << got[r].id;
    }
    EXPECT_EQ(stages.engines[i]->num_free_blocks(), stages.engines[i]->num_blocks());
  }
}

TEST(EnginePipelineTest, StagesWithDifferentBatchesStop) {
  Stages stages = MakeStages({{0, 2}, {2, 4}});
  for (const RequestSpec& r : Requests(2)) ASSERT_TRUE(stages.engines[0]->AddRequest(r).ok());
  for (const RequestSpec& r : Requests(3)) ASSERT_TRUE(stages.engines[1]->AddRequest(r).ok());
  absl::Status s0, s1;
  std::thread t0([&] { s0 = RunEngine(*stages.engines[0], stages.channels[0].get()); });
  std::thread t1([&] { s1 = RunEngine(*stages.engines[1], stages.channels[1].get()); });
  t0.join();
  t1.join();
  EXPECT_EQ(s1.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s1.message(), HasSubstr("another batch"));
  EXPECT_FALSE(s0.ok());
}

TEST(EnginePipelineTest, StageLayersMustFitItsPlace) {
  auto wire = std::make_shared<Wire>();
  LocalStageChannel first(0, 2, nullptr, wire);
  EngineOptions o;
  o.model = Model();
  o.layers = LayerRange{1, 4};  // stage 0 must start at layer 0
  o.pipeline = &first;
  EXPECT_EQ(Engine::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.layers = LayerRange{0, 4};  // and, not being the last stage, must not end at the last
  EXPECT_EQ(Engine::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.layers.reset();  // a channel without layers
  EXPECT_EQ(Engine::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// The prompt's last token in a step of its own (what the CUDA model runs with): the same
// tokens and logits as the usual schedule, one more step per prompt, and with requests
// arriving while others decode (so that one-row and longer sequences share steps). A
// one-token prompt has nothing to split.
TEST(EngineScheduleTest, SplittingThePromptsLastTokenChangesNoBit) {
  auto run = [](bool split) -> std::pair<std::vector<RequestResult>, int64_t> {
    EngineOptions o;
    o.model = Model();
    o.num_blocks = 64;
    o.split_last_prompt_token = split;
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return {};
    std::vector<RequestSpec> requests = Requests(3);
    RequestSpec single;
    single.id = "one-token";
    single.prompt = {42};
    single.max_new_tokens = 3;
    requests.push_back(single);
    EXPECT_TRUE((*e)->AddRequest(requests[0]).ok());
    for (int step = 0; step < 3; ++step) EXPECT_TRUE((*e)->Step().ok());
    for (size_t i = 1; i < requests.size(); ++i) EXPECT_TRUE((*e)->AddRequest(requests[i]).ok());
    EXPECT_TRUE(RunEngine(**e, nullptr).ok());
    EXPECT_EQ((*e)->num_free_blocks(), (*e)->num_blocks());
    return {Sorted((*e)->TakeFinished()), (*e)->steps()};
  };
  const auto [plain, plain_steps] = run(false);
  const auto [split, split_steps] = run(true);
  ASSERT_EQ(plain.size(), 4u);
  ASSERT_EQ(split.size(), 4u);
  for (size_t i = 0; i < plain.size(); ++i) {
    SCOPED_TRACE(plain[i].id);
    EXPECT_TRUE(split[i].status.ok()) << split[i].status;
    EXPECT_EQ(split[i].output_tokens, plain[i].output_tokens);
    EXPECT_EQ(split[i].logits, plain[i].logits);
    EXPECT_EQ(split[i].output_tokens.size(), plain[i].id == "one-token" ? 3u : 4u);
    // The prefill pass is the prompt but its last token: none for a one-token prompt.
    for (const RequestResult* r : {&plain[i], &split[i]}) {
      if (plain[i].id == "one-token") {
        EXPECT_EQ(r->prefill_ms, 0.0);
        EXPECT_EQ(r->prefill_start_ns, 0u);
      } else {
        EXPECT_GT(r->prefill_ms, 0.0);
        EXPECT_GT(r->prefill_start_ns, 0u);
        EXPECT_LE(r->prefill_ms, r->ttft_ms);
      }
    }
  }
  // Usual: r0's prefill and two decodes, then r0's last decode with the others' prefills,
  // then three decodes: 7 steps. Split: r0's prompt takes two steps, which delays it by
  // one; r1 and r2 then take their extra step while r0 and the one-token prompt decode, so
  // the run is one step longer, not three: 8.
  EXPECT_EQ(plain_steps, 7);
  EXPECT_EQ(split_steps, 8);
}

}  // namespace
}  // namespace kvstream
