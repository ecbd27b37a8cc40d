// PinnedSlots: a fixed set of 8-byte slots of pinned host memory, for results the GPU writes
// and the host (or a transport's notification tail) reads: layer checksums. Acquire never
// blocks: ResourceExhausted when every slot is in use. Thread-compatible.
#ifndef KVSTREAM_CONNECTOR_SRC_PINNED_SLOTS_H_
#define KVSTREAM_CONNECTOR_SRC_PINNED_SLOTS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {

class PinnedSlots {
 public:
  // `count` slots on the calling thread's current device. Errors as DeviceBuffer::Create.
  static absl::StatusOr<PinnedSlots> Create(size_t count) {
    PinnedSlots s;
    ASSIGN_OR_RETURN(s.memory_, DeviceBuffer::CreateZeroed(count * sizeof(uint64_t),
                                                           MemoryKind::kPinned));
    for (size_t i = count; i > 0; --i) s.free_.push_back(s.memory_.data_as<uint64_t>() + i - 1);
    return s;
  }

  absl::StatusOr<uint64_t*> Acquire() {
    if (free_.empty()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "all ", memory_.size() / sizeof(uint64_t), " pinned checksum slots are in use"));
    }
    uint64_t* slot = free_.back();
    free_.pop_back();
    return slot;
  }
  void Release(uint64_t* slot) {
    if (slot != nullptr) free_.push_back(slot);
  }

 private:
  DeviceBuffer memory_;
  std::vector<uint64_t*> free_;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_SRC_PINNED_SLOTS_H_
