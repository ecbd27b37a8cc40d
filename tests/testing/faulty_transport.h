// FaultyTransport: a Transport wrapper (transport_wrapper.h) that injects the faults a real
// link or a buggy peer produces, following a seeded FaultPlan, so that tests of the layers
// above (the connector) can check that no fault leads to a hang, a leaked block or a wrong
// token. The wrapped transport carries no test hooks: every fault is made here, from the
// outside of the Transport interface, as LevelDB's fault-injection Env wraps an Env.
//
//   LoopbackFabric fabric;
//   FaultPlan plan;
//   plan.seed = 7;
//   plan.drop_notification.probability = 0.1;
//   plan.flip_source_byte.every_nth = 5;
//   ASSIGN_OR_RETURN(auto faulty,
//                    FaultyTransport::Create(fabric.CreateTransport("p").value(), plan));
//   FaultyTransport* faults = faulty.get();      // the connector takes ownership
//   ... CreateKvConnectorWorker(config, std::move(faulty)) ...
//   LOG(INFO) << faults->counts().ToString();    // what was injected
//
// Where each fault is injected. A fault that changes what the RECEIVER of a notification
// sees is made on the receiving side, in PollNotifications: the wrapped transport delivered
// the notification after its data (transport.h's ordering), and the fault then acts on that
// delivery, so the data has landed whatever happens to the notice. A fault that changes what
// is SENT, or what the sender is told, is made on the sending side:
//
//   fault                   side / call          effect
//   fail_post               sender / PostWrite,  returns Unavailable; nothing is posted
//                           PostNotification
//   fail_posts_after        sender / the same    every post after the first N fails so (a
//                                                link that died)
//   fail_completion         sender / PostWrite,  posted, then cancelled at once in the wrapped
//                           Test                 transport (which may already have moved it:
//                                                its data and notification may or may not
//                                                land); once it ended, Test reports Internal
//   stall_completion        sender / Test        posted normally, but Test reports kInProgress
//                                                until the transfer is cancelled (then
//                                                Cancelled), as a link that stopped completing
//   flip_source_byte        sender / PostWrite   XORs one byte of the local source inside a
//                                                posted segment just before posting (after any
//                                                checksum the caller computed); the byte stays
//                                                flipped, as after a memory fault
//   truncate_write          sender / PostWrite   cuts 1..all bytes off the end of the batch;
//                                                the notification still goes
//   drop_notification       receiver / Poll      never delivered
//   truncate_notification   receiver / Poll      a non-empty prefix is delivered
//   flip_notification_byte  receiver / Poll      one byte XORed
//   duplicate_notification  receiver / Poll      delivered twice
//   delay_notification      receiver / Poll      held for up to max_delay, then delivered by
//                                                the first PollNotifications after that
//   reorder_notification    receiver / Poll      held until a notification received after it
//                                                was delivered (or max_hold passed), then
//                                                delivered after it
//   HoldNotifications()     receiver / Poll      every notification held until released (for
//                                                a fault placed at a chosen moment)
//   HoldWrites()            sender / Progress,   the wrapped transport is not progressed and
//                           Cancel, Test,        cancellations are not passed on until
//                           Release              released: what was posted waits, as writes in
//                                                the socket of a cut link, and still goes
//                                                once released (for a transport that moves
//                                                data only in Progress, as the loopback);
//                                                with report_done, Test says kDone at once, as
//                                                for sends a socket took
//   completion_before_delivery  either / capabilities  delivered_at_completion is false, as
//                                                for UCX over TCP
//
// Drop, truncate and flip act on a notification as received; delay and reorder then act on
// each copy a duplicate makes (so a duplicate may come late). flip_source_byte acts only on
// host memory (a device byte cannot be written from here) and only inside segments that fit
// the local registration, so a batch the wrapped transport refuses is never a stray write.
//
// Determinism: decisions come from one generator seeded by FaultPlan::seed, drawn in the
// order the calls reach the wrapper; with several threads calling (the connector's progress
// thread and the engine's), that order and so the outcome of a probability may vary between
// runs. "every_nth" faults strike at fixed counts of the calls they apply to.
//
// Thread safety: thread-safe (one internal mutex, never held while calling the wrapped
// transport). Ownership: owns the wrapped transport.
#ifndef KVSTREAM_TESTS_TESTING_FAULTY_TRANSPORT_H_
#define KVSTREAM_TESTS_TESTING_FAULTY_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvstream/transfer/transport.h"
#include "tests/testing/transport_wrapper.h"

namespace kvstream {

// How often one kind of fault strikes, counted over the calls (or notifications) it applies
// to: with `probability` each time, and on every `every_nth`-th one (every_nth = 3: the 3rd,
// 6th, ...), at most `max_strikes` times in all. Defaults: never.
struct FaultRate {
  double probability = 0;    // in [0, 1]
  int64_t every_nth = 0;     // 0: off
  int64_t max_strikes = -1;  // < 0: no limit
};

// The faults to inject (the table in the file comment says where and how).
struct FaultPlan {
  uint64_t seed = 1;
  // Sender side.
  FaultRate fail_post;
  int64_t fail_posts_after = -1;  // >= 0: posts after the first this many all fail
  FaultRate fail_completion;
  FaultRate stall_completion;
  FaultRate flip_source_byte;
  FaultRate truncate_write;
  // Receiver side.
  FaultRate drop_notification;
  FaultRate truncate_notification;
  FaultRate flip_notification_byte;
  FaultRate duplicate_notification;
  FaultRate delay_notification;
  absl::Duration max_delay = absl::Milliseconds(20);
  FaultRate reorder_notification;
  absl::Duration max_hold = absl::Milliseconds(5);
  // capabilities().delivered_at_completion reports false (see HoldWrites' report_done).
  bool completion_before_delivery = false;
};

// What a FaultyTransport saw and injected.
struct FaultCounts {
  int64_t posts = 0;          // PostWrite and PostNotification calls
  int64_t notifications = 0;  // notifications the wrapped transport delivered
  int64_t failed_posts = 0;   // fail_post and fail_posts_after
  int64_t failed_completions = 0;
  int64_t stalled_completions = 0;
  int64_t flipped_source_bytes = 0;
  int64_t truncated_writes = 0;
  int64_t dropped_notifications = 0;
  int64_t truncated_notifications = 0;
  int64_t flipped_notification_bytes = 0;
  int64_t duplicated_notifications = 0;
  int64_t delayed_notifications = 0;
  int64_t reordered_notifications = 0;

  // Faults injected, of every kind.
  int64_t injected() const;
  FaultCounts& operator+=(const FaultCounts& other);
  // "posts=12 notifications=9 failed_posts=1 ..." (the counts that are not zero).
  std::string ToString() const;
};

class FaultyTransport final : public TransportWrapper {
 public:
  // InvalidArgument for a null transport, a probability outside [0, 1], a negative every_nth
  // or a negative duration.
  static absl::StatusOr<std::unique_ptr<FaultyTransport>> Create(
      std::unique_ptr<Transport> target, const FaultPlan& plan);

  // Replaces the plan (the generator is reseeded from it; counts and notifications already
  // held are kept). InvalidArgument as Create, leaving the plan unchanged.
  absl::Status SetPlan(const FaultPlan& plan);

  // Receiver side, for tests that place a fault at a chosen moment: while held, every
  // notification received is kept back (counted as delayed); HoldNotifications(false)
  // delivers those kept, in arrival order, with the next PollNotifications.
  void HoldNotifications(bool hold);
  // Sender side: while held, Progress does not progress the wrapped transport and Cancel is
  // answered OK without reaching it, so what was posted cannot be taken back; it stays in
  // progress, or with `report_done` Test reports what is posted from now on kDone at once
  // (and its Release waits for the release of the hold). HoldWrites(false) progresses the
  // wrapped transport, which delivers it all, cancelled or not, then passes those Releases
  // on.
  void HoldWrites(bool hold, bool report_done = false);

  FaultCounts counts() const;
  // Notifications held back by delay_notification or reorder_notification, not yet delivered.
  size_t held_notifications() const;

  TransportCapabilities capabilities() const override;
  using Transport::PostWrite;
  absl::StatusOr<TransferId> PostWrite(PeerId peer, const MemoryRegistration& local,
                                       const RemoteMemory& remote,
                                       absl::Span<const Segment> segments,
                                       absl::string_view notification,
                                       const WriteOrder& order) override;
  absl::StatusOr<TransferId> PostNotification(PeerId peer, absl::string_view payload) override;
  absl::StatusOr<TransferState> Test(TransferId id) override;
  absl::Status Cancel(TransferId id) override;
  void Release(TransferId id) override;
  absl::Status Progress() override;
  std::vector<Notification> PollNotifications() override;

 private:
  enum Kind : int;
  struct Held {
    Notification notification;
    uint64_t seq = 0;  // reorder: released once a later one went out
    absl::Time due;    // delivered by the first poll at or after this time
    bool reorder = false;
    bool paused = false;  // kept by HoldNotifications
  };

  FaultyTransport(std::unique_ptr<Transport> target, const FaultPlan& plan);

  bool Strike(Kind kind) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Uniform in [lo, hi].
  uint64_t Uniform(uint64_t lo, uint64_t hi) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether this post fails at once (fail_post, fail_posts_after).
  bool FailThisPost() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a post: the transfer's completion faults (fail_completion, stall_completion).
  void AfterPost(const absl::StatusOr<TransferId>& id, bool fail, bool stall);
  // One received notification (or a duplicate's copy): out now, or held.
  void Route(Notification n, uint64_t seq, absl::Time now, std::vector<Notification>& out,
             uint64_t& newest_out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  FaultPlan plan_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  FaultCounts counts_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> seen_ ABSL_GUARDED_BY(mu_);  // by Kind: calls each fault applied to
  std::set<TransferId> failing_ ABSL_GUARDED_BY(mu_);  // fail_completion's transfers
  std::set<TransferId> stalled_ ABSL_GUARDED_BY(mu_);  // stall_completion's, until cancelled
  std::set<TransferId> cancelled_ ABSL_GUARDED_BY(mu_);  // stalled ones cancelled since
  std::vector<Held> held_ ABSL_GUARDED_BY(mu_);
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  bool hold_all_ ABSL_GUARDED_BY(mu_) = false;
  bool hold_writes_ ABSL_GUARDED_BY(mu_) = false;
  bool held_done_ ABSL_GUARDED_BY(mu_) = false;  // HoldWrites' report_done
  std::set<TransferId> held_done_ids_ ABSL_GUARDED_BY(mu_);  // posted while so held
  std::vector<TransferId> deferred_releases_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvstream

#endif  // KVSTREAM_TESTS_TESTING_FAULTY_TRANSPORT_H_
