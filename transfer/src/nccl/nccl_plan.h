// The nccl transport's batch planner (private to transfer/): how a write's segments become
// batches of messages for the writer, and what a batch header from the wire means for the
// receiver. Pure host code, shared by both sides, tested without a GPU.
//
// A batch is one NCCL group on the link's communicator: its messages are the group's
// ncclSend calls on the writer and, in the same order, ncclRecv calls on the receiver (NCCL
// matches the sends and receives between two ranks in order). Each side decides for itself
// where a message's bytes are: a message whose bytes form one range on that side moves in
// place (sent from, or received into, the region itself); any other is gathered into (on
// the writer) or scattered from (on the receiver) that side's staging slot, by one copy
// kernel per batch and side.
//
// Writer rules (PlanNcclWrite):
// - Segments contiguous on both sides are coalesced first (CoalesceSegments).
// - A run of at least in_place_min_bytes is a message of its own (in place on both sides).
// - Shorter runs are packed, in order, into the batch's one packed message, whose bytes
//   fill the staging slot from offset 0 (no padding: the n-th byte of the message is the
//   n-th byte of the slot); a run that does not fit the slot's rest is split, and the batch
//   closed. When the packed pieces happen to be one local range, the message is sent in
//   place and nothing is gathered.
// - A batch holds at most max_messages messages and max_pieces pieces (its frame must fit
//   the side connection's frame limit); the packed message comes last.
// - Empty segments are dropped; a write with no bytes has no batch.
#ifndef KVSTREAM_TRANSFER_SRC_NCCL_NCCL_PLAN_H_
#define KVSTREAM_TRANSFER_SRC_NCCL_NCCL_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cuda_ipc/copy_kernel.h"
#include "kvstream/transfer/transport.h"
#include "nccl/nccl_wire.h"

namespace kvstream {
namespace internal {

struct NcclPlanLimits {
  uint64_t staged_bytes = 0;        // a staging slot: the most bytes one batch gathers
  uint64_t in_place_min_bytes = 0;  // runs at least this long move in place
  uint32_t max_messages = kMaxNcclMessagesPerBatch;
  uint32_t max_pieces = kMaxNcclPiecesPerBatch;
};

// Where one side keeps a message's bytes: in place (`offset` in the region) or in its
// staging slot (`offset` in the slot).
struct NcclMessagePlace {
  uint64_t bytes = 0;
  bool in_place = false;
  uint64_t offset = 0;
};

struct NcclSendBatch {
  NcclBatchHeader header;  // serial and region id are the caller's to fill
  std::vector<NcclMessagePlace> messages;
  // The gather: local offset -> staging offset (in Segment::remote_offset), length.
  std::vector<Segment> gather;
  uint64_t staged_bytes = 0;
};

// The batches of a write of `segments` (the caller has range-checked them). InvalidArgument
// for limits out of range (staged_bytes 0, in_place_min_bytes 0 or above staged_bytes,
// max_messages or max_pieces 0 or above the wire's bounds).
absl::StatusOr<std::vector<NcclSendBatch>> PlanNcclWrite(absl::Span<const Segment> segments,
                                                         const NcclPlanLimits& limits);

struct NcclRecvBatch {
  std::vector<NcclMessagePlace> messages;
  // The scatter: staging offset (in Segment::local_offset) -> region offset, length.
  std::vector<Segment> scatter;
  uint64_t staged_bytes = 0;
};

// Where the receiver puts the messages of `header` in a region of `region_length` bytes with
// a staging slot of `max_staged_bytes`. OutOfRange naming the piece for a piece outside the
// region; ResourceExhausted when the batch needs more staging than the slot holds (a peer
// that ignored the welcome's bound).
absl::StatusOr<NcclRecvBatch> PlanNcclReceive(const NcclBatchHeader& header,
                                              uint64_t region_length, uint64_t max_staged_bytes);

// The copy kernel's table for `segments` (bytes from src_base + local_offset to dst_base +
// remote_offset), each cut into entries of at most `max_piece` bytes so that a few long
// segments still spread over the GPU. CountCopyEntries says how many FillCopyEntries writes.
// REQUIRES: max_piece > 0; segment lengths > 0.
size_t CountCopyEntries(absl::Span<const Segment> segments, uint64_t max_piece);
size_t FillCopyEntries(absl::Span<const Segment> segments, const char* src_base, char* dst_base,
                       uint64_t max_piece, IpcCopySegment* out);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_NCCL_NCCL_PLAN_H_
