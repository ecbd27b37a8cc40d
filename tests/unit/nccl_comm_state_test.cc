// Tests of a link's communicator state machine (transfer/src/nccl/nccl_comm_state.h), which
// holds every decision about an NCCL communicator that needs no GPU: joining (at once or in
// the background), issuing groups (at once or in the background, with nothing recorded in
// between), errors from NCCL or from outside, the join and operation deadlines, the first
// failure kept, orderly close, and which of these need ncclCommAbort.
#include "transfer/src/nccl/nccl_comm_state.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvstream {
namespace internal {
namespace {

using ::testing::HasSubstr;

const absl::Time kT0 = absl::FromUnixSeconds(1000);

NcclCommState NewState() {
  return NcclCommState("send link", absl::Seconds(30), absl::Seconds(10));
}

NcclPoll Remote() { return NcclPoll::Failed(absl::UnavailableError("NCCL remote error [6]")); }

TEST(NcclCommStateTest, JoinsInTheBackgroundThenIssuesAtOnce) {
  NcclCommState s = NewState();
  EXPECT_EQ(s.phase(), CommPhase::kUnjoined);
  EXPECT_FALSE(s.has_comm());
  EXPECT_EQ(s.OnInitCalled(NcclPoll::InProgress(), kT0), CommAction::kNone);
  EXPECT_EQ(s.phase(), CommPhase::kJoining);
  EXPECT_TRUE(s.has_comm());
  EXPECT_FALSE(s.ready());
  EXPECT_EQ(s.OnAsyncState(NcclPoll::InProgress(), kT0 + absl::Seconds(1)), CommAction::kNone);
  EXPECT_EQ(s.OnAsyncState(NcclPoll::Done(), kT0 + absl::Seconds(2)), CommAction::kJoined);
  EXPECT_TRUE(s.ready());
  EXPECT_EQ(s.OnGroupEnd(NcclPoll::Done(), kT0), CommAction::kIssued);
  EXPECT_TRUE(s.ready());
  EXPECT_TRUE(s.status().ok());
}

TEST(NcclCommStateTest, AnInitThatIsDoneAtOnceIsJoined) {
  NcclCommState s = NewState();
  EXPECT_EQ(s.OnInitCalled(NcclPoll::Done(), kT0), CommAction::kJoined);
  EXPECT_TRUE(s.ready());
}

TEST(NcclCommStateTest, AGroupInTheBackgroundBlocksTheNextUntilIssued) {
  NcclCommState s = NewState();
  s.OnInitCalled(NcclPoll::Done(), kT0);
  EXPECT_EQ(s.OnGroupEnd(NcclPoll::InProgress(), kT0), CommAction::kNone);
  EXPECT_EQ(s.phase(), CommPhase::kIssuing);
  EXPECT_FALSE(s.ready());  // nothing may follow the group on its stream yet
  EXPECT_EQ(s.OnAsyncState(NcclPoll::InProgress(), kT0), CommAction::kNone);
  EXPECT_EQ(s.OnAsyncState(NcclPoll::Done(), kT0), CommAction::kIssued);
  EXPECT_TRUE(s.ready());
  // Polling a ready communicator that is fine changes nothing.
  EXPECT_EQ(s.OnAsyncState(NcclPoll::Done(), kT0), CommAction::kNone);
}

TEST(NcclCommStateTest, IssuingWhileNotReadyIsAFailure) {
  NcclCommState joining = NewState();
  joining.OnInitCalled(NcclPoll::InProgress(), kT0);
  EXPECT_EQ(joining.OnGroupEnd(NcclPoll::Done(), kT0), CommAction::kAbort);
  EXPECT_EQ(joining.status().code(), absl::StatusCode::kFailedPrecondition);
  NcclCommState twice = NewState();
  twice.OnInitCalled(NcclPoll::Done(), kT0);
  EXPECT_EQ(twice.OnInitCalled(NcclPoll::Done(), kT0), CommAction::kAbort);
}

TEST(NcclCommStateTest, NcclErrorsAbortInEveryLivePhase) {
  for (int phase = 0; phase < 3; ++phase) {
    NcclCommState s = NewState();
    s.OnInitCalled(phase == 0 ? NcclPoll::InProgress() : NcclPoll::Done(), kT0);
    if (phase == 2) s.OnGroupEnd(NcclPoll::InProgress(), kT0);
    EXPECT_EQ(s.OnAsyncState(Remote(), kT0), CommAction::kAbort) << phase;
    EXPECT_EQ(s.phase(), CommPhase::kFailed);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(s.status().message(), HasSubstr("send link failed: NCCL remote error"));
    EXPECT_FALSE(s.has_comm());  // aborted: nothing left to abort or destroy
  }
  NcclCommState init_failed = NewState();
  EXPECT_EQ(init_failed.OnInitCalled(Remote(), kT0), CommAction::kAbort);
  NcclCommState group_failed = NewState();
  group_failed.OnInitCalled(NcclPoll::Done(), kT0);
  EXPECT_EQ(group_failed.OnGroupEnd(Remote(), kT0), CommAction::kAbort);
}

TEST(NcclCommStateTest, ThePeerThatNeverJoinsMissesTheJoinDeadline) {
  NcclCommState s = NewState();
  s.OnInitCalled(NcclPoll::InProgress(), kT0);
  EXPECT_EQ(s.CheckDeadlines(absl::InfiniteFuture(), kT0 + absl::Seconds(29)), CommAction::kNone);
  EXPECT_EQ(s.OnAsyncState(NcclPoll::InProgress(), kT0 + absl::Seconds(30)), CommAction::kAbort);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.status().message(), HasSubstr("never joined"));
}

TEST(NcclCommStateTest, ABatchThatDoesNotCompleteMissesTheOperationDeadline) {
  NcclCommState s = NewState();
  s.OnInitCalled(NcclPoll::Done(), kT0);
  const absl::Time issued = kT0 + absl::Seconds(5);
  EXPECT_EQ(s.CheckDeadlines(issued, issued + absl::Seconds(9)), CommAction::kNone);
  EXPECT_EQ(s.CheckDeadlines(absl::InfiniteFuture(), issued + absl::Hours(1)), CommAction::kNone);
  EXPECT_EQ(s.CheckDeadlines(issued, issued + absl::Seconds(10)), CommAction::kAbort);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.status().message(), HasSubstr("stopped receiving"));
}

TEST(NcclCommStateTest, TheFirstFailureIsKept) {
  NcclCommState s = NewState();
  s.OnInitCalled(NcclPoll::Done(), kT0);
  EXPECT_EQ(s.Fail(absl::UnavailableError("closed its side connection")), CommAction::kAbort);
  EXPECT_EQ(s.Fail(absl::InternalError("later")), CommAction::kNone);
  EXPECT_EQ(s.OnAsyncState(Remote(), kT0), CommAction::kNone);
  EXPECT_EQ(s.CheckDeadlines(kT0, kT0 + absl::Hours(1)), CommAction::kNone);
  EXPECT_EQ(s.Close(), CommAction::kNone);
  EXPECT_EQ(s.phase(), CommPhase::kFailed);
  EXPECT_THAT(s.status().message(), HasSubstr("closed its side connection"));
}

TEST(NcclCommStateTest, AFailureBeforeInitNeedsNoAbort) {
  NcclCommState s = NewState();
  EXPECT_EQ(s.Fail(absl::FailedPreconditionError("refused")), CommAction::kNone);
  EXPECT_EQ(s.phase(), CommPhase::kFailed);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(NcclCommStateTest, CloseAbortsAJoinedCommunicatorAndIsFinal) {
  NcclCommState s = NewState();
  s.OnInitCalled(NcclPoll::InProgress(), kT0);
  EXPECT_EQ(s.Close(), CommAction::kAbort);
  EXPECT_EQ(s.phase(), CommPhase::kClosed);
  EXPECT_TRUE(s.status().ok());
  EXPECT_TRUE(s.terminal());
  EXPECT_EQ(s.OnAsyncState(NcclPoll::Done(), kT0), CommAction::kNone);
  EXPECT_EQ(s.phase(), CommPhase::kClosed);
  NcclCommState unjoined = NewState();
  EXPECT_EQ(unjoined.Close(), CommAction::kNone);
}

TEST(NcclCommStateTest, PhasesHaveNames) {
  for (CommPhase p : {CommPhase::kUnjoined, CommPhase::kJoining, CommPhase::kReady,
                      CommPhase::kIssuing, CommPhase::kFailed, CommPhase::kClosed}) {
    EXPECT_STRNE(CommPhaseName(p), "unknown");
  }
}

}  // namespace
}  // namespace internal
}  // namespace kvstream
