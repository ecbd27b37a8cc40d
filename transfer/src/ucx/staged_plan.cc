// The staged path's chunk planner (staged_plan.h).
#include "ucx/staged_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "segment_check.h"

namespace kvstream {
namespace internal {

absl::StatusOr<std::vector<StagedChunk>> PlanStagedChunks(absl::Span<const Segment> segments,
                                                          uint64_t chunk_bytes) {
  if (chunk_bytes % kStagingAlignment != 0 || chunk_bytes < kMinStagedChunkBytes ||
      chunk_bytes > kMaxStagedChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "staged chunk size ", chunk_bytes, " is not a multiple of ", kStagingAlignment,
        " in [", kMinStagedChunkBytes, ", ", kMaxStagedChunkBytes, "]"));
  }
  const std::vector<Segment> runs = CoalesceSegments(segments);
  std::vector<StagedChunk> chunks;
  StagedChunk current;
  auto flush = [&] {
    if (!current.pieces.empty()) chunks.push_back(std::move(current));
    current = StagedChunk();
  };
  for (const Segment& run : runs) {
    uint64_t done = 0;
    while (done < run.length) {
      uint64_t offset = NextStagingOffset(current.staged_bytes);
      if (current.pieces.size() == kMaxStagedPiecesPerChunk || offset >= chunk_bytes) {
        flush();
        offset = 0;
      }
      const uint64_t length =
          std::min({run.length - done, kStagedPieceBytes, chunk_bytes - offset});
      StagedPiece piece;
      piece.local_offset = run.local_offset + done;
      piece.remote_offset = run.remote_offset + done;
      piece.length = length;
      piece.staging_offset = offset;
      current.pieces.push_back(piece);
      current.staged_bytes = offset + length;
      done += length;
    }
  }
  flush();
  return chunks;
}

absl::StatusOr<uint64_t> StagingLayout(absl::Span<const uint64_t> lengths, uint64_t chunk_bytes,
                                       std::vector<uint64_t>* staging_offsets) {
  staging_offsets->clear();
  staging_offsets->reserve(lengths.size());
  uint64_t end = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const uint64_t length = lengths[i];
    if (length == 0 || length > kStagedPieceBytes) {
      return absl::InvalidArgumentError(absl::StrCat("staged piece ", i, " has length ", length,
                                                     " (allowed 1..", kStagedPieceBytes, ")"));
    }
    const uint64_t offset = i == 0 ? 0 : NextStagingOffset(end);
    if (offset > chunk_bytes || length > chunk_bytes - offset) {
      return absl::InvalidArgumentError(absl::StrCat("staged piece ", i, " ends past the ",
                                                     chunk_bytes, "-byte chunk"));
    }
    staging_offsets->push_back(offset);
    end = offset + length;
  }
  return end;
}

}  // namespace internal
}  // namespace kvstream
