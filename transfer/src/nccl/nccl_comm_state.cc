// A link's communicator state machine (nccl_comm_state.h).
#include "nccl/nccl_comm_state.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvstream {
namespace internal {

const char* CommPhaseName(CommPhase phase) {
  switch (phase) {
    case CommPhase::kUnjoined: return "unjoined";
    case CommPhase::kJoining: return "joining";
    case CommPhase::kReady: return "ready";
    case CommPhase::kIssuing: return "issuing";
    case CommPhase::kFailed: return "failed";
    case CommPhase::kClosed: return "closed";
  }
  return "unknown";
}

NcclCommState::NcclCommState(std::string label, absl::Duration join_timeout,
                             absl::Duration op_timeout)
    : label_(std::move(label)), join_timeout_(join_timeout), op_timeout_(op_timeout) {}

bool NcclCommState::has_comm() const { return comm_ && !terminal(); }

CommAction NcclCommState::FailWith(absl::Status status) {
  if (terminal()) return CommAction::kNone;
  const bool abort = comm_;
  phase_ = CommPhase::kFailed;
  status_ = absl::Status(status.code(), absl::StrCat(label_, " failed: ", status.message()));
  return abort ? CommAction::kAbort : CommAction::kNone;
}

CommAction NcclCommState::OnInitCalled(const NcclPoll& poll, absl::Time now) {
  if (phase_ != CommPhase::kUnjoined) {
    if (terminal()) return CommAction::kNone;
    return FailWith(absl::FailedPreconditionError(
        absl::StrCat("a second communicator init while ", CommPhaseName(phase_))));
  }
  comm_ = true;
  if (!poll.error.ok()) return FailWith(poll.error);
  if (poll.in_progress) {
    phase_ = CommPhase::kJoining;
    join_deadline_ = now + join_timeout_;
    return CommAction::kNone;
  }
  phase_ = CommPhase::kReady;
  return CommAction::kJoined;
}

CommAction NcclCommState::OnAsyncState(const NcclPoll& poll, absl::Time now) {
  if (terminal() || phase_ == CommPhase::kUnjoined) return CommAction::kNone;
  if (!poll.error.ok()) return FailWith(poll.error);
  if (poll.in_progress) return CheckDeadlines(absl::InfiniteFuture(), now);
  switch (phase_) {
    case CommPhase::kJoining:
      phase_ = CommPhase::kReady;
      return CommAction::kJoined;
    case CommPhase::kIssuing:
      phase_ = CommPhase::kReady;
      return CommAction::kIssued;
    default:
      return CommAction::kNone;
  }
}

CommAction NcclCommState::OnGroupEnd(const NcclPoll& poll, absl::Time now) {
  if (terminal()) return CommAction::kNone;
  if (phase_ != CommPhase::kReady) {
    return FailWith(absl::FailedPreconditionError(
        absl::StrCat("a group issued while ", CommPhaseName(phase_))));
  }
  if (!poll.error.ok()) return FailWith(poll.error);
  if (poll.in_progress) {
    phase_ = CommPhase::kIssuing;
    return CommAction::kNone;
  }
  return CommAction::kIssued;
}

CommAction NcclCommState::CheckDeadlines(absl::Time oldest_issue, absl::Time now) {
  if (terminal()) return CommAction::kNone;
  if (phase_ == CommPhase::kJoining && now >= join_deadline_) {
    return FailWith(absl::DeadlineExceededError(absl::StrCat(
        "the communicator was not up ", absl::FormatDuration(join_timeout_),
        " after its init (the peer never joined: it is gone, of another job, or cannot reach "
        "this host)")));
  }
  if (oldest_issue != absl::InfiniteFuture() && now - oldest_issue >= op_timeout_) {
    return FailWith(absl::DeadlineExceededError(absl::StrCat(
        "a batch issued ", absl::FormatDuration(now - oldest_issue),
        " ago has not completed (op_timeout ", absl::FormatDuration(op_timeout_),
        "): the peer stopped receiving")));
  }
  return CommAction::kNone;
}

CommAction NcclCommState::Fail(const absl::Status& cause) {
  return FailWith(cause.ok() ? absl::InternalError("failed without a cause") : cause);
}

CommAction NcclCommState::Close() {
  if (terminal()) return CommAction::kNone;
  const bool abort = comm_;
  phase_ = CommPhase::kClosed;
  return abort ? CommAction::kAbort : CommAction::kNone;
}

}  // namespace internal
}  // namespace kvstream
