// DeviceVerifier: the consumer's check of layers that landed in a device cache. The host
// cannot read device memory on the hot path, so the layer's kvsum64 (cache/layer_checksum.h)
// is computed by a kernel on a stream of the verifier's own, into a pinned slot, and
// compared with the producer's once an event says it is done (Poll, never a blocking
// sync). The data had landed before its notice was delivered (the transport's ordering),
// so the kernel reads the final bytes.
//
// Thread safety: thread-compatible (the worker's progress thread uses it).
#ifndef KVSTREAM_CONNECTOR_SRC_DEVICE_VERIFIER_H_
#define KVSTREAM_CONNECTOR_SRC_DEVICE_VERIFIER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvstream/cache/kv_cache.h"
#include "kvstream/cache/layer_checksum.h"
#include "kvstream/common/cuda_resources.h"
#include "layer_notice.h"
#include "layer_runs.h"
#include "pinned_slots.h"

namespace kvstream {
namespace internal {

class DeviceVerifier {
 public:
  // A verifier on `device` (its stream, checksum engine, events and result slots).
  static absl::StatusOr<std::unique_ptr<DeviceVerifier>> Create(int device);

  // Enqueues the checksum of `runs` at their destination offsets in `view` (device memory),
  // to be compared with notice.checksum. Never blocks. ResourceExhausted when too many
  // verifications are pending; CUDA errors as they come.
  absl::Status Start(const KvCacheView& view, const LayerRuns& runs, const LayerNotice& notice);

  struct Verdict {
    LayerNotice notice;
    absl::Status status;  // OK, or DataLoss naming the request and layer
  };
  // The verifications that finished since the last call, in start order.
  std::vector<Verdict> Poll();
  bool busy() const { return !pending_.empty(); }

 private:
  struct Pending {
    LayerNotice notice;
    uint64_t* result = nullptr;
    CudaEvent done;
  };

  DeviceVerifier() = default;

  int device_ = 0;
  CudaStream stream_;
  std::unique_ptr<DeviceChecksummer> summer_;
  std::optional<PinnedSlots> slots_;
  std::deque<Pending> pending_;
  std::vector<CudaEvent> spare_events_;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_SRC_DEVICE_VERIFIER_H_
