// Tests of the transfer bookkeeping cuda_ipc and nccl share (transfer/src/transfer_table.h):
// the phases kQueued -> kSending -> kDone and kFailed, post order per peer, notification
// frames with their tails, Cancel and Release as transport.h says, peer failure, the
// transport's destruction, and the inbox. No GPU, no socket: the "connection" is a byte
// counter and the data's readiness a flag in the test's Work.
#include "transfer/src/transfer_table.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvstream {
namespace internal {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

struct Work {
  bool in_place = false;
};
using Table = TransferTable<Work>;

constexpr PeerId kPeer = 7;
constexpr PeerId kOther = 8;

// A stand-in for a peer's connection: frames queued, and how many bytes it has sent.
struct FakeConnection {
  std::vector<std::string> frames;
  uint64_t queued_bytes = 0;
  uint64_t sent_bytes = 0;

  uint64_t Queue(std::string frame) {
    queued_bytes += frame.size();
    frames.push_back(std::move(frame));
    return queued_bytes;
  }
};

bool InPlace(const Table::Transfer& t) { return t.work.in_place; }

// StartReady with the Work's flag, then FinishSent at what the connection has sent.
void Pump(Table& table, PeerId peer, FakeConnection& conn) {
  ASSERT_TRUE(table.StartReady(peer, InPlace, [&conn](std::string f) {
                     return conn.Queue(std::move(f));
                   }).ok());
  table.FinishSent(peer, conn.sent_bytes);
}

TransferState StateOf(const Table& table, TransferId id) {
  absl::StatusOr<TransferState> s = table.Test(id);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : TransferState::kInProgress;
}

TEST(TransferTableTest, IdsStartAtOneAndAreNeverReused) {
  Table table("test");
  const TransferId a = table.Add(kPeer, "a", nullptr, 0, Work{});
  const TransferId b = table.Add(kOther, "b", nullptr, 0, Work{});
  table.Release(a);
  const TransferId c = table.Add(kPeer, "c", nullptr, 0, Work{});
  EXPECT_EQ(a, 1u);
  EXPECT_EQ(b, 2u);
  EXPECT_EQ(c, 3u);
}

TEST(TransferTableTest, QueuedUntilInPlaceThenSendingUntilTheFrameLeftThenDone) {
  Table table("test");
  FakeConnection conn;
  const TransferId id = table.Add(kPeer, "layer 0", nullptr, 0, Work{});
  Pump(table, kPeer, conn);
  EXPECT_EQ(table.Find(id)->phase, TransferPhase::kQueued);
  EXPECT_TRUE(conn.frames.empty());

  table.Find(id)->work.in_place = true;
  Pump(table, kPeer, conn);
  EXPECT_EQ(table.Find(id)->phase, TransferPhase::kSending);
  EXPECT_EQ(StateOf(table, id), TransferState::kInProgress);
  ASSERT_THAT(conn.frames, ElementsAre("layer 0"));

  conn.sent_bytes = 6;  // one byte short of the frame's end
  table.FinishSent(kPeer, conn.sent_bytes);
  EXPECT_EQ(StateOf(table, id), TransferState::kInProgress);
  conn.sent_bytes = 7;
  table.FinishSent(kPeer, conn.sent_bytes);
  EXPECT_EQ(StateOf(table, id), TransferState::kDone);
}

TEST(TransferTableTest, WithoutANotificationItIsDoneOnceInPlace) {
  Table table("test");
  FakeConnection conn;
  const TransferId id = table.Add(kPeer, "", nullptr, 0, Work{true});
  Pump(table, kPeer, conn);
  EXPECT_EQ(StateOf(table, id), TransferState::kDone);
  EXPECT_TRUE(conn.frames.empty());
}

TEST(TransferTableTest, TheFrameCarriesTheTailReadWhenItIsMade) {
  Table table("test");
  FakeConnection conn;
  char tail[4] = {'x', 'x', 'x', 'x'};
  const TransferId id = table.Add(kPeer, "sum:", tail, sizeof(tail), Work{});
  // The GPU writes the tail after the post, before the data is in place.
  tail[0] = 'a';
  tail[1] = 'b';
  tail[2] = 'c';
  tail[3] = 'd';
  table.Find(id)->work.in_place = true;
  Pump(table, kPeer, conn);
  EXPECT_THAT(conn.frames, ElementsAre("sum:abcd"));
}

TEST(TransferTableTest, NotificationsLeaveInPostOrderPerPeer) {
  Table table("test");
  FakeConnection conn;
  FakeConnection other_conn;
  const TransferId first = table.Add(kPeer, "first", nullptr, 0, Work{false});
  const TransferId second = table.Add(kPeer, "second", nullptr, 0, Work{true});
  const TransferId other = table.Add(kOther, "other", nullptr, 0, Work{true});
  Pump(table, kPeer, conn);
  Pump(table, kOther, other_conn);
  // The second waits behind the first, whose data is not in place; another peer does not.
  EXPECT_TRUE(conn.frames.empty());
  EXPECT_EQ(table.Find(second)->phase, TransferPhase::kQueued);
  EXPECT_THAT(other_conn.frames, ElementsAre("other"));
  EXPECT_EQ(table.Find(other)->phase, TransferPhase::kSending);

  table.Find(first)->work.in_place = true;
  Pump(table, kPeer, conn);
  EXPECT_THAT(conn.frames, ElementsAre("first", "second"));
  // Done in order as the connection sends.
  conn.sent_bytes = 5;
  table.FinishSent(kPeer, conn.sent_bytes);
  EXPECT_EQ(StateOf(table, first), TransferState::kDone);
  EXPECT_EQ(StateOf(table, second), TransferState::kInProgress);
  conn.sent_bytes = 11;
  table.FinishSent(kPeer, conn.sent_bytes);
  EXPECT_EQ(StateOf(table, second), TransferState::kDone);
}

TEST(TransferTableTest, CancelFailsAQueuedTransferWithCancelled) {
  Table table("test");
  FakeConnection conn;
  const TransferId id = table.Add(kPeer, "n", nullptr, 0, Work{});
  ASSERT_TRUE(table.Cancel(id).ok());
  absl::StatusOr<TransferState> s = table.Test(id);
  EXPECT_TRUE(absl::IsCancelled(s.status())) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("test transfer 1 cancelled"));
  // Its data arriving later changes nothing, and nothing is sent for it.
  table.Find(id)->work.in_place = true;
  Pump(table, kPeer, conn);
  EXPECT_TRUE(conn.frames.empty());
  EXPECT_TRUE(absl::IsCancelled(table.Test(id).status()));
}

TEST(TransferTableTest, CancelKeepsASendingTransferWhichCompletesDone) {
  Table table("test");
  FakeConnection conn;
  const TransferId id = table.Add(kPeer, "n", nullptr, 0, Work{true});
  Pump(table, kPeer, conn);
  ASSERT_EQ(table.Find(id)->phase, TransferPhase::kSending);
  ASSERT_TRUE(table.Cancel(id).ok());
  EXPECT_EQ(StateOf(table, id), TransferState::kInProgress);
  conn.sent_bytes = 1;
  table.FinishSent(kPeer, conn.sent_bytes);
  EXPECT_EQ(StateOf(table, id), TransferState::kDone);
  ASSERT_TRUE(table.Cancel(id).ok());  // done stays done
  EXPECT_EQ(StateOf(table, id), TransferState::kDone);
}

TEST(TransferTableTest, UnknownOrReleasedIdsAreNotFound) {
  Table table("test");
  EXPECT_TRUE(absl::IsNotFound(table.Test(5).status()));
  EXPECT_THAT(table.Test(5).status().message(), HasSubstr("test: unknown transfer 5"));
  EXPECT_TRUE(absl::IsNotFound(table.Cancel(5)));
  const TransferId id = table.Add(kPeer, "n", nullptr, 0, Work{});
  table.Release(id);
  EXPECT_TRUE(absl::IsNotFound(table.Test(id).status()));
  EXPECT_TRUE(absl::IsNotFound(table.Cancel(id)));
  EXPECT_EQ(table.Find(id), nullptr);
  table.Release(id);  // twice: harmless
}

TEST(TransferTableTest, AReleasedTransferNoLongerHoldsUpTheQueue) {
  Table table("test");
  FakeConnection conn;
  const TransferId first = table.Add(kPeer, "first", nullptr, 0, Work{false});
  const TransferId second = table.Add(kPeer, "second", nullptr, 0, Work{true});
  table.Release(first);
  Pump(table, kPeer, conn);
  EXPECT_THAT(conn.frames, ElementsAre("second"));
  EXPECT_EQ(table.Find(second)->phase, TransferPhase::kSending);
}

TEST(TransferTableTest, AReleasedSendingTransferDoesNotHoldUpLaterOnes) {
  Table table("test");
  FakeConnection conn;
  const TransferId first = table.Add(kPeer, "first", nullptr, 0, Work{true});
  const TransferId second = table.Add(kPeer, "second", nullptr, 0, Work{true});
  Pump(table, kPeer, conn);
  table.Release(first);
  conn.sent_bytes = conn.queued_bytes;
  table.FinishSent(kPeer, conn.sent_bytes);
  EXPECT_EQ(StateOf(table, second), TransferState::kDone);
}

TEST(TransferTableTest, AFailedTransferKeepsItsErrorAndIsSkipped) {
  Table table("test");
  FakeConnection conn;
  const TransferId first = table.Add(kPeer, "first", nullptr, 0, Work{false});
  const TransferId second = table.Add(kPeer, "second", nullptr, 0, Work{true});
  table.Fail(first, absl::InternalError("the copy failed"));
  EXPECT_EQ(table.Unfailed(first), nullptr);
  EXPECT_NE(table.Unfailed(second), nullptr);
  Pump(table, kPeer, conn);
  EXPECT_THAT(conn.frames, ElementsAre("second"));
  EXPECT_EQ(table.Test(first).status(), absl::InternalError("the copy failed"));
  // The first error wins; a done transfer cannot fail.
  table.Fail(first, absl::UnavailableError("later"));
  EXPECT_EQ(table.Test(first).status(), absl::InternalError("the copy failed"));
  conn.sent_bytes = conn.queued_bytes;
  table.FinishSent(kPeer, conn.sent_bytes);
  table.Fail(second, absl::UnavailableError("too late"));
  EXPECT_EQ(StateOf(table, second), TransferState::kDone);
}

TEST(TransferTableTest, FailPeerFailsItsQueuedAndSendingTransfersOnly) {
  Table table("test");
  FakeConnection conn;
  const TransferId sending = table.Add(kPeer, "sending", nullptr, 0, Work{true});
  const TransferId queued = table.Add(kPeer, "queued", nullptr, 0, Work{false});
  const TransferId silent = table.Add(kPeer, "", nullptr, 0, Work{false});
  const TransferId other = table.Add(kOther, "other", nullptr, 0, Work{false});
  Pump(table, kPeer, conn);
  ASSERT_EQ(table.Find(sending)->phase, TransferPhase::kSending);
  const absl::Status lost = absl::UnavailableError("peer 7 failed: closed");
  table.FailPeer(kPeer, lost);
  EXPECT_EQ(table.Test(sending).status(), lost);
  EXPECT_EQ(table.Test(queued).status(), lost);
  EXPECT_EQ(table.Test(silent).status(), lost);  // queued too, behind the others
  EXPECT_EQ(StateOf(table, other), TransferState::kInProgress);
  // Nothing more goes to the failed peer.
  table.Find(queued)->work.in_place = true;
  Pump(table, kPeer, conn);
  EXPECT_EQ(conn.frames.size(), 1u);
}

TEST(TransferTableTest, FailAllEndsEveryUnfinishedTransfer) {
  Table table("test");
  FakeConnection conn;
  const TransferId done = table.Add(kPeer, "", nullptr, 0, Work{true});
  const TransferId queued = table.Add(kPeer, "q", nullptr, 0, Work{false});
  const TransferId other = table.Add(kOther, "o", nullptr, 0, Work{false});
  Pump(table, kPeer, conn);
  table.FailAll(absl::CancelledError("destroyed"));
  EXPECT_EQ(StateOf(table, done), TransferState::kDone);
  EXPECT_TRUE(absl::IsCancelled(table.Test(queued).status()));
  EXPECT_TRUE(absl::IsCancelled(table.Test(other).status()));
  table.Clear();
  EXPECT_TRUE(absl::IsNotFound(table.Test(done).status()));
}

TEST(TransferTableTest, ARefusingPredicateStopsAndLeavesTheTransferQueued) {
  Table table("test");
  FakeConnection conn;
  const TransferId id = table.Add(kPeer, "n", nullptr, 0, Work{true});
  absl::Status s = table.StartReady(
      kPeer, [](Table::Transfer&) -> absl::StatusOr<bool> {
        return absl::InternalError("event query failed");
      },
      [&conn](std::string f) { return conn.Queue(std::move(f)); });
  EXPECT_EQ(s, absl::InternalError("event query failed"));
  EXPECT_EQ(table.Find(id)->phase, TransferPhase::kQueued);
  EXPECT_TRUE(conn.frames.empty());
}

TEST(TransferTableTest, TheInboxReturnsNotificationsInArrivalOrderOnce) {
  Table table("test");
  table.inbox().Deliver({kPeer, "a"});
  table.inbox().Deliver({kOther, "b"});
  table.inbox().Deliver({kPeer, "c"});
  std::vector<Notification> got = table.inbox().Take();
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].payload, "a");
  EXPECT_EQ(got[1].peer, kOther);
  EXPECT_EQ(got[2].payload, "c");
  EXPECT_TRUE(table.inbox().Take().empty());
}

}  // namespace
}  // namespace internal
}  // namespace kvstream
