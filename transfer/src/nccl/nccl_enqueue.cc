// A batch's GPU work on either side of a link (nccl_transport.h, "How it works"): the plan
// of a write, the gather and the send group on the writer, the receive group and the scatter
// on the receiver, and the events that order them. Nothing here waits for the device: every
// dependency is a stream waiting for an event.
//
// Writer, batch b in staging slot s:
//   copy stream:  wait ready (captured at post), wait slot_free[s], gather kernel, record step
//   NCCL stream:  wait step (or ready, when nothing is gathered), group of ncclSend, record
//                 done and slot_free[s]
// Receiver, batch b in slot s:
//   NCCL stream:  wait slot_free[s], group of ncclRecv, record step (landed when in place)
//   copy stream:  wait step, scatter kernel, record landed and slot_free[s]
// A slot is therefore rewritten only after the device finished the send (or the scatter) of
// the batch that used it last, and two slots let one batch's gather or scatter overlap the
// neighbouring batch's NCCL operations.
#include <cuda_runtime.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cuda_ipc/copy_kernel.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"
#include "nccl/nccl_transport_impl.h"
#include "ucx/staged_cuda.h"

namespace kvstream {
namespace internal {
namespace {

constexpr int kCopyVectors = 8;

// Each op of a group is one message of the batch, in header order.
std::vector<NcclOp> GroupOps(const std::vector<NcclMessagePlace>& messages, bool send,
                             char* region, char* staging) {
  std::vector<NcclOp> ops;
  ops.reserve(messages.size());
  for (const NcclMessagePlace& m : messages) {
    ops.push_back({send, (m.in_place ? region : staging) + m.offset, m.bytes});
  }
  return ops;
}

}  // namespace

absl::Status NcclTransport::EnsureSlot(LinkGpu& gpu, int slot) {
  if (!gpu.staging[slot].empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(gpu.staging[slot],
                   DeviceBuffer::Create(options_.staging_bytes, MemoryKind::kDevice));
  return absl::OkStatus();
}

absl::StatusOr<bool> NcclTransport::ReserveTable(LinkGpu& gpu, absl::Span<const Segment> segments,
                                                 const char* src_base, char* dst_base,
                                                 size_t* begin, size_t* entries) {
  const size_t n = CountCopyEntries(segments, options_.max_piece_bytes);
  if (n > gpu.tables->capacity()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "nccl: a batch's copy table of ", n, " entries exceeds the ring of ",
        gpu.tables->capacity()));
  }
  std::optional<size_t> run = gpu.tables->Reserve(n);
  if (!run) return false;
  const size_t written = FillCopyEntries(segments, src_base, dst_base, options_.max_piece_bytes,
                                         gpu.tables->host(*run));
  if (written != n) {
    gpu.tables->ReleaseNewest();
    return absl::InternalError(absl::StrCat("nccl: planned ", n, " copy entries, wrote ", written));
  }
  *begin = *run;
  *entries = n;
  return true;
}

absl::Status NcclTransport::LaunchCopy(LinkGpu& gpu, size_t begin, size_t entries) {
  const int grid = static_cast<int>(std::min<size_t>(entries, static_cast<size_t>(copy_grid_)));
  // The cuda_ipc transport's per-segment kernel, reading its table from the pinned ring in
  // place (the cheapest post on the host, as measured there).
  return LaunchIpcSegmentCopy(gpu.tables->mapped(begin), static_cast<uint32_t>(entries),
                              IpcTableSource::kZeroCopy, IpcCopyUnit::kCta, kCopyVectors, grid,
                              gpu.copy.get());
}

absl::StatusOr<bool> NcclTransport::IssueGroup(NcclLink& link, int peer,
                                               const std::vector<NcclOp>& ops) {
  const NcclPoll poll = IssueNcclGroup(link.comm, peer, ops, link.gpu->nccl.get(), link.label);
  switch (link.state.OnGroupEnd(poll, absl::Now())) {
    case CommAction::kIssued: return true;
    case CommAction::kAbort: return link.state.status();
    default: return false;
  }
}

absl::Status NcclTransport::PlanWrites(SendLink& link) {
  while (!link.unplanned.empty()) {
    SendWrite write = std::move(link.unplanned.front());
    link.unplanned.pop_front();
    auto t = transfers_.find(write.transfer);
    if (t == transfers_.end() || t->second.phase == NcclPhase::kFailed) continue;
    ASSIGN_OR_RETURN(std::vector<NcclSendBatch> batches,
                     PlanNcclWrite(write.segments, link.limits));
    t->second.planned = true;
    t->second.batches_left = batches.size();
    for (NcclSendBatch& plan : batches) {
      SendBatch batch;
      batch.transfer = write.transfer;
      batch.plan = std::move(plan);
      batch.plan.header.region_id = write.region_id;
      batch.local_base = write.local_base;
      batch.ready = write.ready;
      link.batches.push_back(std::move(batch));
    }
  }
  return absl::OkStatus();
}

absl::Status NcclTransport::IssueSends(NcclPeer& peer) {
  SendLink& link = *peer.send;
  LinkGpu& gpu = *link.gpu;
  auto next = link.batches.begin();
  while (link.welcomed && link.state.ready()) {
    while (next != link.batches.end() && next->phase != BatchPhase::kQueued) ++next;
    if (next == link.batches.end()) return absl::OkStatus();
    SendBatch& batch = *next;
    auto t = transfers_.find(batch.transfer);
    if (t == transfers_.end() || t->second.phase == NcclPhase::kFailed) {
      // Released or cancelled before its header left: the receiver never hears of it.
      next = link.batches.erase(next);
      continue;
    }
    cudaStream_t nccl = gpu.nccl.get();
    int slot = -1;
    if (batch.plan.staged_bytes > 0) {
      slot = gpu.next_slot;
      RETURN_IF_ERROR(EnsureSlot(gpu, slot));
      size_t begin = 0;
      size_t entries = 0;
      ASSIGN_OR_RETURN(const bool reserved,
                       ReserveTable(gpu, batch.plan.gather, batch.local_base,
                                    gpu.staging[slot].data_as<char>(), &begin, &entries));
      if (!reserved) return absl::OkStatus();  // the ring frees up as batches complete
      batch.table_entries = entries;
      gpu.next_slot = (slot + 1) % kNcclStagingSlots;
      batch.slot = slot;
      if (batch.ready != nullptr) RETURN_IF_ERROR(batch.ready->MakeStreamWait(gpu.copy.get()));
      if (gpu.recorded[slot]) RETURN_IF_ERROR(gpu.slot_free[slot].MakeStreamWait(gpu.copy.get()));
      RETURN_IF_ERROR(LaunchCopy(gpu, begin, entries));
      RETURN_IF_ERROR(gpu.step.Record(gpu.copy.get()));
      RETURN_IF_ERROR(gpu.step.MakeStreamWait(nccl));
    } else if (batch.ready != nullptr) {
      RETURN_IF_ERROR(batch.ready->MakeStreamWait(nccl));
    }
    // The table goes ahead of the data, so that the receiver posts the matching receives.
    batch.plan.header.serial = link.next_serial++;
    link.conn->QueueFrame(static_cast<uint8_t>(NcclFrameType::kBatch),
                          EncodeNcclBatch(batch.plan.header));
    RETURN_IF_ERROR(link.conn->Flush());
    char* staging = slot >= 0 ? gpu.staging[slot].data_as<char>() : nullptr;
    const std::vector<NcclOp> ops = GroupOps(
        batch.plan.messages, /*send=*/true, const_cast<char*>(batch.local_base), staging);
    batch.issued_at = absl::Now();
    ASSIGN_OR_RETURN(const bool issued, IssueGroup(link, /*peer=*/1, ops));
    if (!issued) {
      batch.phase = BatchPhase::kIssuing;
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(FinishSend(link, batch));
  }
  return absl::OkStatus();
}

absl::Status NcclTransport::FinishSend(SendLink& link, SendBatch& batch) {
  LinkGpu& gpu = *link.gpu;
  ASSIGN_OR_RETURN(batch.done, TakeEvent());
  RETURN_IF_ERROR(batch.done.Record(gpu.nccl.get()));
  if (batch.slot >= 0) {
    RETURN_IF_ERROR(gpu.slot_free[batch.slot].Record(gpu.nccl.get()));
    gpu.recorded[batch.slot] = true;
  }
  batch.phase = BatchPhase::kIssued;
  return absl::OkStatus();
}

absl::Status NcclTransport::IssueReceives(NcclPeer& peer) {
  RecvLink& link = *peer.recv;
  LinkGpu& gpu = *link.gpu;
  auto next = link.batches.begin();
  while (link.state.ready()) {
    while (next != link.batches.end() && next->phase != BatchPhase::kQueued) ++next;
    if (next == link.batches.end()) return absl::OkStatus();
    RecvBatch& batch = *next;
    cudaStream_t nccl = gpu.nccl.get();
    int slot = -1;
    if (batch.plan.staged_bytes > 0) {
      slot = gpu.next_slot;
      RETURN_IF_ERROR(EnsureSlot(gpu, slot));
      size_t begin = 0;
      size_t entries = 0;
      ASSIGN_OR_RETURN(const bool reserved,
                       ReserveTable(gpu, batch.plan.scatter, gpu.staging[slot].data_as<char>(),
                                    batch.region_base, &begin, &entries));
      if (!reserved) return absl::OkStatus();
      batch.table_begin = begin;
      batch.table_entries = entries;
      gpu.next_slot = (slot + 1) % kNcclStagingSlots;
      batch.slot = slot;
      if (gpu.recorded[slot]) RETURN_IF_ERROR(gpu.slot_free[slot].MakeStreamWait(nccl));
    }
    char* staging = slot >= 0 ? gpu.staging[slot].data_as<char>() : nullptr;
    const std::vector<NcclOp> ops = GroupOps(
        batch.plan.messages, /*send=*/false, batch.region_base, staging);
    batch.issued_at = absl::Now();
    ASSIGN_OR_RETURN(const bool issued, IssueGroup(link, /*peer=*/0, ops));
    if (!issued) {
      batch.phase = BatchPhase::kIssuing;
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(FinishReceive(link, batch));
  }
  return absl::OkStatus();
}

absl::Status NcclTransport::FinishReceive(RecvLink& link, RecvBatch& batch) {
  LinkGpu& gpu = *link.gpu;
  ASSIGN_OR_RETURN(batch.landed, TakeEvent());
  if (batch.table_entries == 0) {
    RETURN_IF_ERROR(batch.landed.Record(gpu.nccl.get()));
  } else {
    RETURN_IF_ERROR(gpu.step.Record(gpu.nccl.get()));
    RETURN_IF_ERROR(gpu.step.MakeStreamWait(gpu.copy.get()));
    RETURN_IF_ERROR(LaunchCopy(gpu, batch.table_begin, batch.table_entries));
    RETURN_IF_ERROR(batch.landed.Record(gpu.copy.get()));
    RETURN_IF_ERROR(gpu.slot_free[batch.slot].Record(gpu.copy.get()));
    gpu.recorded[batch.slot] = true;
  }
  batch.phase = BatchPhase::kIssued;
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace kvstream
