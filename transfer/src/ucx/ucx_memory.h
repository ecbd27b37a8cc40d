// The UCX transport's memory handles (private to transfer/): UcxRegistration, a local region
// (caller-owned memory, memory AllocateMemory allocated, or a range inside the latter), and
// UcxRemote, a peer's region imported from its descriptor. Both keep the core alive and, on
// destruction, fail the transfers still copying through them, so no copy outlives the
// memory it touches.
#ifndef KVSTREAM_TRANSFER_SRC_UCX_UCX_MEMORY_H_
#define KVSTREAM_TRANSFER_SRC_UCX_UCX_MEMORY_H_

#include <ucp/api/ucp.h>

#include <cstdint>
#include <memory>
#include <string>

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
  ~UcxRegistration() override;

  void* base() const override { return base_; }
  size_t length() const override { return length_; }
  MemoryKind memory_kind() const override { return kind_; }
  const std::string& descriptor() const override { return descriptor_; }
  const UcxCore* core() const { return core_.get(); }
  ucp_mem_h memh() const { return memh_->get(); }

 private:
  std::shared_ptr<UcxCore> core_;
  SharedMemHandle memh_;
  void* base_;
  size_t length_;
  MemoryKind kind_;
  std::string descriptor_;
  bool allocated_;
};

class UcxRemote final : public RemoteMemory {
 public:
  // `mapped`: where the region's first byte is mapped into this process, or null.
  UcxRemote(std::shared_ptr<UcxCore> core, PeerId peer, uint64_t address, uint64_t length,
            UcxRkey rkey, char* mapped)
      : core_(std::move(core)), peer_(peer), address_(address), length_(length),
        rkey_(std::move(rkey)), mapped_(mapped) {}
  ~UcxRemote() override;

  PeerId peer() const override { return peer_; }
  size_t length() const override { return length_; }
  const UcxCore* core() const { return core_.get(); }
  uint64_t address() const { return address_; }
  ucp_rkey_h rkey() const { return rkey_.get(); }
  char* mapped() const { return mapped_; }

 private:
  std::shared_ptr<UcxCore> core_;
  PeerId peer_;
  uint64_t address_;
  uint64_t length_;
  UcxRkey rkey_;
  char* mapped_;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_UCX_MEMORY_H_
