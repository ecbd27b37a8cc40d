// CudaEventClock (cuda_event_clock.h). Written against CudaEvent and CudaStream only, so it
// builds without CUDA too (where Create fails as CudaStream::Create does).
#include "kvstream/common/cuda_event_clock.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvstream/common/monotonic_clock.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {

// How long an anchor may take to complete on its idle stream before Record gives up.
constexpr uint64_t kAnchorTimeoutNs = 1'000'000'000;

absl::StatusOr<CudaEventClock> CudaEventClock::Create(absl::Duration max_anchor_age) {
  if (max_anchor_age <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("CudaEventClock: max_anchor_age must be positive");
  }
  ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  CudaEventClock clock(std::move(stream), max_anchor_age);
  RETURN_IF_ERROR(clock.Reanchor());
  return clock;
}

absl::Status CudaEventClock::Reanchor() {
  auto anchor = std::make_shared<Anchor>();
  ASSIGN_OR_RETURN(anchor->event, CudaEvent::Create(/*enable_timing=*/true));
  RETURN_IF_ERROR(anchor->event.Record(stream_.get()));
  // Spin rather than sleep: the host time read right after completion is the anchor.
  const uint64_t start = MonotonicNs();
  for (;;) {
    ASSIGN_OR_RETURN(bool done, anchor->event.Query());
    const uint64_t now = MonotonicNs();
    if (done) {
      anchor->host_ns = now;
      break;
    }
    if (now - start > kAnchorTimeoutNs) {
      return absl::DeadlineExceededError(
          "CudaEventClock: an event on an idle stream did not complete within 1 s");
    }
  }
  anchor_ = std::move(anchor);
  return absl::OkStatus();
}

absl::StatusOr<CudaEventClock::Stamp> CudaEventClock::Record(void* stream) {
  if (anchor_ == nullptr ||
      MonotonicNs() - anchor_->host_ns > static_cast<uint64_t>(max_age_ns_)) {
    RETURN_IF_ERROR(Reanchor());
  }
  Stamp stamp;
  ASSIGN_OR_RETURN(stamp.event, CudaEvent::Create(/*enable_timing=*/true));
  RETURN_IF_ERROR(stamp.event.Record(stream));
  stamp.anchor = anchor_;
  return stamp;
}

absl::StatusOr<uint64_t> CudaEventClock::HostNs(const Stamp& stamp) {
  if (stamp.anchor == nullptr) {
    return absl::FailedPreconditionError("CudaEventClock: an empty stamp");
  }
  ASSIGN_OR_RETURN(bool done, stamp.event.Query());
  if (!done) {
    return absl::FailedPreconditionError("CudaEventClock: the GPU has not reached the stamp yet");
  }
  ASSIGN_OR_RETURN(float ms, CudaEvent::ElapsedMilliseconds(stamp.anchor->event, stamp.event));
  const double ns = static_cast<double>(stamp.anchor->host_ns) + static_cast<double>(ms) * 1e6;
  if (!(ns > 0)) return absl::InternalError("CudaEventClock: a time before the clock's start");
  return static_cast<uint64_t>(std::llround(ns));
}

}  // namespace kvstream
