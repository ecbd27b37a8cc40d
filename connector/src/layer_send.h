// LayerSender: posts one layer of one request to one consumer: the K runs as one write,
// the V runs as a second write that carries the layer notice (the transport delivers it
// after both writes' data, transport.h), with the layer's checksum.
//
// Host caches: the checksum (XXH3) is computed here over the bytes being sent and the
// writes start at once. Device caches: a kvsum64 kernel (cache/layer_checksum.h) is
// enqueued on the layer's stream over the bytes being sent, writing into a pinned slot, and
// an event recorded after it orders the writes after the layer's cache update and the
// checksum (WriteOrder::ready_event); the slot's 8 bytes complete the notice
// (WriteOrder::notification_tail). The host never waits for the GPU. Each post has its own
// ready event, which PollReady() (from the progress loop) queries until it completes: the
// first host time it was seen complete is when the layer was ready (within one poll of the
// progress loop). The events are made at creation and reused: making and destroying one
// per post on the forward pass's thread held the copies back until the pass ended (seen on
// an H200). The notice's post_ns stays 0 (unknown) for device caches: the host posts ahead of the GPU,
// so the post time says nothing of the transfer.
//
// Thread safety: thread-compatible; the producer calls it under its own lock.
#ifndef KVSTREAM_CONNECTOR_SRC_LAYER_SEND_H_
#define KVSTREAM_CONNECTOR_SRC_LAYER_SEND_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvstream/cache/layer_checksum.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/transfer/transport.h"
#include "layer_table.h"
#include "pinned_slots.h"

namespace kvstream {
namespace internal {

struct LayerPost {
  TransferId k = 0;  // the K write
  TransferId v = 0;  // the V write, with the notice
  uint64_t bytes = 0;
  uint64_t post_ns = 0;  // when the host posted it (MonotonicNs)
};

class LayerSender {
 public:
  // `checksum`: whether notices carry a checksum (verify_checksum). For device caches this
  // creates, on `device`, the ordering event and (with `checksum`) the checksum engine and
  // its result slots.
  static absl::StatusOr<std::unique_ptr<LayerSender>> Create(const LayerTable& table,
                                                             Transport& transport, bool checksum,
                                                             int device);

  // Posts the first `num_tokens` tokens of `layer` from `local_blocks` to `dest_blocks` of
  // the consumer's regions. `stream`: the layer's cudaStream_t for device caches (null for
  // host caches). Errors: the plan's (bad block ids) or the transport's; nothing is posted
  // when the K write fails (a failed V write leaves the K write posted: its id is returned
  // in the error path through `posted_k`).
  absl::StatusOr<LayerPost> Post(const LayerEntry& layer, const std::string& request_id,
                                 uint64_t attempt, PeerId peer, const RemoteMemory& k_remote,
                                 const RemoteMemory& v_remote,
                                 absl::Span<const int32_t> local_blocks,
                                 absl::Span<const int32_t> dest_blocks, int32_t num_tokens,
                                 void* stream, TransferId* posted_k);

  // Device caches: notes the host time of ready events that completed since the last call.
  void PollReady();

  // The V write `v` (from a LayerPost) ended: its checksum slot may be reused. Returns,
  // for a device cache's layer, when it was seen ready to send (MonotonicNs: its cache
  // update and checksum done); 0 for host caches (ready at the post) or when unknown.
  uint64_t Done(TransferId v);

 private:
  absl::StatusOr<CudaEvent> TakeEvent();

  LayerSender(Transport& transport, bool checksum, int device)
      : transport_(transport), checksum_(checksum), device_(device) {}

  Transport& transport_;
  const bool checksum_;
  const int device_;  // of device caches
  // Device caches: the ready event recorded on the layer's stream before each post, and
  // when it was first seen complete (0: not yet), by V write.
  struct Ready {
    CudaEvent event;
    uint64_t seen_ns = 0;
  };
  std::map<TransferId, Ready> ready_of_;
  std::vector<CudaEvent> free_events_;  // ready events to reuse
  std::unique_ptr<DeviceChecksummer> summer_;  // device caches with checksums
  std::optional<PinnedSlots> slots_;           // the checksums' results
  std::map<TransferId, uint64_t*> slot_of_;    // V write -> its checksum slot
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_SRC_LAYER_SEND_H_
