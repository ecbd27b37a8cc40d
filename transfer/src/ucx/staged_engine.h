// The UCX transport's staged device path (private to transfer/): PostWrite from a device
// registration into a peer's device region, through pinned host memory, because the UCX
// kvstream runs on has no CUDA transports (no GPUDirect).
//
// Protocol (messages in ucx/staged_wire.h; every step runs under UcxCore::mu):
//
//  1. Link. On the first staged write to a peer, the sender sends `hello` (its worker
//     info). The receiver connects back to the sender if it has no endpoint to it (credits
//     travel that way), allocates the sender's *landing area* - `slots` slots of `slot
//     bytes`, memory UCX allocates itself (ucp_mem_map ALLOCATE: a sysv/posix segment over
//     shared memory, anonymous memory over TCP), page-locked with cudaHostRegister - and
//     answers `welcome` with the area's descriptor (address, length, rkey), or a refusal.
//     The sender unpacks the rkey. Where it maps the area into this process (ucp_rkey_ptr:
//     shared memory), it page-locks the mapping too and copies straight into the
//     receiver's slots ("mapped" mode: no host copy at all); otherwise ("put" mode: TCP)
//     it keeps a pinned bounce area of the same shape and puts each slot across.
//  2. Chunks. The write's segments are planned into chunks of at most one slot
//     (ucx/staged_plan.h). The sender owns a slot's credit until it sends that slot's
//     chunk; per chunk, on one of two gather streams: wait for the write's ready event
//     (the caller's cudaEvent_t, captured at post time on an ordering stream), copy the
//     chunk's piece table to the device, one gather kernel (ucx/segment_copy.h) into a
//     device staging buffer, one cudaMemcpyAsync into the slot (mapped) or the bounce slot
//     (put), and an event. Progress polls the event; then (put mode: ucp_put_nbx into the
//     receiver's slot and an endpoint flush first) the `chunk` message carries the
//     transfer's sequence number, the chunk's index and count, the slot, the destination
//     region id and the (remote offset, length) table.
//  3. Scatter. The receiver checks the chunk against its state (slot idle, region known,
//     every piece inside the region, the layout fitting a slot), then on one of two
//     scatter streams: cudaMemcpyAsync slot -> device staging, the table to the device,
//     one scatter kernel into the region, an event. Progress polls the event; then the
//     slot goes back to the sender as a `credit`, and the chunk counts as landed.
//  4. Order. Every write a sender posts to a peer through this path takes the next
//     sequence number; every notification carries a watermark, the count of staged writes
//     posted to the peer before it (for a staged write's own notification, including
//     itself). The receiver delivers a notification only once every staged write below
//     the watermark has landed (all its chunks scattered, seen through their events), and
//     from a given sender in arrival order. So "a notification follows the data of its own
//     batch and of every earlier write" holds for staged writes as for puts.
//  5. Cancellation. A staged write that fails or is cancelled stops issuing chunks and
//     sends `abort` (seq, chunks sent), so the receiver knows how many chunks to wait for
//     before it moves past that sequence number; chunks whose GPU work was under way are
//     dropped when their event completes (their slots come back to the sender at once).
//
// Overlap: with S slots, up to S chunks are in flight: the gather and device-to-host copy
// of one chunk run while the previous one crosses and the receiver scatters an earlier one
// (alternating streams on both sides).
//
// Memory lifetimes: a slot's buffers are reused only after its event completed. Destroying
// a device registration fails the staged writes from it and waits (bounded) for the GPU
// work that still reads or writes it; peers with GPU work in flight are not erased; the
// transport's destructor waits (bounded) for every stream before it frees any buffer, and
// leaks the buffers rather than free them under a GPU that did not finish.
#ifndef KVSTREAM_TRANSFER_SRC_UCX_STAGED_ENGINE_H_
#define KVSTREAM_TRANSFER_SRC_UCX_STAGED_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/transfer/transport.h"
#include "ucx/staged_plan.h"
#include "ucx/staged_wire.h"
#include "ucx/ucx_core.h"
#include "ucx/ucx_handles.h"

namespace kvstream {
namespace internal {

class UcxRegistration;
class UcxRemote;

// Transport-wide CUDA resources of the staged path, created with the first device
// registration, on its device.
struct StagedEngine {
  int device = -1;
  StagedOptions options;
  CudaStream order;      // holds only waits for callers' ready events
  CudaStream gather[2];  // sender side, by slot parity
  CudaStream scatter[2];  // receiver side, by slot parity
};

// A slot's device and pinned buffers, shared by both directions' slot types.
struct SlotBuffers {
  DeviceBuffer staging;     // device, slot bytes
  DeviceBuffer table;       // device, kMaxStagedPiecesPerChunk entries
  DeviceBuffer host_table;  // pinned, the same
  CudaEvent done;
};

struct SenderSlot {
  // kFree: the sender holds its credit. kGpu: gather and copy enqueued. kPutting: put and
  // flush in flight (put mode). kSending: chunk message in flight. kAtPeer: the receiver
  // holds it until it sends the credit back. kBroken: a CUDA error left it unusable.
  enum class State { kFree, kGpu, kPutting, kSending, kAtPeer, kBroken };
  UcxPeer* peer = nullptr;
  uint32_t index = 0;
  State state = State::kFree;
  SlotBuffers buffers;
  TransferId transfer = 0;
  const void* local_handle = nullptr;  // the registration the gather reads
  uint64_t staged_bytes = 0;
  std::string header, body;  // the chunk message
  void* request = nullptr;
};

struct StagedOut {
  enum class Link { kNone, kHelloSent, kReady, kRefused };
  ~StagedOut();
  Link link = Link::kNone;
  absl::Status refused;
  uint64_t landing_address = 0;
  uint64_t slot_bytes = 0;
  UcxRkey rkey;
  char* mapped = nullptr;  // the landing area mapped here (mapped mode), page-locked
  DeviceBuffer bounce;     // put mode: pinned, slots * slot bytes
  std::unique_ptr<UcxMemHandle> bounce_memh;
  std::vector<std::unique_ptr<SenderSlot>> slots;
  std::deque<UcxTransfer*> queue;  // staged writes with chunks left to issue, post order
};

// One staged write (UcxTransfer::staged).
struct StagedSend {
  std::vector<Segment> segments;  // planned once the link gives the slot size
  bool planned = false;
  std::vector<StagedChunk> chunks;
  uint32_t next_chunk = 0;     // next to issue
  uint32_t chunks_posted = 0;  // chunk messages handed to UCX
  uint32_t chunks_sent = 0;    // chunk message sends completed
  bool has_seq = false;        // false for a write with no bytes
  uint64_t seq = 0;
  uint64_t region_id = 0;
  const char* local_base = nullptr;
  CudaEvent ready;  // the caller's ready event, as captured on the ordering stream
};

struct ReceiverSlot {
  bool scattering = false;
  SlotBuffers buffers;
  uint64_t seq = 0;
  uint64_t region_id = 0;
};

struct StagedIn {
  ~StagedIn();
  // The landing area (from the first hello).
  std::unique_ptr<UcxMemHandle> landing_memh;
  char* landing = nullptr;
  bool landing_locked = false;
  uint64_t slot_bytes = 0;
  std::string landing_descriptor;
  std::vector<std::unique_ptr<ReceiverSlot>> slots;
  // Ordering (step 4).
  struct SeqProgress {
    bool aborted = false;
    int64_t expected = -1;  // chunks to land; -1 until a chunk or an abort says
    uint32_t landed = 0;
  };
  uint64_t landed = 0;  // every staged write below this has landed
  std::map<uint64_t, SeqProgress> seqs;
  struct Held {
    uint64_t watermark = 0;
    Notification notification;
  };
  std::deque<Held> held;
  std::vector<uint32_t> credits;  // to send back
};

// A slot's buffers: `slot_bytes` of device staging, a device and a pinned piece table, an
// event. On the calling thread's current device.
absl::StatusOr<SlotBuffers> NewSlotBuffers(uint64_t slot_bytes);

// --- Entry points for the core and the transport (all REQUIRE core->mu) ---

// The engine for `device`, created on first use. InvalidArgument when the transport's
// engine lives on another device.
absl::Status EnsureStagedEngine(UcxCore* core, int device);

// PostWrite from a device registration to a peer's device region (segments checked).
absl::StatusOr<TransferId> PostStagedWrite(UcxCore* core, UcxPeer* peer,
                                           const UcxRegistration& local, const UcxRemote& remote,
                                           absl::Span<const Segment> segments,
                                           absl::string_view notification,
                                           const WriteOrder& order);

// Whether a staged write has sent every chunk (and its ready event completed).
bool StagedSendFinished(const StagedSend& send);

// Called by FailTransfer for a staged write: stop issuing, tell the receiver (abort).
void StagedTransferFailed(UcxCore* core, UcxTransfer* t);

// Delivers `n` to the inbox or holds it behind staged writes that have not landed.
void DeliverNotification(UcxCore* core, UcxPeer* peer, uint64_t watermark, Notification n);

// Processes received staged messages, polls events, sends credits, moves writes on.
void ProgressStaged(UcxCore* core);

// Whether the peer's staged buffers have no GPU work or UCX request in flight (it may be
// erased).
bool StagedPeerIdle(const UcxPeer& peer);

// Whether a UCX request of the peer's staged slots is in flight (its callback will run).
bool StagedRequestsPending(const UcxPeer& peer);

// Drops what a failed peer had pending on the receiving side.
void StagedPeerFailed(UcxCore* core, UcxPeer* peer);

// Waits (bounded) until no GPU work reads or writes the device registration `handle`
// (region `region_id`).
void WaitForStagedRegionIdle(UcxCore* core, const void* handle, uint64_t region_id);

// Transport destruction: waits (bounded) for every staged stream; when they did not drain,
// leaks the peers' staged buffers instead of freeing them.
void DrainStaged(UcxCore* core, absl::Time deadline);

// The staged active-message handler (installed by UcxCore::InstallHandlers).
ucs_status_t OnStagedMessage(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_STAGED_ENGINE_H_
