// The receiving side of the UCX transport's staged device path (private to transfer/;
// protocol in ucx/staged_engine.h): the landing area a sender's hello sets up, the scatter
// of each chunk, credits, and the ordering of notifications behind staged writes. Every
// function REQUIRES UcxCore::mu.
#ifndef KVSTREAM_TRANSFER_SRC_UCX_STAGED_RECEIVER_H_
#define KVSTREAM_TRANSFER_SRC_UCX_STAGED_RECEIVER_H_

#include <cstdint>
#include <vector>

#include "kvstream/common/cuda_resources.h"
#include "ucx/staged_engine.h"
#include "ucx/ucx_core.h"

namespace kvstream {
namespace internal {

// A hello, chunk or abort from `peer`.
void HandleReceived(UcxCore* core, UcxPeer* peer, const StagedInbound& message);

// Polls the scatters of `peer`'s chunks; credits and delivers what they unblock.
void PollReceiver(UcxCore* core, UcxPeer* peer);

// No scatter of `peer`'s chunks in flight.
bool ReceiverIdle(const UcxPeer& peer);

// The events of scatters in flight into region `region_id`.
void CollectScatterEvents(const UcxPeer& peer, uint64_t region_id,
                          std::vector<const CudaEvent*>* events);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_STAGED_RECEIVER_H_
