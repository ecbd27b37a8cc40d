// Tests of FaultyTransport over two loopback transports: each fault does what
// faulty_transport.h says, on the side it says, and is counted.
#include "tests/testing/faulty_transport.h"

#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvstream/transfer/loopback_transport.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;

constexpr size_t kBytes = 256;

// A sender and a receiver, each wrapped; the receiver's region `dst` is imported by the
// sender. The source region holds 0..255.
class FaultyTransportTest : public ::testing::Test {
 protected:
  void Start(const FaultPlan& sender_plan, const FaultPlan& receiver_plan) {
    auto s = FaultyTransport::Create(fabric_.CreateTransport("s").value(), sender_plan);
    auto r = FaultyTransport::Create(fabric_.CreateTransport("r").value(), receiver_plan);
    ASSERT_TRUE(s.ok() && r.ok());
    sender_ = std::move(s).value();
    receiver_ = std::move(r).value();
    for (size_t i = 0; i < kBytes; ++i) src_[i] = static_cast<uint8_t>(i);
    std::memset(dst_, 0, kBytes);
    src_reg_ = sender_->RegisterMemory(src_, kBytes, MemoryKind::kHost).value();
    dst_reg_ = receiver_->RegisterMemory(dst_, kBytes, MemoryKind::kHost).value();
    peer_ = sender_->Connect(receiver_->LocalInfo().value()).value();
    remote_ = sender_->ImportRemote(peer_, dst_reg_->descriptor()).value();
  }
  void TearDown() override {
    remote_.reset();
    src_reg_.reset();
    dst_reg_.reset();
  }

  absl::StatusOr<TransferId> Write(const std::string& notice) {
    const Segment seg{0, 0, kBytes};
    return sender_->PostWrite(peer_, *src_reg_, *remote_, {&seg, 1}, notice);
  }
  absl::StatusOr<TransferState> Wait(TransferId id) {
    return WaitForTransfer(*sender_, id, absl::Now() + absl::Seconds(5));
  }
  // Polls the receiver for `ms` milliseconds.
  std::vector<std::string> Receive(int ms) {
    std::vector<std::string> got;
    const absl::Time until = absl::Now() + absl::Milliseconds(ms);
    while (absl::Now() < until) {
      (void)sender_->Progress();
      (void)receiver_->Progress();
      for (Notification& n : receiver_->PollNotifications()) got.push_back(n.payload);
      absl::SleepFor(absl::Milliseconds(1));
    }
    return got;
  }

  LoopbackFabric fabric_;
  std::unique_ptr<FaultyTransport> sender_;
  std::unique_ptr<FaultyTransport> receiver_;
  uint8_t src_[kBytes];
  uint8_t dst_[kBytes];
  std::unique_ptr<MemoryRegistration> src_reg_;
  std::unique_ptr<MemoryRegistration> dst_reg_;
  PeerId peer_ = 0;
  std::unique_ptr<RemoteMemory> remote_;
};

FaultRate Always() {
  FaultRate r;
  r.probability = 1;
  return r;
}

TEST_F(FaultyTransportTest, NoFaultsPassesEverythingThrough) {
  Start({}, {});
  auto id = Write("n1");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(Wait(*id).value(), TransferState::kDone);
  EXPECT_EQ(Receive(5), std::vector<std::string>{"n1"});
  EXPECT_EQ(std::memcmp(src_, dst_, kBytes), 0);
  EXPECT_EQ(sender_->counts().posts, 1);
  EXPECT_EQ(receiver_->counts().notifications, 1);
  EXPECT_EQ(sender_->counts().injected() + receiver_->counts().injected(), 0);
}

TEST_F(FaultyTransportTest, BadPlansRejected) {
  FaultPlan plan;
  plan.drop_notification.probability = 1.5;
  EXPECT_EQ(FaultyTransport::Create(fabric_.CreateTransport("x").value(), plan).status().code(),
            absl::StatusCode::kInvalidArgument);
  plan = FaultPlan();
  plan.max_delay = absl::Milliseconds(-1);
  EXPECT_EQ(FaultyTransport::Create(fabric_.CreateTransport("y").value(), plan).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FaultyTransport::Create(nullptr, FaultPlan()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(FaultyTransportTest, FailEveryNthPostAndAfterN) {
  FaultPlan plan;
  plan.fail_post.every_nth = 2;
  Start(plan, {});
  EXPECT_TRUE(Write("a").ok());
  auto second = Write("b");
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("injected"));
  EXPECT_TRUE(Write("c").ok());
  EXPECT_EQ(sender_->counts().failed_posts, 1);
  EXPECT_EQ(Receive(5), (std::vector<std::string>{"a", "c"}));

  plan = FaultPlan();
  plan.fail_posts_after = 4;  // 3 posts so far: one more succeeds, then none
  ASSERT_TRUE(sender_->SetPlan(plan).ok());
  EXPECT_TRUE(Write("d").ok());
  EXPECT_FALSE(Write("e").ok());
  EXPECT_FALSE(sender_->PostNotification(peer_, "f").ok());
  EXPECT_EQ(sender_->counts().failed_posts, 3);
}

TEST_F(FaultyTransportTest, FailedCompletionIsReportedByTest) {
  FaultPlan plan;
  plan.fail_completion = Always();
  Start(plan, {});
  auto id = Write("n");
  ASSERT_TRUE(id.ok());
  EXPECT_FALSE(Wait(*id).ok());
  EXPECT_EQ(sender_->counts().failed_completions, 1);
  sender_->Release(*id);
}

TEST_F(FaultyTransportTest, StalledCompletionEndsOnlyWhenCancelled) {
  FaultPlan plan;
  plan.stall_completion = Always();
  Start(plan, {});
  auto id = Write("n");
  ASSERT_TRUE(id.ok());
  // The data and the notice land; the sender is never told.
  EXPECT_EQ(Receive(10), std::vector<std::string>{"n"});
  EXPECT_EQ(std::memcmp(src_, dst_, kBytes), 0);
  EXPECT_EQ(sender_->Test(*id).value(), TransferState::kInProgress);
  EXPECT_EQ(WaitForTransfer(*sender_, *id, absl::Now() + absl::Milliseconds(20)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(sender_->Cancel(*id).ok());
  EXPECT_EQ(sender_->Test(*id).status().code(), absl::StatusCode::kCancelled);
  sender_->Release(*id);
  EXPECT_EQ(sender_->Test(*id).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(FaultyTransportTest, FlippedSourceByteLandsAndStaysFlipped) {
  FaultPlan plan;
  plan.flip_source_byte = Always();
  Start(plan, {});
  auto id = Write("n");
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(Wait(*id).value(), TransferState::kDone);
  int differ = 0;
  for (size_t i = 0; i < kBytes; ++i) differ += src_[i] != static_cast<uint8_t>(i);
  EXPECT_EQ(differ, 1);
  EXPECT_EQ(std::memcmp(src_, dst_, kBytes), 0);  // what was sent is the flipped source
  EXPECT_EQ(sender_->counts().flipped_source_bytes, 1);
}

TEST_F(FaultyTransportTest, FlipOutsideTheRegistrationNeverHappens) {
  FaultPlan plan;
  plan.flip_source_byte = Always();
  Start(plan, {});
  const Segment bad{kBytes - 4, 0, 8};  // past the source registration
  auto id = sender_->PostWrite(peer_, *src_reg_, *remote_, {&bad, 1}, "n");
  EXPECT_EQ(id.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(sender_->counts().flipped_source_bytes, 0);
  for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(src_[i], static_cast<uint8_t>(i));
}

TEST_F(FaultyTransportTest, TruncatedWriteLeavesTheTailUnwritten) {
  FaultPlan plan;
  plan.truncate_write = Always();
  Start(plan, {});
  auto id = Write("n");
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(Wait(*id).value(), TransferState::kDone);
  EXPECT_EQ(Receive(5), std::vector<std::string>{"n"});  // the notice still comes
  // A prefix landed and the rest did not: the last byte (255 in the source) is still 0.
  EXPECT_EQ(dst_[kBytes - 1], 0);
  size_t landed = 0;
  while (landed < kBytes && dst_[landed] == src_[landed]) ++landed;
  for (size_t i = landed; i < kBytes; ++i) EXPECT_EQ(dst_[i], 0) << i;
  EXPECT_EQ(sender_->counts().truncated_writes, 1);
}

TEST_F(FaultyTransportTest, DroppedNotificationsDataStillLands) {
  FaultPlan plan;
  plan.drop_notification.every_nth = 2;
  Start({}, plan);
  for (const char* n : {"a", "b", "c", "d"}) ASSERT_TRUE(Write(n).ok());
  EXPECT_EQ(Receive(10), (std::vector<std::string>{"a", "c"}));
  EXPECT_EQ(std::memcmp(src_, dst_, kBytes), 0);
  EXPECT_EQ(receiver_->counts().dropped_notifications, 2);
  EXPECT_EQ(receiver_->counts().notifications, 4);
}

TEST_F(FaultyTransportTest, TruncatedAndFlippedNotifications) {
  FaultPlan plan;
  plan.truncate_notification = Always();
  Start({}, plan);
  ASSERT_TRUE(Write("0123456789").ok());
  std::vector<std::string> got = Receive(5);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_FALSE(got[0].empty());
  EXPECT_LT(got[0].size(), 10u);
  EXPECT_EQ(std::string("0123456789").substr(0, got[0].size()), got[0]);

  plan = FaultPlan();
  plan.flip_notification_byte = Always();
  ASSERT_TRUE(receiver_->SetPlan(plan).ok());
  ASSERT_TRUE(Write("0123456789").ok());
  got = Receive(5);
  ASSERT_EQ(got.size(), 1u);
  ASSERT_EQ(got[0].size(), 10u);
  int differ = 0;
  for (size_t i = 0; i < 10; ++i) differ += got[0][i] != "0123456789"[i];
  EXPECT_EQ(differ, 1);
  EXPECT_EQ(receiver_->counts().truncated_notifications, 1);
  EXPECT_EQ(receiver_->counts().flipped_notification_bytes, 1);
}

TEST_F(FaultyTransportTest, DuplicatedNotificationsComeTwice) {
  FaultPlan plan;
  plan.duplicate_notification = Always();
  plan.duplicate_notification.max_strikes = 1;
  Start({}, plan);
  ASSERT_TRUE(Write("a").ok());
  ASSERT_TRUE(Write("b").ok());
  EXPECT_EQ(Receive(10), (std::vector<std::string>{"a", "a", "b"}));
  EXPECT_EQ(receiver_->counts().duplicated_notifications, 1);
}

TEST_F(FaultyTransportTest, DelayedNotificationsComeLaterAndAllCome) {
  FaultPlan plan;
  plan.delay_notification.every_nth = 1;
  plan.delay_notification.max_strikes = 1;
  plan.max_delay = absl::Milliseconds(30);
  Start({}, plan);
  ASSERT_TRUE(Write("a").ok());
  ASSERT_TRUE(Write("b").ok());
  std::vector<std::string> got = Receive(100);
  EXPECT_EQ(got, (std::vector<std::string>{"b", "a"}));
  EXPECT_EQ(receiver_->held_notifications(), 0u);
  EXPECT_EQ(receiver_->counts().delayed_notifications, 1);
}

TEST_F(FaultyTransportTest, ReorderedNotificationGoesAfterALaterOne) {
  FaultPlan plan;
  plan.reorder_notification.every_nth = 1;
  plan.reorder_notification.max_strikes = 1;
  plan.max_hold = absl::Seconds(10);  // released by overtaking, not by time
  Start({}, plan);
  ASSERT_TRUE(Write("a").ok());
  std::vector<std::string> got = Receive(10);
  EXPECT_TRUE(got.empty());
  EXPECT_EQ(receiver_->held_notifications(), 1u);
  ASSERT_TRUE(Write("b").ok());
  got = Receive(10);
  EXPECT_EQ(got, (std::vector<std::string>{"b", "a"}));
  EXPECT_EQ(receiver_->held_notifications(), 0u);
  EXPECT_EQ(receiver_->counts().reordered_notifications, 1);
}

TEST_F(FaultyTransportTest, ReorderedNotificationIsReleasedAfterMaxHold) {
  FaultPlan plan;
  plan.reorder_notification = Always();
  plan.max_hold = absl::Milliseconds(10);
  Start({}, plan);
  ASSERT_TRUE(Write("only").ok());
  EXPECT_EQ(Receive(60), std::vector<std::string>{"only"});
}

TEST_F(FaultyTransportTest, HeldNotificationsComeInOrderWhenReleased) {
  Start({}, {});
  receiver_->HoldNotifications(true);
  ASSERT_TRUE(Write("a").ok());
  ASSERT_TRUE(Write("b").ok());
  EXPECT_TRUE(Receive(10).empty());
  EXPECT_EQ(std::memcmp(src_, dst_, kBytes), 0);  // the data landed all the same
  EXPECT_EQ(receiver_->held_notifications(), 2u);
  receiver_->HoldNotifications(false);
  ASSERT_TRUE(Write("c").ok());
  EXPECT_EQ(Receive(10), (std::vector<std::string>{"c", "a", "b"}));
  EXPECT_EQ(receiver_->held_notifications(), 0u);
}

TEST_F(FaultyTransportTest, HeldWritesWaitAndCannotBeCancelledUntilReleased) {
  Start({}, {});
  sender_->HoldWrites(true);
  auto id = Write("late");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_TRUE(Receive(10).empty());
  EXPECT_TRUE(sender_->Cancel(*id).ok());
  EXPECT_TRUE(Receive(10).empty());
  EXPECT_EQ(*sender_->Test(*id), TransferState::kInProgress);
  uint8_t zeros[kBytes] = {};
  EXPECT_EQ(std::memcmp(dst_, zeros, kBytes), 0) << "a held write landed";
  sender_->HoldWrites(false);
  EXPECT_EQ(Receive(10), std::vector<std::string>{"late"});
  EXPECT_EQ(std::memcmp(src_, dst_, kBytes), 0) << "the write cancelled while held was lost";
  auto state = Wait(*id);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(*state, TransferState::kDone);
}

// As a socket takes a send: done at once for the sender, delivered only when released, and
// a Release in between does not drop it.
TEST_F(FaultyTransportTest, WritesHeldAsDoneAreDeliveredOnlyWhenReleased) {
  FaultPlan plan;
  plan.completion_before_delivery = true;
  Start({}, plan);
  EXPECT_TRUE(fabric_.CreateTransport("plain").value()->capabilities().delivered_at_completion);
  EXPECT_FALSE(receiver_->capabilities().delivered_at_completion);
  EXPECT_TRUE(sender_->capabilities().delivered_at_completion);
  sender_->HoldWrites(true, /*report_done=*/true);
  auto id = Write("in the socket");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*sender_->Test(*id), TransferState::kDone);
  sender_->Release(*id);
  EXPECT_TRUE(Receive(10).empty());
  uint8_t zeros[kBytes] = {};
  EXPECT_EQ(std::memcmp(dst_, zeros, kBytes), 0) << "a held write landed";
  sender_->HoldWrites(false);
  EXPECT_EQ(std::memcmp(src_, dst_, kBytes), 0) << "the held write was lost";
  EXPECT_EQ(Receive(10), std::vector<std::string>{"in the socket"});
  EXPECT_EQ(sender_->Test(*id).status().code(), absl::StatusCode::kNotFound) << "not released";
}

TEST(FaultCountsTest, SumsAndPrints) {
  FaultCounts a;
  a.posts = 3;
  a.dropped_notifications = 2;
  FaultCounts b;
  b.posts = 1;
  b.flipped_source_bytes = 1;
  a += b;
  EXPECT_EQ(a.posts, 4);
  EXPECT_EQ(a.injected(), 3);
  EXPECT_EQ(a.ToString(),
            "posts=4 notifications=0 flipped_source_bytes=1 dropped_notifications=2");
}

}  // namespace
}  // namespace kvstream
