// Destruction of the UCX transport's memory handles (ucx_memory.h).
#include "ucx/ucx_memory.h"

#include "ucx/staged_engine.h"

namespace kvstream {
namespace internal {

UcxRegistration::~UcxRegistration() {
  absl::MutexLock lock(&core_->mu);
  core_->FailCopiesThrough(this, "its local registration");
  if (device()) {
    core_->device_regions.erase(region_id_);  // chunks arriving from now on are dropped
    WaitForStagedRegionIdle(core_.get(), this, region_id_);
  }
  if (allocated_) core_->allocations.erase(reinterpret_cast<uintptr_t>(base_));
  memh_.reset();  // unmaps (and frees an allocation) if this was the last user
}

UcxRemote::~UcxRemote() {
  absl::MutexLock lock(&core_->mu);
  core_->FailCopiesThrough(this, "its remote memory");
  rkey_.Reset();  // unmaps a mapped segment
}

}  // namespace internal
}  // namespace kvstream
