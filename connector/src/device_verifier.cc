// DeviceVerifier (device_verifier.h).
#include "device_verifier.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

constexpr int kVerificationsInFlight = 512;

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceVerifier>> DeviceVerifier::Create(int device) {
  std::unique_ptr<DeviceVerifier> v(new DeviceVerifier());
  v->device_ = device;
  CudaDeviceScope scope(device);
  RETURN_IF_ERROR(scope.status());
  ASSIGN_OR_RETURN(v->stream_, CudaStream::Create(device));
  DeviceChecksummer::Options o;
  o.device = device;
  o.max_in_flight = kVerificationsInFlight;
  o.staging_bytes = size_t{32} << 20;
  ASSIGN_OR_RETURN(v->summer_, DeviceChecksummer::Create(o));
  ASSIGN_OR_RETURN(PinnedSlots slots, PinnedSlots::Create(kVerificationsInFlight));
  v->slots_ = std::move(slots);
  return v;
}

absl::Status DeviceVerifier::Start(const KvCacheView& view, const LayerRuns& runs,
                                   const LayerNotice& notice) {
  CudaDeviceScope scope(device_);
  RETURN_IF_ERROR(scope.status());
  Pending p;
  p.notice = notice;
  if (!spare_events_.empty()) {
    p.done = std::move(spare_events_.back());
    spare_events_.pop_back();
  } else {
    ASSIGN_OR_RETURN(p.done, CudaEvent::Create());
  }
  ASSIGN_OR_RETURN(p.result, slots_->Acquire());
  absl::Status s = summer_->Enqueue(LayerSpans(view, runs, /*destination=*/true), stream_.get(),
                                    p.result);
  if (s.ok()) s = p.done.Record(stream_.get());
  if (!s.ok()) {
    slots_->Release(p.result);
    spare_events_.push_back(std::move(p.done));
    return s;
  }
  pending_.push_back(std::move(p));
  return absl::OkStatus();
}

std::vector<DeviceVerifier::Verdict> DeviceVerifier::Poll() {
  std::vector<Verdict> out;
  while (!pending_.empty()) {
    Pending& p = pending_.front();
    absl::StatusOr<bool> done = p.done.Query();
    if (done.ok() && !*done) break;  // later ones were enqueued after it: not done either
    Verdict v;
    v.notice = std::move(p.notice);
    if (!done.ok()) {
      v.status = absl::Status(done.status().code(),
                              absl::StrCat("request ", v.notice.request_id, " layer ",
                                           v.notice.layer, ": verifying its checksum on the GPU: ",
                                           done.status().message()));
    } else if (*p.result != v.notice.checksum) {
      v.status = absl::DataLossError(absl::StrCat(
          "request ", v.notice.request_id, " layer ", v.notice.layer, ": checksum mismatch (got ",
          absl::Hex(*p.result), ", producer sent ", absl::Hex(v.notice.checksum), ")"));
    }
    slots_->Release(p.result);
    spare_events_.push_back(std::move(p.done));
    pending_.pop_front();
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace internal
}  // namespace kvstream
