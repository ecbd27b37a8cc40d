// The life of one link's NCCL communicator, as a state machine with no NCCL in it (private to
// transfer/; tested without a GPU). The transport makes the NCCL calls and tells this object
// what they returned; it answers what the transport must do next. Each link (one direction
// of one peer pair, nccl_transport.h) has one.
//
//   kUnjoined --init called--> kJoining --async state done--> kReady
//   kJoining --init done at once--> kReady
//   kReady --group end in progress--> kIssuing --async state done--> kReady (kIssued)
//   any live phase --NCCL error, deadline, Fail()--> kFailed   (terminal; abort)
//   any live phase --Close()--> kClosed                         (terminal; abort if joined)
//
// Communicators are non-blocking (ncclConfig_t::blocking = 0): init, and a group whose
// kernels NCCL still has to enqueue (the first operations between two ranks connect them),
// return ncclInProgress, and the state is polled with ncclCommGetAsyncError from Progress.
// While kIssuing nothing may be enqueued after the group (its kernels are not on the stream
// yet), so no event is recorded and no other group issued until kIssued.
//
// Deadlines, so that nothing hangs: joining must finish within join_timeout of the init
// call; an issued batch must complete within op_timeout of its issue (the transport says
// when its oldest unfinished batch was issued). Passing either is kAbort with
// DeadlineExceeded. The first failure is kept (status()); later ones change nothing.
//
// Thread-compatible: the transport calls it under its lock.
#ifndef KVSTREAM_TRANSFER_SRC_NCCL_NCCL_COMM_STATE_H_
#define KVSTREAM_TRANSFER_SRC_NCCL_NCCL_COMM_STATE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvstream {
namespace internal {

enum class CommPhase { kUnjoined, kJoining, kReady, kIssuing, kFailed, kClosed };
const char* CommPhaseName(CommPhase phase);

// What an NCCL call, or a communicator's asynchronous state, said: done, still in progress,
// or failed with `error` (already converted by NcclResultToStatus).
struct NcclPoll {
  bool in_progress = false;
  absl::Status error;

  static NcclPoll Done() { return NcclPoll{}; }
  static NcclPoll InProgress() { return NcclPoll{true, absl::OkStatus()}; }
  static NcclPoll Failed(absl::Status error) { return NcclPoll{false, std::move(error)}; }
};

enum class CommAction {
  kNone,    // nothing for the transport to do
  kJoined,  // the communicator became usable: queued batches may be issued
  kIssued,  // the group being issued is on its streams now: record what follows it
  kAbort,   // ncclCommAbort the communicator (never waits for the peer); the link is over
};

class NcclCommState {
 public:
  // `label` names the link in messages ("nccl peer 2 (uid ..., pid ...) send link").
  NcclCommState(std::string label, absl::Duration join_timeout, absl::Duration op_timeout);

  CommPhase phase() const { return phase_; }
  // OK unless kFailed; then why.
  const absl::Status& status() const { return status_; }
  // Whether a communicator exists (init was called and the link did not end yet).
  bool has_comm() const;
  bool ready() const { return phase_ == CommPhase::kReady; }
  bool terminal() const { return phase_ == CommPhase::kFailed || phase_ == CommPhase::kClosed; }

  // ncclCommInitRankConfig returned `poll` at `now`. REQUIRES kUnjoined (otherwise
  // FailedPrecondition through Fail: kAbort). Done: kJoined; in progress: kNone; failed:
  // kAbort.
  CommAction OnInitCalled(const NcclPoll& poll, absl::Time now);
  // ncclCommGetAsyncError said `poll`. kJoining/kIssuing and done: kJoined/kIssued. An
  // error in any live phase: kAbort. In progress in kReady (never expected): kNone.
  CommAction OnAsyncState(const NcclPoll& poll, absl::Time now);
  // ncclGroupEnd returned `poll`. REQUIRES kReady (otherwise kAbort). Done: kIssued;
  // in progress: kNone (now kIssuing); failed: kAbort.
  CommAction OnGroupEnd(const NcclPoll& poll, absl::Time now);
  // The watchdog: `oldest_issue` is when the oldest issued batch that has not completed was
  // issued (InfiniteFuture() when none). kAbort past a deadline; else kNone.
  CommAction CheckDeadlines(absl::Time oldest_issue, absl::Time now);
  // A failure seen outside NCCL (the side connection broke, the peer refused us or sent a
  // malformed frame, a CUDA error): kFailed with `cause` (first failure wins). kAbort when a
  // communicator exists, else kNone; kNone when already terminal.
  CommAction Fail(const absl::Status& cause);
  // Orderly end (Disconnect, the peer's goodbye, destruction): kClosed. kAbort when a
  // communicator exists, else kNone; kNone when already terminal.
  CommAction Close();

 private:
  CommAction FailWith(absl::Status status);

  const std::string label_;
  const absl::Duration join_timeout_;
  const absl::Duration op_timeout_;
  CommPhase phase_ = CommPhase::kUnjoined;
  bool comm_ = false;  // init was called
  absl::Time join_deadline_ = absl::InfiniteFuture();
  absl::Status status_;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_NCCL_NCCL_COMM_STATE_H_
