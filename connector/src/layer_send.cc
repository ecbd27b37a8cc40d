// LayerSender (layer_send.h).
#include "layer_send.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kvstream/common/status_macros.h"
#include "layer_notice.h"
#include "layer_runs.h"

namespace kvstream {
namespace internal {
namespace {

std::vector<Segment> ToSegments(const std::vector<ByteRun>& runs) {
  std::vector<Segment> segs;
  segs.reserve(runs.size());
  for (const ByteRun& r : runs) segs.push_back({r.src_offset, r.dst_offset, r.length});
  return segs;
}

}  // namespace

// Layer checksums that may be pending at once (requests x layers in flight).
constexpr int kChecksumsInFlight = 1024;
// Ready events made up front (more are made when that many layers are in flight).
constexpr int kReadyEventsMade = 256;

absl::StatusOr<std::unique_ptr<LayerSender>> LayerSender::Create(const LayerTable& table,
                                                                 Transport& transport,
                                                                 bool checksum, int device) {
  std::unique_ptr<LayerSender> s(new LayerSender(transport, checksum, device));
  if (table.memory() != MemoryKind::kDevice) return s;
  CudaDeviceScope scope(device);
  RETURN_IF_ERROR(scope.status());
  // Made here, not per post: the forward pass then makes no CUDA objects.
  for (int i = 0; i < kReadyEventsMade; ++i) {
    ASSIGN_OR_RETURN(CudaEvent e, CudaEvent::Create());
    s->free_events_.push_back(std::move(e));
  }
  if (checksum) {
    DeviceChecksummer::Options o;
    o.device = device;
    o.max_in_flight = kChecksumsInFlight;
    o.staging_bytes = size_t{64} << 20;
    ASSIGN_OR_RETURN(s->summer_, DeviceChecksummer::Create(o));
    ASSIGN_OR_RETURN(PinnedSlots slots, PinnedSlots::Create(kChecksumsInFlight));
    s->slots_ = std::move(slots);
  }
  return s;
}

uint64_t LayerSender::Done(TransferId v) {
  auto it = slot_of_.find(v);
  if (it != slot_of_.end()) {
    slots_->Release(it->second);
    slot_of_.erase(it);
  }
  auto ready = ready_of_.find(v);
  if (ready == ready_of_.end()) return 0;
  uint64_t ns = ready->second.seen_ns;
  if (ns == 0) {
    // Not seen by a poll: complete now (the write waited for it) unless the write failed.
    absl::StatusOr<bool> done = ready->second.event.Query();
    if (done.ok() && *done) ns = MonotonicNs();
  }
  free_events_.push_back(std::move(ready->second.event));
  ready_of_.erase(ready);
  return ns;
}

void LayerSender::PollReady() {
  // In post order, up to the first still pending: layers of one stream complete in order,
  // and one query per poll keeps the progress loop light while a long prefill runs.
  for (auto& [v, r] : ready_of_) {
    if (r.seen_ns != 0) continue;
    absl::StatusOr<bool> done = r.event.Query();
    if (!done.ok() || !*done) return;
    r.seen_ns = MonotonicNs();
  }
}

absl::StatusOr<CudaEvent> LayerSender::TakeEvent() {
  if (!free_events_.empty()) {
    CudaEvent e = std::move(free_events_.back());
    free_events_.pop_back();
    return e;
  }
  CudaDeviceScope scope(device_);
  RETURN_IF_ERROR(scope.status());
  return CudaEvent::Create();
}


absl::StatusOr<LayerPost> LayerSender::Post(const LayerEntry& layer, const std::string& request_id,
                                            uint64_t attempt, PeerId peer, const RemoteMemory& k_remote,
                                            const RemoteMemory& v_remote,
                                            absl::Span<const int32_t> local_blocks,
                                            absl::Span<const int32_t> dest_blocks,
                                            int32_t num_tokens, void* stream,
                                            TransferId* posted_k) {
  *posted_k = 0;
  const KvCacheView cv = layer.cache->view();
  ASSIGN_OR_RETURN(LayerRuns runs, PlanLayerRuns(cv, local_blocks, dest_blocks, num_tokens));
  LayerNotice notice;
  notice.request_id = request_id;
  notice.attempt = attempt;
  notice.layer = static_cast<uint32_t>(layer.index);
  notice.bytes = runs.bytes;
  WriteOrder order;
  uint64_t* slot = nullptr;
  std::optional<Ready> ready;  // device caches
  if (cv.memory == MemoryKind::kDevice) {
    if (stream == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer '", layer.name, "': a device cache's save needs the layer's stream"));
    }
    if (checksum_) {
      ASSIGN_OR_RETURN(slot, slots_->Acquire());
      absl::Status s = summer_->Enqueue(LayerSpans(cv, runs, /*destination=*/false), stream, slot);
      if (!s.ok()) {
        slots_->Release(slot);
        return s;
      }
      notice.checksum_kind = ChecksumKind::kKvsum64;
      order.notification_tail = slot;
      order.notification_tail_bytes = kLayerNoticeChecksumBytes;
    }
    absl::StatusOr<CudaEvent> event = TakeEvent();
    absl::Status recorded = event.ok() ? event->Record(stream) : event.status();
    if (!recorded.ok()) {
      if (slot != nullptr) slots_->Release(slot);
      if (event.ok()) free_events_.push_back(std::move(event).value());
      return recorded;
    }
    ready.emplace(Ready{std::move(event).value(), 0});
    order.ready_event = ready->event.get();
  } else {
    if (checksum_) {
      notice.checksum_kind = ChecksumKind::kXxh3;
      notice.checksum = HostLayerChecksum(cv, runs, /*destination=*/false);
    }
    notice.post_ns = MonotonicNs();
  }
  // With a GPU-made checksum the notice ends where the tail's 8 bytes go.
  absl::StatusOr<std::string> payload =
      slot != nullptr ? EncodeLayerNoticeHead(notice) : EncodeLayerNotice(notice);
  LayerPost post;
  post.bytes = runs.bytes;
  post.post_ns = MonotonicNs();
  absl::StatusOr<TransferId> k =
      payload.ok() ? transport_.PostWrite(peer, *layer.k_reg, k_remote, ToSegments(runs.k), "",
                                          WriteOrder{order.ready_event})
                   : payload.status();
  if (!k.ok()) {
    if (slot != nullptr) slots_->Release(slot);
    if (ready.has_value()) free_events_.push_back(std::move(ready->event));
    return k.status();
  }
  post.k = *posted_k = *k;
  absl::StatusOr<TransferId> v =
      transport_.PostWrite(peer, *layer.v_reg, v_remote, ToSegments(runs.v), *payload, order);
  if (!v.ok()) {
    if (slot != nullptr) slots_->Release(slot);
    if (ready.has_value()) free_events_.push_back(std::move(ready->event));
    return v.status();
  }
  post.v = *v;
  if (slot != nullptr) slot_of_[post.v] = slot;
  if (ready.has_value()) ready_of_.emplace(post.v, std::move(*ready));
  return post;
}

}  // namespace internal
}  // namespace kvstream
