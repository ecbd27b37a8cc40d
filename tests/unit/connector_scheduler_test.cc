// Tests of the layerwise connector's scheduler side on its own: what goes into each step's
// metadata and what RequestFinished says, driven by hand-made worker outputs (the worker
// side is not involved: the scheduler side knows only what outputs tell it).
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kvstream/connector/factory.h"
#include "kvstream/connector/layerwise_connector.h"

namespace kvstream {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr int kBlock = 4;

std::unique_ptr<KvConnectorScheduler> Make(KvRole role, bool load_async = false) {
  KvTransferConfig c;
  c.kv_connector = "LayerwiseConnector";
  c.kv_role = role;
  c.kvstream.load_async = load_async;
  auto s = CreateKvConnectorScheduler(c, kBlock);
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(s).value();
}

KvRequest Remote(const std::string& id, int prompt_len) {
  KvRequest r;
  r.request_id = id;
  for (int i = 0; i < prompt_len; ++i) r.prompt_token_ids.push_back(i);
  r.remote_prefill = RemotePrefill{"127.0.0.1", 4000};
  return r;
}

std::vector<std::string> LoadIds(const KvConnectorMetadata& m) {
  std::vector<std::string> ids;
  for (const auto& l : m.loads) ids.push_back(l.request_id);
  return ids;
}

TEST(ConnectorSchedulerTest, ConsumerHandsOffOnceAndWaitsUntilTheWorkerReportsArrival) {
  auto s = Make(KvRole::kConsumer);
  KvRequest r = Remote("a", 10);
  auto m = s->GetNumNewMatchedTokens(r, 0);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->num_tokens, 9);  // all but the last prompt token
  ASSERT_TRUE(s->UpdateStateAfterAlloc(r, {7, 3, 5}, 9).ok());
  EXPECT_EQ(s->UpdateStateAfterAlloc(r, {7, 3, 5}, 9).code(), absl::StatusCode::kAlreadyExists);
  auto step1 = s->BuildConnectorMeta({{"a", 9, 1}});
  ASSERT_TRUE(step1.ok());
  EXPECT_THAT(LoadIds(*step1), ElementsAre("a"));
  EXPECT_EQ(step1->loads[0].block_ids, (std::vector<int32_t>{7, 3, 5}));
  EXPECT_EQ(step1->loads[0].num_tokens, 9);
  EXPECT_EQ(step1->loads[0].remote.port, 4000);
  EXPECT_THAT(step1->waits, ElementsAre("a"));
  // Until the worker says the layers arrived, the request is still waited for; the load is
  // not handed over twice.
  auto step2 = s->BuildConnectorMeta({{"a", 10, 1}});
  EXPECT_THAT(step2->loads, IsEmpty());
  EXPECT_THAT(step2->waits, ElementsAre("a"));
  KvConnectorOutput out;
  out.finished_recving = {"a"};
  ASSERT_TRUE(s->UpdateConnectorOutput(out).ok());
  auto step3 = s->BuildConnectorMeta({{"a", 11, 1}});
  EXPECT_THAT(step3->waits, IsEmpty());
  auto delay = s->RequestFinished("a");
  ASSERT_TRUE(delay.ok());
  EXPECT_FALSE(*delay);
}

TEST(ConnectorSchedulerTest, ConsumerLoadsAsynchronouslyWhenConfigured) {
  for (bool async : {false, true}) {
    auto s = Make(KvRole::kConsumer, async);
    auto m = s->GetNumNewMatchedTokens(Remote("a", 10), 0);
    ASSERT_TRUE(m.ok());
    EXPECT_EQ(m->num_tokens, 9);
    EXPECT_EQ(m->load_async, async);
    // Nothing to load: never asynchronous.
    auto none = s->GetNumNewMatchedTokens(Remote("b", 10), 9);
    ASSERT_TRUE(none.ok());
    EXPECT_EQ(none->num_tokens, 0);
    EXPECT_FALSE(none->load_async);
  }
}

TEST(ConnectorSchedulerTest, ConsumerRefusesTooFewBlocks) {
  auto s = Make(KvRole::kConsumer);
  absl::Status st = s->UpdateStateAfterAlloc(Remote("a", 10), {1, 2}, 9);  // 9 tokens need 3
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("2 blocks for 9 tokens"));
  EXPECT_THAT(s->BuildConnectorMeta({})->loads, IsEmpty());
}

TEST(ConnectorSchedulerTest, ConsumerFinishedWhileLoadingHoldsBlocksAndTellsTheWorker) {
  auto s = Make(KvRole::kConsumer);
  ASSERT_TRUE(s->UpdateStateAfterAlloc(Remote("a", 10), {1, 2, 3}, 9).ok());
  ASSERT_TRUE(s->BuildConnectorMeta({{"a", 9, 1}}).ok());
  auto delay = s->RequestFinished("a");
  ASSERT_TRUE(delay.ok());
  EXPECT_TRUE(*delay);  // the producer may still write into its blocks
  auto next = s->BuildConnectorMeta({});
  EXPECT_THAT(next->finished, ElementsAre("a"));
  EXPECT_THAT(s->BuildConnectorMeta({})->finished, IsEmpty());  // said once
  KvConnectorOutput out;
  out.finished_recving = {"a"};
  ASSERT_TRUE(s->UpdateConnectorOutput(out).ok());
  EXPECT_FALSE(*s->RequestFinished("a"));  // forgotten
}

TEST(ConnectorSchedulerTest, ConsumerFinishedBeforeItsHandOffFreesAtOnce) {
  auto s = Make(KvRole::kConsumer);
  ASSERT_TRUE(s->UpdateStateAfterAlloc(Remote("a", 10), {1, 2, 3}, 9).ok());
  auto delay = s->RequestFinished("a");
  ASSERT_TRUE(delay.ok());
  EXPECT_FALSE(*delay);
  auto meta = s->BuildConnectorMeta({});
  EXPECT_THAT(meta->loads, IsEmpty());
  EXPECT_THAT(meta->finished, IsEmpty());
}

TEST(ConnectorSchedulerTest, ConsumerLoadErrorStopsTheWaitsButHoldsTheBlocks) {
  auto s = Make(KvRole::kConsumer);
  ASSERT_TRUE(s->UpdateStateAfterAlloc(Remote("a", 10), {1, 2, 3}, 9).ok());
  ASSERT_TRUE(s->BuildConnectorMeta({{"a", 9, 1}}).ok());
  KvConnectorOutput out;
  out.load_errors.push_back({"a", {1, 2, 3}, absl::UnavailableError("lost")});
  ASSERT_TRUE(s->UpdateConnectorOutput(out).ok());
  EXPECT_THAT(s->BuildConnectorMeta({{"a", 9, 1}})->waits, IsEmpty());
  EXPECT_TRUE(*s->RequestFinished("a"));  // until the worker says nothing can land
}

TEST(ConnectorSchedulerTest, LocalRequestsNeedNothing) {
  auto s = Make(KvRole::kConsumer);
  KvRequest local = Remote("l", 10);
  local.remote_prefill.reset();
  EXPECT_EQ(s->GetNumNewMatchedTokens(local, 0)->num_tokens, 0);
  ASSERT_TRUE(s->UpdateStateAfterAlloc(local, {1}, 0).ok());
  auto meta = s->BuildConnectorMeta({{"l", 0, 10}});
  EXPECT_THAT(meta->loads, IsEmpty());
  EXPECT_THAT(meta->waits, IsEmpty());
  EXPECT_FALSE(*s->RequestFinished("l"));
}

TEST(ConnectorSchedulerTest, ProducerSavesOnceThePrefillCoversTheHandedOverTokens) {
  auto s = Make(KvRole::kProducer);
  KvConnectorOutput out;
  out.incoming.push_back({"p", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 9});
  ASSERT_TRUE(s->UpdateConnectorOutput(out).ok());
  std::vector<KvRequest> in = s->TakeIncomingRequests();
  ASSERT_EQ(in.size(), 1u);
  EXPECT_EQ(in[0].request_id, "p");
  EXPECT_EQ(in[0].prompt_token_ids.size(), 10u);
  EXPECT_THAT(s->TakeIncomingRequests(), IsEmpty());
  EXPECT_EQ(s->UpdateStateAfterAlloc(in[0], {4, 5}, 0).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(s->UpdateStateAfterAlloc(in[0], {4, 5, 6}, 0).ok());
  // A chunk of 8 tokens does not cover the 9 handed over; the next chunk does.
  EXPECT_THAT(s->BuildConnectorMeta({{"p", 0, 8}})->saves, IsEmpty());
  auto meta = s->BuildConnectorMeta({{"p", 8, 2}});
  ASSERT_EQ(meta->saves.size(), 1u);
  EXPECT_EQ(meta->saves[0].block_ids, (std::vector<int32_t>{4, 5, 6}));
  EXPECT_EQ(meta->saves[0].num_tokens, 9);
  EXPECT_THAT(s->BuildConnectorMeta({{"p", 10, 1}})->saves, IsEmpty());  // saved once
  EXPECT_TRUE(*s->RequestFinished("p"));  // sends still running
  KvConnectorOutput sent;
  sent.finished_sending = {"p"};
  ASSERT_TRUE(s->UpdateConnectorOutput(sent).ok());
  EXPECT_FALSE(*s->RequestFinished("p"));
}

TEST(ConnectorSchedulerTest, ProducerSendsDoneBeforeTheEngineFinishedFreeAtOnce) {
  auto s = Make(KvRole::kProducer);
  KvConnectorOutput out;
  out.incoming.push_back({"p", {1, 2, 3, 4, 5}, 4});
  ASSERT_TRUE(s->UpdateConnectorOutput(out).ok());
  ASSERT_TRUE(s->UpdateStateAfterAlloc(s->TakeIncomingRequests()[0], {0, 1}, 0).ok());
  ASSERT_EQ(s->BuildConnectorMeta({{"p", 0, 5}})->saves.size(), 1u);
  KvConnectorOutput sent;
  sent.finished_sending = {"p"};
  ASSERT_TRUE(s->UpdateConnectorOutput(sent).ok());
  EXPECT_FALSE(*s->RequestFinished("p"));
}

// A hand-off that the worker stops before its next report (its consumer aborted it, or was
// lost) arrives in one output as incoming and finished sending: the finish is about that
// hand-off, so nothing is saved and the engine frees the blocks when it finishes.
TEST(ConnectorSchedulerTest, ProducerHandedOverAndStoppedInOneOutputHoldsNothing) {
  auto s = Make(KvRole::kProducer);
  KvConnectorOutput out;
  out.incoming.push_back({"p", {1, 2, 3, 4, 5}, 4});
  out.finished_sending = {"p"};
  ASSERT_TRUE(s->UpdateConnectorOutput(out).ok());
  std::vector<KvRequest> in = s->TakeIncomingRequests();
  ASSERT_EQ(in.size(), 1u);
  ASSERT_TRUE(s->UpdateStateAfterAlloc(in[0], {0, 1}, 0).ok());
  EXPECT_THAT(s->BuildConnectorMeta({{"p", 0, 5}})->saves, IsEmpty());
  EXPECT_FALSE(*s->RequestFinished("p"));
  // The request is forgotten: the same id may be handed over again.
  KvConnectorOutput again;
  again.incoming.push_back({"p", {1, 2, 3, 4, 5}, 4});
  EXPECT_TRUE(s->UpdateConnectorOutput(again).ok());
}

// Stopped by the worker after its hand-off was reported but before the engine allocated its
// blocks: the allocation is no error, nothing is saved, and nothing is waited for.
TEST(ConnectorSchedulerTest, ProducerStoppedBeforeItsAllocationHoldsNothing) {
  auto s = Make(KvRole::kProducer);
  KvConnectorOutput out;
  out.incoming.push_back({"p", {1, 2, 3, 4, 5}, 4});
  ASSERT_TRUE(s->UpdateConnectorOutput(out).ok());
  std::vector<KvRequest> in = s->TakeIncomingRequests();
  ASSERT_EQ(in.size(), 1u);
  KvConnectorOutput stopped;
  stopped.finished_sending = {"p"};
  ASSERT_TRUE(s->UpdateConnectorOutput(stopped).ok());
  ASSERT_TRUE(s->UpdateStateAfterAlloc(in[0], {0, 1}, 0).ok());
  EXPECT_THAT(s->BuildConnectorMeta({{"p", 0, 5}})->saves, IsEmpty());
  EXPECT_FALSE(*s->RequestFinished("p"));
}

// The consumer hands an id over again once the worker stopped its first attempt (reported
// finished), while the engine still runs that attempt: the engine cannot take a second
// request of one id, so the new hand-off is refused (the worker stops it and tells its
// consumer), without failing the engine; once the first attempt ended, the id is free.
TEST(ConnectorSchedulerTest, ProducerHandOffOfAnIdTheEngineStillRunsIsRefused) {
  auto s = Make(KvRole::kProducer);
  KvConnectorOutput out;
  out.incoming.push_back({"p", {1, 2, 3, 4, 5}, 4});
  ASSERT_TRUE(s->UpdateConnectorOutput(out).ok());
  ASSERT_TRUE(s->UpdateStateAfterAlloc(s->TakeIncomingRequests()[0], {0, 1}, 0).ok());
  KvConnectorOutput stopped;
  stopped.finished_sending = {"p"};
  ASSERT_TRUE(s->UpdateConnectorOutput(stopped).ok());
  ASSERT_TRUE(s->UpdateConnectorOutput(out).ok());  // the second attempt
  EXPECT_THAT(s->TakeIncomingRequests(), IsEmpty());
  EXPECT_THAT(s->BuildConnectorMeta({})->finished, ElementsAre("p"));
  // The worker's report of the refused attempt changes nothing for the first.
  ASSERT_TRUE(s->UpdateConnectorOutput(stopped).ok());
  EXPECT_FALSE(*s->RequestFinished("p"));
  ASSERT_TRUE(s->UpdateConnectorOutput(stopped).ok());  // late: unknown, ignored
  ASSERT_TRUE(s->UpdateConnectorOutput(out).ok());
  EXPECT_EQ(s->TakeIncomingRequests().size(), 1u);
}

TEST(ConnectorSchedulerTest, ProducerFinishedUnsentTellsTheWorker) {
  auto s = Make(KvRole::kProducer);
  KvConnectorOutput out;
  out.incoming.push_back({"p", {1, 2, 3, 4, 5}, 4});
  ASSERT_TRUE(s->UpdateConnectorOutput(out).ok());
  EXPECT_EQ(s->UpdateConnectorOutput(out).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_FALSE(*s->RequestFinished("p"));  // nothing was sent: nothing to wait for
  EXPECT_THAT(s->BuildConnectorMeta({})->finished, ElementsAre("p"));
}

TEST(ConnectorSchedulerTest, BadConfigsAndBlockSizesAreRefused) {
  KvTransferConfig c;
  c.kv_connector = "LayerwiseConnector";
  EXPECT_EQ(CreateKvConnectorScheduler(c, 0).status().code(), absl::StatusCode::kInvalidArgument);
  c.kv_role = KvRole::kProducer;
  c.kvstream.pipeline_parallel_size = 2;
  EXPECT_THAT(CreateKvConnectorScheduler(c, 16).status().message(), HasSubstr("kv_consumer"));
  c.kv_connector = "NixlConnector";
  EXPECT_EQ(CreateKvConnectorScheduler(c, 16).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvstream
