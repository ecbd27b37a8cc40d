// The UCX transport's memory handles (private to transfer/): UcxRegistration, a local region
// (caller-owned memory, memory AllocateMemory allocated, or a range inside the latter), and
// UcxRemote, a peer's region imported from its descriptor. Both keep the core alive and, on
// destruction, fail the transfers still copying through them, so no copy outlives the
// memory it touches. Device regions (MemoryKind::kDevice) have no UCX memory handle or
// rkey: they are known by region id, and written through the staged path
// (ucx/staged_engine.h); destroying one also waits (bounded) for the GPU work on it.
#ifndef KVSTREAM_TRANSFER_SRC_UCX_UCX_MEMORY_H_
#define KVSTREAM_TRANSFER_SRC_UCX_UCX_MEMORY_H_

#include <ucp/api/ucp.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/transfer/transport.h"
#include "ucx/ucx_core.h"
#include "ucx/ucx_handles.h"

namespace kvstream {
namespace internal {

// A registration: of memory the caller owns, of memory AllocateMemory allocated (`allocated`:
// it owns the allocation's entry in UcxCore::allocations), or of a range inside the latter
// (sharing the allocation's memory handle).
class UcxRegistration final : public MemoryRegistration {
 public:
  UcxRegistration(std::shared_ptr<UcxCore> core, SharedMemHandle memh, void* base,
                  size_t length, MemoryKind kind, std::string descriptor, bool allocated)
      : core_(std::move(core)), memh_(std::move(memh)), base_(base), length_(length),
        kind_(kind), descriptor_(std::move(descriptor)), allocated_(allocated) {}
  // A device region `region_id` (known to the core's device_regions), owning `owned`
  // when AllocateMemory allocated it.
  UcxRegistration(std::shared_ptr<UcxCore> core, uint64_t region_id, DeviceBuffer owned,
                  void* base, size_t length, std::string descriptor)
      : core_(std::move(core)), base_(base), length_(length), kind_(MemoryKind::kDevice),
        descriptor_(std::move(descriptor)), allocated_(false), region_id_(region_id),
        owned_(std::move(owned)) {}
  ~UcxRegistration() override;

  void* base() const override { return base_; }
  size_t length() const override { return length_; }
  MemoryKind memory_kind() const override { return kind_; }
  const std::string& descriptor() const override { return descriptor_; }
  const UcxCore* core() const { return core_.get(); }
  // REQUIRES: not a device region.
  ucp_mem_h memh() const { return memh_->get(); }
  bool device() const { return kind_ == MemoryKind::kDevice; }
  uint64_t region_id() const { return region_id_; }

 private:
  std::shared_ptr<UcxCore> core_;
  SharedMemHandle memh_;
  void* base_;
  size_t length_;
  MemoryKind kind_;
  std::string descriptor_;
  bool allocated_;
  uint64_t region_id_ = 0;
  DeviceBuffer owned_;  // destroyed last: after the GPU work on it was waited for
};

class UcxRemote final : public RemoteMemory {
 public:
  // `mapped`: where the region's first byte is mapped into this process, or null.
  UcxRemote(std::shared_ptr<UcxCore> core, PeerId peer, uint64_t address, uint64_t length,
            UcxRkey rkey, char* mapped)
      : core_(std::move(core)), peer_(peer), address_(address), length_(length),
        rkey_(std::move(rkey)), mapped_(mapped) {}
  // A peer's device region (no rkey: written through the staged path).
  UcxRemote(std::shared_ptr<UcxCore> core, PeerId peer, uint64_t address, uint64_t length,
            uint64_t region_id)
      : core_(std::move(core)), peer_(peer), address_(address), length_(length),
        mapped_(nullptr), region_id_(region_id) {}
  ~UcxRemote() override;

  PeerId peer() const override { return peer_; }
  size_t length() const override { return length_; }
  const UcxCore* core() const { return core_.get(); }
  uint64_t address() const { return address_; }
  ucp_rkey_h rkey() const { return rkey_.get(); }
  char* mapped() const { return mapped_; }
  bool device() const { return region_id_ != 0; }
  uint64_t region_id() const { return region_id_; }

 private:
  std::shared_ptr<UcxCore> core_;
  PeerId peer_;
  uint64_t address_;
  uint64_t length_;
  UcxRkey rkey_;
  char* mapped_;
  uint64_t region_id_ = 0;
};

// Transport::RegisterMemory and Transport::AllocateMemory (contracts in transport.h and
// ucx_transport.h). Take core->mu themselves.
absl::StatusOr<std::unique_ptr<MemoryRegistration>> RegisterUcxMemory(
    const std::shared_ptr<UcxCore>& core, void* base, size_t length, MemoryKind kind);
absl::StatusOr<std::unique_ptr<MemoryRegistration>> AllocateUcxMemory(
    const std::shared_ptr<UcxCore>& core, size_t length, MemoryKind kind);

// Where the peer's host region [address, address + length), unpacked into `rkey`, is mapped
// into this process: null when the key does not map it (writes go through UCX), its first
// byte when all of it lies in memory this process mapped for it and in none of the core's
// own shared memory (AllocateMemory allocations, staged landing areas); InvalidArgument
// naming `what`, the peer and the sizes when the descriptor claims more than the key maps
// (ucx/remote_mapping.h). REQUIRES core->mu.
absl::StatusOr<char*> MapPeerRegion(UcxCore* core, const UcxPeer& peer, ucp_rkey_h rkey,
                                    uint64_t address, uint64_t length, absl::string_view what);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_UCX_MEMORY_H_
