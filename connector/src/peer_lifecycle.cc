// PeerLifecycle (peer_lifecycle.h).
#include "peer_lifecycle.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvstream {
namespace internal {

absl::string_view PeerStateName(PeerState state) {
  switch (state) {
    case PeerState::kNew:
      return "new";
    case PeerState::kConnecting:
      return "connecting";
    case PeerState::kUp:
      return "up";
    case PeerState::kDown:
      return "down";
  }
  return "?";
}

absl::StatusOr<PeerLifecycle::Action> PeerLifecycle::Admit(absl::Time now) {
  switch (state_) {
    case PeerState::kUp:
      return Action::kUseLink;
    case PeerState::kConnecting:
      return absl::FailedPreconditionError(absl::StrCat(
          "producer ", absl::CHexEscape(address_), ": a connection attempt is in progress"));
    case PeerState::kDown:
      if (now < retry_at_) {
        return absl::UnavailableError(absl::StrFormat(
            "producer %s is down (for %.2f s: %s); next connection attempt in %.2f s",
            absl::CHexEscape(address_), absl::ToDoubleSeconds(now - down_since_),
            last_error_.message(), absl::ToDoubleSeconds(retry_at_ - now)));
      }
      state_ = PeerState::kConnecting;
      return Action::kConnect;
    case PeerState::kNew:
      state_ = PeerState::kConnecting;
      return Action::kConnect;
  }
  return absl::InternalError("PeerLifecycle: unknown state");
}

void PeerLifecycle::Connected(absl::Time /*now*/) {
  if (state_ != PeerState::kConnecting) return;
  state_ = PeerState::kUp;
  backoff_ = policy_.initial;
  down_since_ = absl::InfinitePast();
  ++times_up_;
}

void PeerLifecycle::Failed(absl::Time now, absl::Status why) {
  if (state_ != PeerState::kConnecting) return;
  const absl::Duration wait = backoff_;
  backoff_ = std::min(policy_.max, backoff_ * 2);
  GoDown(now, std::move(why), wait);
}

void PeerLifecycle::Lost(absl::Time now, absl::Status why) {
  if (state_ != PeerState::kUp) return;
  GoDown(now, std::move(why), policy_.initial);
  backoff_ = std::min(policy_.max, policy_.initial * 2);
}

void PeerLifecycle::GoDown(absl::Time now, absl::Status why, absl::Duration wait) {
  // A run of failed attempts keeps the time the peer first went down.
  if (down_since_ == absl::InfinitePast()) down_since_ = now;
  state_ = PeerState::kDown;
  retry_at_ = now + wait;
  last_error_ = std::move(why);
}

}  // namespace internal
}  // namespace kvstream
