// PeerLifecycle: whether a consumer may use, or try to reach, one producer, as a state
// machine with explicit times (no clock inside, so every transition can be tested).
//
//   kNew        --Admit-->                     kConnecting   (the first load to it)
//   kConnecting --Connected-->                 kUp           (connect and handshake done)
//   kConnecting --Failed-->                    kDown         (retry after the backoff)
//   kUp         --Lost-->                      kDown         (link closed, reset, or an abort
//                                                             it never confirmed)
//   kDown       --Admit at or after retry_at-> kConnecting   (one attempt per backoff)
//   kDown       --Admit before retry_at-->     kDown, and Admit returns Unavailable at once:
//                                              the producer's address, how long it has been
//                                              down, the error that took it down, and when
//                                              the next attempt may be made.
//
// Why: a producer that went away (crashed, restarted, its host cut off) must cost its
// consumers neither a connect attempt per request (which blocks the step for up to the
// handshake deadline when the host does not answer) nor a restart once it is back. The
// backoff starts at ReconnectPolicy::initial, doubles after each failed attempt up to
// ReconnectPolicy::max, and a successful handshake resets it; a link lost after being up
// may be retried after the initial backoff. A restarted producer at the same address is
// therefore used again by the first load after its retry time; one at a new address (a
// new port, published by the rendezvous) is a new peer, used at once.
//
// Thread safety: none; ProducerPeers holds one per producer under its mutex.
#ifndef KVSTREAM_CONNECTOR_SRC_PEER_LIFECYCLE_H_
#define KVSTREAM_CONNECTOR_SRC_PEER_LIFECYCLE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvstream {
namespace internal {

enum class PeerState { kNew, kConnecting, kUp, kDown };
absl::string_view PeerStateName(PeerState state);  // "new", "connecting", "up", "down"

struct ReconnectPolicy {
  absl::Duration initial = absl::Milliseconds(200);  // >= 0; 0: every load may try
  absl::Duration max = absl::Seconds(5);             // >= initial
};

class PeerLifecycle {
 public:
  // What a load to this peer does.
  enum class Action {
    kUseLink,  // kUp: hand off on the live link
    kConnect,  // now kConnecting: the caller connects, then calls Connected or Failed
  };

  // `address` names the peer in error messages.
  PeerLifecycle(std::string address, ReconnectPolicy policy)
      : address_(std::move(address)), policy_(policy), backoff_(policy.initial) {}

  // A load at `now` needs this peer (see the state diagram above). Unavailable while down
  // and before the retry time (the message says why and until when); FailedPrecondition
  // while another attempt is in progress (kConnecting).
  absl::StatusOr<Action> Admit(absl::Time now);

  // The attempt Admit started succeeded. REQUIRES: kConnecting.
  void Connected(absl::Time now);
  // The attempt Admit started failed with `why`. REQUIRES: kConnecting.
  void Failed(absl::Time now, absl::Status why);
  // The live link was lost with `why`. Ignored unless kUp.
  void Lost(absl::Time now, absl::Status why);

  PeerState state() const { return state_; }
  // Since when the peer is down (kDown: the first failure of a run of failures; InfinitePast
  // while it is not down).
  absl::Time down_since() const { return down_since_; }
  // When a load may next try to reach it (kDown).
  absl::Time retry_at() const { return retry_at_; }
  // The error that took it down last (OK unless it ever went down).
  const absl::Status& last_error() const { return last_error_; }
  // Successful handshakes so far: more than one means it was reconnected.
  int64_t times_up() const { return times_up_; }

 private:
  void GoDown(absl::Time now, absl::Status why, absl::Duration wait);

  const std::string address_;
  const ReconnectPolicy policy_;
  PeerState state_ = PeerState::kNew;
  absl::Duration backoff_;  // the wait after the next failed attempt
  absl::Time down_since_ = absl::InfinitePast();
  absl::Time retry_at_ = absl::InfinitePast();
  absl::Status last_error_;
  int64_t times_up_ = 0;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_SRC_PEER_LIFECYCLE_H_
