// The receiving side of the staged device path (staged_receiver.h; protocol in
// staged_engine.h). Everything a sender says is checked against this side's state before
// any GPU work is enqueued: a chunk names an idle slot of its sender's landing area, a
// region this transport registered, and pieces inside that region whose layout fits a
// slot; anything else is dropped with a warning (and its slot credited back where one is
// named), never copied.
#include "ucx/staged_receiver.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "ucx/staged_cuda.h"
#include "ucx/ucx_status.h"

namespace kvstream {
namespace internal {
namespace {

// How far ahead of the oldest unlanded write a sender's sequence numbers may run.
constexpr uint64_t kMaxSeqAhead = uint64_t{1} << 20;

void Warn(const UcxPeer& peer, absl::string_view what) {
  Log(LogLevel::kWarning, absl::StrCat("UCX staged path: dropped ", what, " from ", peer.label));
}

StagedIn& InState(UcxPeer* peer) {
  if (peer->in == nullptr) peer->in = std::make_unique<StagedIn>();
  return *peer->in;
}

// Moves `landed` past every write whose chunks have all landed, then delivers the
// notifications that waited for them.
void Advance(UcxCore* core, StagedIn& in) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  while (!in.seqs.empty()) {
    auto it = in.seqs.begin();
    const StagedIn::SeqProgress& p = it->second;
    if (it->first != in.landed || p.expected < 0 ||
        static_cast<int64_t>(p.landed) < p.expected) {
      break;
    }
    in.seqs.erase(it);
    ++in.landed;
  }
  while (!in.held.empty() && in.held.front().watermark <= in.landed) {
    core->inbox.push_back(std::move(in.held.front().notification));
    in.held.pop_front();
  }
}

// The landing area for `peer`'s writes, allocated on its first hello. Nothing of it is
// kept unless all of it could be had (the ordering state in `in` stays either way).
absl::Status EnsureLanding(UcxCore* core, UcxPeer* peer) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  StagedIn& in = InState(peer);
  if (in.landing != nullptr) return absl::OkStatus();
  const StagedOptions& options = core->staged->options;
  const uint64_t total = uint64_t{options.slots} * options.chunk_bytes;
  ucp_mem_map_params_t params;
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = nullptr;
  params.length = total;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  RETURN_IF_ERROR(UcxStatusToStatus(ucp_mem_map(core->context.get(), &params, &memh),
                                    "mem_map (staged landing area)"));
  auto owned = std::make_unique<UcxMemHandle>(core->context.get(), memh);
  ucp_mem_attr_t attr;
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  RETURN_IF_ERROR(UcxStatusToStatus(ucp_mem_query(memh, &attr), "mem_query"));
  if (attr.address == nullptr || attr.length < total) {
    return absl::InternalError("UCX staged landing area: UCX returned too little memory");
  }
  void* packed = nullptr;
  size_t packed_size = 0;
  RETURN_IF_ERROR(UcxStatusToStatus(ucp_rkey_pack(core->context.get(), memh, &packed,
                                                  &packed_size),
                                    "rkey_pack (staged landing area)"));
  UcxMemoryDescriptor d;
  d.kind = UcxRegionKind::kHost;
  d.address = reinterpret_cast<uintptr_t>(attr.address);
  d.length = total;
  d.rkey.assign(static_cast<const char*>(packed), packed_size);
  ucp_rkey_buffer_release(packed);
  CudaDeviceScope scope(core->staged->device);
  RETURN_IF_ERROR(scope.status());
  std::vector<std::unique_ptr<ReceiverSlot>> slots;
  for (uint32_t i = 0; i < options.slots; ++i) {
    auto slot = std::make_unique<ReceiverSlot>();
    ASSIGN_OR_RETURN(slot->buffers, NewSlotBuffers(options.chunk_bytes));
    slots.push_back(std::move(slot));
  }
  RETURN_IF_ERROR(HostRegister(attr.address, total, "staged landing area"));
  in.landing_memh = std::move(owned);
  in.landing = static_cast<char*>(attr.address);
  in.landing_locked = true;
  in.slot_bytes = options.chunk_bytes;
  in.landing_descriptor = EncodeMemoryDescriptor(d);
  in.slots = std::move(slots);
  return absl::OkStatus();
}

void HandleHello(UcxCore* core, UcxPeer* peer, const StagedInbound& m)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  absl::StatusOr<std::string> info_bytes = DecodeHello(m.body);
  absl::StatusOr<UcxWorkerInfo> info =
      info_bytes.ok() ? DecodeWorkerInfo(*info_bytes) : info_bytes.status();
  if (!info.ok() || info->uid != m.header.sender_uid) {
    Warn(*peer, absl::StrCat("a bad hello: ",
                             info.ok() ? "its uid does not match" : info.status().message()));
    return;
  }
  if (!peer->ep) {
    // Credits and the welcome travel back over an endpoint of our own.
    peer->stamp = std::max(peer->stamp, info->fence_epoch);
    absl::Status connected = core->ConnectPeer(peer, info->address);
    if (!connected.ok()) {
      Log(LogLevel::kWarning, absl::StrCat("UCX staged path: cannot connect back to ",
                                           peer->label, ": ", connected.message()));
      return;
    }
  }
  StagedWelcome welcome;
  absl::Status status = core->staged == nullptr
                            ? absl::FailedPreconditionError("no device memory is registered")
                            : EnsureLanding(core, peer);
  if (status.ok()) {
    welcome.ok = true;
    welcome.slots = static_cast<uint32_t>(peer->in->slots.size());
    welcome.slot_bytes = peer->in->slot_bytes;
    welcome.landing_descriptor = peer->in->landing_descriptor;
  } else {
    welcome.reason = std::string(status.message());
  }
  core->SendControl(peer, StagedType::kWelcome, EncodeWelcome(welcome));
}

// Whether `seq` is one this side still waits for (not landed, not absurdly far ahead).
bool SeqInWindow(const StagedIn& in, uint64_t seq) {
  return seq >= in.landed && seq - in.landed < kMaxSeqAhead;
}

// Enqueues the scatter of a checked chunk; false when nothing was enqueued.
bool StartScatter(UcxCore* core, StagedIn& in, ReceiverSlot& slot, uint32_t index,
                  const DeviceRegion& region, const StagedChunkMessage& chunk,
                  const std::vector<uint64_t>& staging, uint64_t staged_bytes)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto* table = slot.buffers.host_table.data_as<SegmentCopyEntry>();
  for (size_t i = 0; i < chunk.pieces.size(); ++i) {
    table[i] = SegmentCopyEntry{staging[i], chunk.pieces[i].remote_offset,
                                chunk.pieces[i].length};
  }
  void* stream = core->staged->scatter[index % 2].get();
  SegmentCopyParams params;
  params.src = slot.buffers.staging.data_as<char>();
  params.dst = region.base;
  params.entries = slot.buffers.table.data_as<SegmentCopyEntry>();
  params.count = static_cast<uint32_t>(chunk.pieces.size());
  CudaDeviceScope scope(core->staged->device);
  absl::Status status = scope.status();
  if (status.ok()) {
    status = CopyAsync(slot.buffers.staging.data(), in.landing + uint64_t{index} * in.slot_bytes,
                       staged_bytes, stream, "cudaMemcpyAsync (staged host to device)");
  }
  if (status.ok()) {
    status = CopyAsync(slot.buffers.table.data(), table,
                       chunk.pieces.size() * sizeof(SegmentCopyEntry), stream,
                       "cudaMemcpyAsync (staged scatter table)");
  }
  if (status.ok()) status = SegmentCopyAsync(params, stream, "staged scatter kernel");
  const absl::Status recorded = scope.status().ok() ? slot.buffers.done.Record(stream)
                                                     : scope.status();
  if (!status.ok() || !recorded.ok()) {
    Log(LogLevel::kError, absl::StrCat("UCX staged path: scatter failed: ",
                                       (status.ok() ? recorded : status).message()));
  }
  if (!recorded.ok()) return false;
  slot.scattering = true;
  slot.seq = chunk.seq;
  slot.region_id = chunk.region_id;
  return true;
}

void HandleChunk(UcxCore* core, UcxPeer* peer, const StagedInbound& m)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  absl::StatusOr<StagedChunkMessage> chunk = DecodeChunk(m.body);
  if (!chunk.ok()) {
    Warn(*peer, absl::StrCat("a malformed chunk: ", chunk.status().message()));
    return;
  }
  StagedIn& in = InState(peer);
  if (in.landing == nullptr || chunk->slot >= in.slots.size() ||
      in.slots[chunk->slot]->scattering || core->staged == nullptr) {
    Warn(*peer, absl::StrCat("a chunk into slot ", chunk->slot, ", which is not idle"));
    return;
  }
  ReceiverSlot& slot = *in.slots[chunk->slot];
  if (!SeqInWindow(in, chunk->seq)) {
    Warn(*peer, absl::StrCat("a chunk of write ", chunk->seq, " (waiting for ", in.landed, ")"));
    in.credits.push_back(chunk->slot);
    return;
  }
  StagedIn::SeqProgress& progress = in.seqs[chunk->seq];
  if (!progress.aborted) progress.expected = chunk->count;
  std::vector<uint64_t> lengths;
  lengths.reserve(chunk->pieces.size());
  for (const StagedChunkPiece& p : chunk->pieces) lengths.push_back(p.length);
  std::vector<uint64_t> staging;
  absl::StatusOr<uint64_t> staged_bytes = StagingLayout(lengths, in.slot_bytes, &staging);
  auto region = core->device_regions.find(chunk->region_id);
  bool fits = staged_bytes.ok() && region != core->device_regions.end();
  for (size_t i = 0; fits && i < chunk->pieces.size(); ++i) {
    const StagedChunkPiece& p = chunk->pieces[i];
    fits = p.length <= region->second.length &&
           p.remote_offset <= region->second.length - p.length;
  }
  if (!fits || !StartScatter(core, in, slot, chunk->slot, region->second, *chunk, staging,
                             *staged_bytes)) {
    if (!fits) {
      Warn(*peer, absl::StrCat("a chunk of write ", chunk->seq, " outside region ",
                               chunk->region_id, " (unknown, destroyed, or out of bounds)"));
    }
    // Counted as landed, so that later notifications from this sender are not held forever.
    ++progress.landed;
    in.credits.push_back(chunk->slot);
    Advance(core, in);
  }
}

void HandleAbort(UcxCore* core, UcxPeer* peer, const StagedInbound& m)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  absl::StatusOr<StagedAbort> abort = DecodeAbort(m.body);
  if (!abort.ok()) {
    Warn(*peer, absl::StrCat("a malformed abort: ", abort.status().message()));
    return;
  }
  StagedIn& in = InState(peer);
  if (!SeqInWindow(in, abort->seq)) return;
  StagedIn::SeqProgress& progress = in.seqs[abort->seq];
  progress.aborted = true;
  progress.expected = abort->chunks_sent;
  Advance(core, in);
}

}  // namespace

StagedIn::~StagedIn() {
  if (landing_locked) HostUnregister(landing);
  landing_memh.reset();  // unmaps (and frees) the landing area, after it was unlocked
}

void HandleReceived(UcxCore* core, UcxPeer* peer, const StagedInbound& message) {
  switch (message.header.type) {
    case StagedType::kHello:
      HandleHello(core, peer, message);
      break;
    case StagedType::kChunk:
      HandleChunk(core, peer, message);
      break;
    case StagedType::kAbort:
      HandleAbort(core, peer, message);
      break;
    default:
      break;
  }
}

void PollReceiver(UcxCore* core, UcxPeer* peer) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  StagedIn& in = *peer->in;
  bool landed = false;
  for (uint32_t i = 0; i < in.slots.size(); ++i) {
    ReceiverSlot& slot = *in.slots[i];
    if (!slot.scattering) continue;
    absl::StatusOr<bool> done = slot.buffers.done.Query();
    if (done.ok() && !*done) continue;
    if (!done.ok()) {
      Log(LogLevel::kError, absl::StrCat("UCX staged path: a scatter from ", peer->label,
                                         " failed: ", done.status().message()));
    }
    slot.scattering = false;
    in.credits.push_back(i);
    auto it = in.seqs.find(slot.seq);
    if (it != in.seqs.end()) ++it->second.landed;
    landed = true;
  }
  if (landed) Advance(core, in);
  if (!in.credits.empty() && peer->ep && peer->status.ok()) {
    core->SendControl(peer, StagedType::kCredit, EncodeCredits(in.credits));
    in.credits.clear();
  }
}

bool ReceiverIdle(const UcxPeer& peer) {
  if (peer.in == nullptr) return true;
  for (const auto& slot : peer.in->slots) {
    if (slot->scattering) return false;
  }
  return true;
}

void CollectScatterEvents(const UcxPeer& peer, uint64_t region_id,
                          std::vector<const CudaEvent*>* events) {
  if (peer.in == nullptr) return;
  for (const auto& slot : peer.in->slots) {
    if (slot->scattering && slot->region_id == region_id) events->push_back(&slot->buffers.done);
  }
}

void DeliverNotification(UcxCore* core, UcxPeer* peer, uint64_t watermark, Notification n)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (watermark == 0 && (peer->in == nullptr || peer->in->held.empty())) {
    core->inbox.push_back(std::move(n));
    return;
  }
  StagedIn& in = InState(peer);
  if (watermark <= in.landed && in.held.empty()) {
    core->inbox.push_back(std::move(n));
    return;
  }
  in.held.push_back(StagedIn::Held{watermark, std::move(n)});
}

void StagedPeerFailed(UcxCore* core, UcxPeer* peer) {
  if (peer->in == nullptr || peer->in->held.empty()) return;
  Log(LogLevel::kWarning, absl::StrCat("UCX staged path: ", peer->in->held.size(),
                                       " notifications from ", peer->label,
                                       " dropped: it failed before their data landed"));
  peer->in->held.clear();
}

}  // namespace internal
}  // namespace kvstream
