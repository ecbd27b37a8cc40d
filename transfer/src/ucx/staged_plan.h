// The chunk planner of the UCX transport's staged device path (private to transfer/): how
// a write's segments are cut into chunks that each fit one bounce slot, and where each
// piece sits inside its chunk's staging area. Pure host code, shared by both sides: the
// sender plans, and the receiver recomputes the staging offsets of a chunk from the
// (remote offset, length) table that travels with it (StagingLayout), so the two agree
// without the offsets crossing the wire.
//
// Rules:
// - Segments contiguous on both sides (the next one starts where the previous one ended,
//   locally and remotely) are coalesced first, so that block runs move as one piece.
// - A piece is at most kStagedPieceBytes (the copy kernel gives one CTA to one piece), and
//   a chunk holds at most `chunk_bytes` staged bytes and kMaxStagedPiecesPerChunk pieces.
// - Inside a chunk, each piece starts at the next multiple of kStagingAlignment after the
//   previous one, so that aligned blocks stay aligned for 16-byte vector copies; the
//   padding counts against `chunk_bytes`. The last piece of a segment split across chunks
//   continues in the next chunk.
// - Empty segments are dropped; a write with no bytes has no chunks.
#ifndef KVSTREAM_TRANSFER_SRC_UCX_STAGED_PLAN_H_
#define KVSTREAM_TRANSFER_SRC_UCX_STAGED_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {
namespace internal {

inline constexpr uint64_t kStagedPieceBytes = uint64_t{64} << 10;
inline constexpr uint32_t kMaxStagedPiecesPerChunk = 4096;
inline constexpr uint64_t kStagingAlignment = 16;
// Bounds on a slot's size (UcxTransportOptions::staged_chunk_bytes).
inline constexpr uint64_t kMinStagedChunkBytes = kStagedPieceBytes;
inline constexpr uint64_t kMaxStagedChunkBytes = uint64_t{256} << 20;

struct StagedPiece {
  uint64_t local_offset = 0;    // in the sender's region
  uint64_t remote_offset = 0;   // in the receiver's region
  uint64_t length = 0;          // 1 .. kStagedPieceBytes
  uint64_t staging_offset = 0;  // in the chunk's staging area
};

struct StagedChunk {
  uint64_t staged_bytes = 0;  // end of the last piece in the staging area
  std::vector<StagedPiece> pieces;
};

// The chunks of a write of `segments`. InvalidArgument when chunk_bytes is not a multiple
// of kStagingAlignment or lies outside [kMinStagedChunkBytes, kMaxStagedChunkBytes].
// Segment bounds are the caller's to check.
absl::StatusOr<std::vector<StagedChunk>> PlanStagedChunks(absl::Span<const Segment> segments,
                                                          uint64_t chunk_bytes);

// The staging offset of a piece that follows one ending at `end` (the alignment rule).
inline uint64_t NextStagingOffset(uint64_t end) {
  return (end + kStagingAlignment - 1) / kStagingAlignment * kStagingAlignment;
}

// The staged bytes of a chunk whose pieces have these lengths, in order, filling
// `staging_offsets` (one per piece). InvalidArgument for a zero or over-long piece, or when
// the chunk would not fit `chunk_bytes`: the receiver's check of a table from the wire.
absl::StatusOr<uint64_t> StagingLayout(absl::Span<const uint64_t> lengths, uint64_t chunk_bytes,
                                       std::vector<uint64_t>* staging_offsets);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_STAGED_PLAN_H_
