// The nccl transport's batch planner (nccl_plan.h).
#include "nccl/nccl_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "segment_check.h"

namespace kvstream {
namespace internal {
namespace {

// Builds one batch at a time (the writer rules of nccl_plan.h).
class WritePlanner {
 public:
  explicit WritePlanner(const NcclPlanLimits& limits) : limits_(limits) {}

  void AddRun(const Segment& run) {
    if (run.length >= limits_.in_place_min_bytes) {
      // Room for this message and the packed one that may follow.
      if (messages() + 1 + (packed_.empty() ? 0 : 1) > limits_.max_messages ||
          pieces() + 1 > limits_.max_pieces) {
        CloseBatch();
      }
      batch_.header.message_pieces.push_back(1);
      batch_.header.pieces.push_back({run.remote_offset, run.length});
      batch_.messages.push_back({run.length, true, run.local_offset});
      return;
    }
    Segment rest = run;
    while (rest.length > 0) {
      if (packed_bytes_ == limits_.staged_bytes || pieces() + 1 > limits_.max_pieces ||
          (packed_.empty() && messages() + 1 > limits_.max_messages)) {
        CloseBatch();
      }
      const uint64_t take = std::min(rest.length, limits_.staged_bytes - packed_bytes_);
      packed_.push_back({rest.local_offset, rest.remote_offset, take});
      packed_bytes_ += take;
      rest.local_offset += take;
      rest.remote_offset += take;
      rest.length -= take;
    }
  }

  std::vector<NcclSendBatch> Finish() {
    CloseBatch();
    return std::move(batches_);
  }

 private:
  size_t messages() const { return batch_.messages.size(); }
  size_t pieces() const { return batch_.header.pieces.size() + packed_.size(); }

  void FlushPacked() {
    if (packed_.empty()) return;
    bool contiguous = true;
    for (size_t i = 1; i < packed_.size(); ++i) {
      contiguous = contiguous &&
                   packed_[i - 1].local_offset + packed_[i - 1].length == packed_[i].local_offset;
    }
    batch_.header.message_pieces.push_back(static_cast<uint32_t>(packed_.size()));
    uint64_t staging = 0;
    for (const Segment& p : packed_) {
      batch_.header.pieces.push_back({p.remote_offset, p.length});
      if (!contiguous) batch_.gather.push_back({p.local_offset, staging, p.length});
      staging += p.length;
    }
    if (contiguous) {
      batch_.messages.push_back({packed_bytes_, true, packed_.front().local_offset});
    } else {
      batch_.messages.push_back({packed_bytes_, false, 0});
      batch_.staged_bytes = packed_bytes_;
    }
    packed_.clear();
    packed_bytes_ = 0;
  }

  void CloseBatch() {
    FlushPacked();
    if (!batch_.messages.empty()) batches_.push_back(std::move(batch_));
    batch_ = NcclSendBatch();
  }

  const NcclPlanLimits limits_;
  std::vector<NcclSendBatch> batches_;
  NcclSendBatch batch_;
  std::vector<Segment> packed_;  // local offset, remote offset, length
  uint64_t packed_bytes_ = 0;
};

}  // namespace

absl::StatusOr<std::vector<NcclSendBatch>> PlanNcclWrite(absl::Span<const Segment> segments,
                                                         const NcclPlanLimits& limits) {
  if (limits.staged_bytes == 0 || limits.in_place_min_bytes == 0 ||
      limits.in_place_min_bytes > limits.staged_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl plan: in_place_min_bytes ", limits.in_place_min_bytes,
        " must be in 1..staged_bytes (", limits.staged_bytes, ")"));
  }
  if (limits.max_messages < 1 || limits.max_messages > kMaxNcclMessagesPerBatch ||
      limits.max_pieces < 1 || limits.max_pieces > kMaxNcclPiecesPerBatch) {
    return absl::InvalidArgumentError(absl::StrCat("nccl plan: max_messages ",
                                                   limits.max_messages, " or max_pieces ",
                                                   limits.max_pieces, " out of range"));
  }
  WritePlanner planner(limits);
  for (const Segment& run : CoalesceSegments(segments)) planner.AddRun(run);
  return planner.Finish();
}

absl::StatusOr<NcclRecvBatch> PlanNcclReceive(const NcclBatchHeader& header,
                                              uint64_t region_length, uint64_t max_staged_bytes) {
  NcclRecvBatch batch;
  size_t next = 0;
  for (size_t m = 0; m < header.message_pieces.size(); ++m) {
    const size_t first = next;
    const size_t end = first + header.message_pieces[m];
    if (end > header.pieces.size()) {
      return absl::InvalidArgumentError("nccl batch: the messages name more pieces than it has");
    }
    uint64_t bytes = 0;
    bool contiguous = true;
    for (size_t i = first; i < end; ++i) {
      const NcclRemotePiece& p = header.pieces[i];
      if (p.length == 0 || !SegmentFits(p.offset, p.length, region_length)) {
        return absl::OutOfRangeError(absl::StrCat(
            "nccl batch ", header.serial, ": piece ", i, " (offset ", p.offset, ", length ",
            p.length, ") is outside the destination region (", region_length, " bytes)"));
      }
      if (i > first) {
        const NcclRemotePiece& prev = header.pieces[i - 1];
        contiguous = contiguous && prev.offset + prev.length == p.offset;
      }
      bytes += p.length;  // cannot overflow: every piece lies inside the region
    }
    if (contiguous) {
      batch.messages.push_back({bytes, true, header.pieces[first].offset});
    } else {
      if (bytes > max_staged_bytes - batch.staged_bytes) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "nccl batch ", header.serial, " needs more than the ", max_staged_bytes,
            " staged bytes the receiver holds per batch"));
      }
      batch.messages.push_back({bytes, false, batch.staged_bytes});
      uint64_t staging = batch.staged_bytes;
      for (size_t i = first; i < end; ++i) {
        batch.scatter.push_back({staging, header.pieces[i].offset, header.pieces[i].length});
        staging += header.pieces[i].length;
      }
      batch.staged_bytes = staging;
    }
    next = end;
  }
  if (next != header.pieces.size()) {
    return absl::InvalidArgumentError("nccl batch: pieces left over after its messages");
  }
  return batch;
}

size_t CountCopyEntries(absl::Span<const Segment> segments, uint64_t max_piece) {
  size_t n = 0;
  for (const Segment& s : segments) n += static_cast<size_t>((s.length + max_piece - 1) / max_piece);
  return n;
}

size_t FillCopyEntries(absl::Span<const Segment> segments, const char* src_base, char* dst_base,
                       uint64_t max_piece, IpcCopySegment* out) {
  size_t k = 0;
  for (const Segment& s : segments) {
    for (uint64_t done = 0; done < s.length; done += max_piece) {
      IpcCopySegment& e = out[k++];
      e.src = reinterpret_cast<uint64_t>(src_base + s.local_offset + done);
      e.dst = reinterpret_cast<uint64_t>(dst_base + s.remote_offset + done);
      e.length = std::min(max_piece, s.length - done);
      e.first_chunk = 0;
    }
  }
  return k;
}

}  // namespace internal
}  // namespace kvstream
