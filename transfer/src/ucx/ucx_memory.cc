// The UCX transport's memory handles and how they are made (ucx_memory.h).
//
// RegisterUcxMemory maps caller-owned memory (ucp_mem_map); AllocateUcxMemory has UCX
// allocate it (UCP_MEM_MAP_ALLOCATE), which over shared memory gives a sysv/posix segment
// the writer attaches through the remote key, so its puts are direct copies. The core
// remembers allocations by address so that RegisterMemory of a range inside one shares its
// memory handle and packed key (a fresh ucp_mem_map would get a key without the segment);
// the handle is shared (SharedMemHandle) and unmapped with its last registration. Device
// memory is not given to UCX at all (it has no CUDA memory domain here): it becomes a
// region id of the staged path.
#include "ucx/ucx_memory.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"
#include "ucx/am_writes.h"
#include "ucx/remote_mapping.h"
#include "ucx/staged_cuda.h"
#include "ucx/staged_engine.h"
#include "ucx/ucx_status.h"
#include "ucx/ucx_wire.h"

namespace kvstream {
namespace internal {
namespace {

absl::StatusOr<std::string> PackRkey(UcxCore* core, ucp_mem_h memh)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  void* buffer = nullptr;
  size_t size = 0;
  RETURN_IF_ERROR(
      UcxStatusToStatus(ucp_rkey_pack(core->context.get(), memh, &buffer, &size), "rkey_pack"));
  std::string rkey(static_cast<const char*>(buffer), size);
  ucp_rkey_buffer_release(buffer);
  return rkey;
}

std::string Descriptor(uintptr_t address, size_t length, const std::string& rkey) {
  UcxMemoryDescriptor descriptor;
  descriptor.kind = UcxRegionKind::kHost;
  descriptor.address = address;
  descriptor.length = length;
  descriptor.rkey = rkey;
  return EncodeMemoryDescriptor(descriptor);
}

// Registers device memory on `device` (owning `owned`, if not empty) as a staged region.
absl::StatusOr<std::unique_ptr<MemoryRegistration>> RegisterDevice(
    const std::shared_ptr<UcxCore>& core, void* base, size_t length, int device,
    DeviceBuffer owned) {
  absl::MutexLock lock(&core->mu);
  if (core->shut_down) {
    return absl::FailedPreconditionError("UCX RegisterMemory: transport shut down");
  }
  RETURN_IF_ERROR(EnsureStagedEngine(core.get(), device));
  const uint64_t region_id = core->next_region_id++;
  core->device_regions[region_id] = DeviceRegion{static_cast<char*>(base), length};
  UcxMemoryDescriptor d;
  d.kind = UcxRegionKind::kDevice;
  d.address = reinterpret_cast<uintptr_t>(base);
  d.length = length;
  d.region_id = region_id;
  return std::unique_ptr<MemoryRegistration>(new UcxRegistration(
      core, region_id, std::move(owned), base, length, EncodeMemoryDescriptor(d)));
}

}  // namespace

UcxRegistration::~UcxRegistration() {
  absl::MutexLock lock(&core_->mu);
  core_->FailCopiesThrough(this, "its local registration");
  if (device()) {
    core_->device_regions.erase(region_id_);  // chunks arriving from now on are dropped
    WaitForStagedRegionIdle(core_.get(), this, region_id_);
  }
  if (!device()) RemoveHostRegion(core_.get(), base_, length_);  // later pieces are dropped
  if (allocated_) core_->allocations.erase(reinterpret_cast<uintptr_t>(base_));
  memh_.reset();  // unmaps (and frees an allocation) if this was the last user
}

UcxRemote::~UcxRemote() {
  absl::MutexLock lock(&core_->mu);
  core_->FailCopiesThrough(this, "its remote memory");
  rkey_.Reset();  // unmaps a mapped segment
}

absl::StatusOr<std::unique_ptr<MemoryRegistration>> RegisterUcxMemory(
    const std::shared_ptr<UcxCore>& core, void* base, size_t length, MemoryKind kind) {
  if (base == nullptr || length == 0) {
    return absl::InvalidArgumentError("UCX RegisterMemory: null or empty range");
  }
  if (kind == MemoryKind::kDevice) {
    if (!BuiltWithCuda()) {
      return absl::InvalidArgumentError(
          "UCX RegisterMemory: device memory needs a build of kvstream with CUDA");
    }
    ASSIGN_OR_RETURN(int device, DeviceOfRange(base, length));
    return RegisterDevice(core, base, length, device, DeviceBuffer());
  }
  absl::MutexLock lock(&core->mu);
  // Inside an allocation: a fresh ucp_mem_map of it would give a key without the
  // shared-memory part (UCX's shared-memory domains cannot register memory, only allocate
  // it), and puts would fall back to active-message emulation.
  const uintptr_t address = reinterpret_cast<uintptr_t>(base);
  auto it = core->allocations.upper_bound(address);
  if (it != core->allocations.begin()) {
    --it;
    const uintptr_t offset = address - it->first;
    if (offset < it->second.length && length <= it->second.length - offset) {
      AddHostRegion(core.get(), base, length);
      return std::unique_ptr<MemoryRegistration>(
          new UcxRegistration(core, it->second.memh, base, length, kind,
                              Descriptor(address, length, it->second.rkey),
                              /*allocated=*/false));
    }
  }
  ucp_mem_map_params_t params;
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = base;
  params.length = length;
  ucp_mem_h raw_memh = nullptr;
  RETURN_IF_ERROR(
      UcxStatusToStatus(ucp_mem_map(core->context.get(), &params, &raw_memh), "mem_map"));
  auto memh = std::make_shared<UcxMemHandle>(core->context.get(), raw_memh);
  ASSIGN_OR_RETURN(std::string rkey, PackRkey(core.get(), memh->get()));
  AddHostRegion(core.get(), base, length);
  return std::unique_ptr<MemoryRegistration>(
      new UcxRegistration(core, std::move(memh), base, length, kind,
                          Descriptor(address, length, rkey), /*allocated=*/false));
}

absl::StatusOr<std::unique_ptr<MemoryRegistration>> AllocateUcxMemory(
    const std::shared_ptr<UcxCore>& core, size_t length, MemoryKind kind) {
  if (length == 0) return absl::InvalidArgumentError("UCX AllocateMemory: zero length");
  if (kind == MemoryKind::kDevice && BuiltWithCuda()) {
    int device = kCurrentCudaDevice;
    {
      absl::MutexLock lock(&core->mu);
      if (core->staged != nullptr) device = core->staged->device;
    }
    CudaDeviceScope scope(device);
    RETURN_IF_ERROR(scope.status());
    ASSIGN_OR_RETURN(int current, CurrentCudaDevice());
    ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::CreateZeroed(length, kind));
    void* base = buffer.data();
    return RegisterDevice(core, base, length, current, std::move(buffer));
  }
  if (kind != MemoryKind::kHost) {
    return absl::InvalidArgumentError(absl::StrCat("UCX AllocateMemory: cannot allocate ",
                                                   MemoryKindName(kind), " memory"));
  }
  SharedMemHandle memh;
  void* base = nullptr;
  std::string rkey;
  {
    absl::MutexLock lock(&core->mu);
    // UCX picks the allocator by UCX_ALLOC_PRIO (by default its sysv, then posix
    // shared-memory domains where those transports are enabled, else anonymous mmap), and
    // registers the memory with every other memory domain.
    ucp_mem_map_params_t params;
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                        UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    params.address = nullptr;
    params.length = length;
    params.flags = UCP_MEM_MAP_ALLOCATE;
    ucp_mem_h raw_memh = nullptr;
    RETURN_IF_ERROR(UcxStatusToStatus(ucp_mem_map(core->context.get(), &params, &raw_memh),
                                      absl::StrCat("mem_map (allocate ", length, " bytes)")));
    // Declared after the lock: released under it if anything below fails.
    auto allocated = std::make_shared<UcxMemHandle>(core->context.get(), raw_memh);
    ucp_mem_attr_t attr;
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    RETURN_IF_ERROR(UcxStatusToStatus(ucp_mem_query(raw_memh, &attr), "mem_query"));
    if (attr.address == nullptr || attr.length < length ||
        reinterpret_cast<uintptr_t>(attr.address) % kMinAllocationAlignment != 0) {
      return absl::InternalError(absl::StrCat(
          "UCX AllocateMemory: UCX returned ", attr.length, " bytes at ",
          absl::Hex(reinterpret_cast<uintptr_t>(attr.address)),
          " for ", length, " bytes aligned to ", kMinAllocationAlignment));
    }
    base = attr.address;
    ASSIGN_OR_RETURN(rkey, PackRkey(core.get(), raw_memh));
    memh = std::move(allocated);
  }
  // Not every UCX allocator zero-fills (heap does not). Nobody else can reach the memory
  // before it is returned, so this needs no lock; it also faults the pages in now rather
  // than during the first transfers.
  std::memset(base, 0, length);
  const uintptr_t address = reinterpret_cast<uintptr_t>(base);
  std::string descriptor = Descriptor(address, length, rkey);
  absl::MutexLock lock(&core->mu);
  UcxAllocation allocation;
  allocation.length = length;
  allocation.memh = memh;
  allocation.rkey = std::move(rkey);
  core->allocations[address] = std::move(allocation);
  AddHostRegion(core.get(), base, length);
  return std::unique_ptr<MemoryRegistration>(new UcxRegistration(
      core, std::move(memh), base, length, kind, std::move(descriptor), /*allocated=*/true));
}

absl::StatusOr<char*> MapPeerRegion(UcxCore* core, const UcxPeer& peer, ucp_rkey_h rkey,
                                    uint64_t address, uint64_t length, absl::string_view what)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::vector<OwnRange> own;
  for (const auto& [base, allocation] : core->allocations) own.emplace_back(base, allocation.length);
  for (const auto& [id, p] : core->peers) {
    if (p->in != nullptr && p->in->landing != nullptr) {
      own.emplace_back(reinterpret_cast<uintptr_t>(p->in->landing),
                       uint64_t{p->in->slots.size()} * p->in->slot_bytes);
    }
  }
  return MapRemoteRegion(rkey, address, length, own, what, peer.label);
}

}  // namespace internal
}  // namespace kvstream
