// The sending side of the staged device path and the pieces both sides share (protocol in
// staged_engine.h; the receiving side is in staged_receiver.cc).
#include "ucx/staged_engine.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/status_macros.h"
#include "ucx/staged_cuda.h"
#include "ucx/staged_receiver.h"
#include "ucx/ucx_memory.h"
#include "ucx/ucx_status.h"

namespace kvstream {
namespace internal {
namespace {

constexpr size_t kTableBytes = sizeof(SegmentCopyEntry) * kMaxStagedPiecesPerChunk;

UcxTransfer* ActiveTransfer(UcxCore* core, TransferId id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto it = core->transfers.find(id);
  if (it == core->transfers.end() || !it->second->active()) return nullptr;
  return it->second.get();
}

void IssueChunks(UcxCore* core, UcxPeer* peer);

// A chunk's message has been sent (or failed to be).
void ChunkSent(UcxCore* core, SenderSlot* slot, ucs_status_t status)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  UcxPeer* peer = slot->peer;
  UcxTransfer* t = ActiveTransfer(core, slot->transfer);
  if (status != UCS_OK) {
    // The endpoint has failed (its error callback fails the peer); the slot is lost with it.
    slot->state = SenderSlot::State::kBroken;
    if (t != nullptr) {
      core->FailTransfer(t, UcxStatusToStatus(status, "am_send_nbx (staged chunk)",
                                              peer->label));
    }
    return;
  }
  slot->state = SenderSlot::State::kAtPeer;
  if (t != nullptr && t->staged != nullptr) {
    ++t->staged->chunks_sent;
    if (StagedSendFinished(*t->staged)) core->Pump(peer);
  }
}

void OnChunkSent(void* request, ucs_status_t status, void* user_data) {
  auto* slot = static_cast<SenderSlot*>(user_data);
  ucp_request_free(request);
  slot->request = nullptr;
  ChunkSent(slot->peer->core, slot, status);
}

void SendChunk(UcxCore* core, SenderSlot* slot) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  UcxPeer* peer = slot->peer;
  UcxTransfer* t = ActiveTransfer(core, slot->transfer);
  if (t == nullptr || !peer->status.ok() || !peer->ep) {
    slot->state = SenderSlot::State::kFree;  // dropped: the receiver never saw the slot
    return;
  }
  ucp_request_param_t param;
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_EAGER;
  param.cb.send = OnChunkSent;
  param.user_data = slot;
  slot->state = SenderSlot::State::kSending;
  ucs_status_ptr_t request =
      ucp_am_send_nbx(peer->ep.get(), kStagedAmId, slot->header.data(), slot->header.size(),
                      slot->body.data(), slot->body.size(), &param);
  if (UCS_PTR_IS_ERR(request)) {
    slot->state = SenderSlot::State::kFree;
    core->FailTransfer(t, UcxStatusToStatus(UCS_PTR_STATUS(request),
                                            "am_send_nbx (staged chunk)", peer->label));
    return;
  }
  ++t->staged->chunks_posted;
  if (request == nullptr) {
    ChunkSent(core, slot, UCS_OK);
  } else {
    slot->request = request;
  }
}

void OnChunkFlushed(void* request, ucs_status_t status, void* user_data)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto* slot = static_cast<SenderSlot*>(user_data);
  ucp_request_free(request);
  slot->request = nullptr;
  UcxCore* core = slot->peer->core;
  if (status != UCS_OK) {
    slot->state = SenderSlot::State::kBroken;
    UcxTransfer* t = ActiveTransfer(core, slot->transfer);
    if (t != nullptr) {
      core->FailTransfer(t, UcxStatusToStatus(status, "ep_flush_nbx (staged chunk)",
                                              slot->peer->label));
    }
    return;
  }
  SendChunk(core, slot);
}

// Put mode: the bounce slot into the receiver's slot, flushed, then the chunk message.
void PutChunk(UcxCore* core, SenderSlot* slot) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  UcxPeer* peer = slot->peer;
  StagedOut& out = *peer->out;
  UcxTransfer* t = ActiveTransfer(core, slot->transfer);
  if (t == nullptr || !peer->status.ok() || !peer->ep) {
    slot->state = SenderSlot::State::kFree;
    return;
  }
  const uint64_t offset = uint64_t{slot->index} * out.slot_bytes;
  ucp_request_param_t put_param;
  put_param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
  put_param.memh = out.bounce_memh->get();
  ucs_status_ptr_t put =
      ucp_put_nbx(peer->ep.get(), out.bounce.data_as<char>() + offset, slot->staged_bytes,
                  out.landing_address + offset, out.rkey.get(), &put_param);
  if (UCS_PTR_IS_ERR(put)) {
    slot->state = SenderSlot::State::kFree;
    core->FailTransfer(t, UcxStatusToStatus(UCS_PTR_STATUS(put), "put_nbx (staged chunk)",
                                            peer->label));
    return;
  }
  if (UCS_PTR_IS_PTR(put)) ucp_request_free(put);  // the flush covers it
  ucp_request_param_t param;
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = OnChunkFlushed;
  param.user_data = slot;
  slot->state = SenderSlot::State::kPutting;
  ucs_status_ptr_t flush = ucp_ep_flush_nbx(peer->ep.get(), &param);
  if (UCS_PTR_IS_ERR(flush)) {
    slot->state = SenderSlot::State::kFree;
    core->FailTransfer(t, UcxStatusToStatus(UCS_PTR_STATUS(flush),
                                            "ep_flush_nbx (staged chunk)", peer->label));
  } else if (flush == nullptr) {
    SendChunk(core, slot);
  } else {
    slot->request = flush;
  }
}

// Enqueues the gather of `t`'s next chunk into `slot`. On a CUDA error the slot is left
// broken or waiting for what was enqueued, and the error returned.
absl::Status IssueChunk(UcxCore* core, UcxPeer* peer, UcxTransfer* t, SenderSlot* slot)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  StagedEngine& engine = *core->staged;
  StagedOut& out = *peer->out;
  StagedSend& s = *t->staged;
  const StagedChunk& chunk = s.chunks[s.next_chunk];
  auto* table = slot->buffers.host_table.data_as<SegmentCopyEntry>();
  StagedChunkMessage message;
  message.seq = s.seq;
  message.index = s.next_chunk;
  message.count = static_cast<uint32_t>(s.chunks.size());
  message.slot = slot->index;
  message.region_id = s.region_id;
  message.pieces.reserve(chunk.pieces.size());
  for (size_t i = 0; i < chunk.pieces.size(); ++i) {
    const StagedPiece& p = chunk.pieces[i];
    table[i] = SegmentCopyEntry{p.local_offset, p.staging_offset, p.length};
    message.pieces.push_back(StagedChunkPiece{p.remote_offset, p.length});
  }
  void* stream = engine.gather[slot->index % 2].get();
  char* destination = out.mapped != nullptr ? out.mapped : out.bounce.data_as<char>();
  destination += uint64_t{slot->index} * out.slot_bytes;
  SegmentCopyParams params;
  params.src = s.local_base;
  params.dst = slot->buffers.staging.data_as<char>();
  params.entries = slot->buffers.table.data_as<SegmentCopyEntry>();
  params.count = static_cast<uint32_t>(chunk.pieces.size());
  absl::Status status;
  if (!s.ready.empty()) status = s.ready.MakeStreamWait(stream);
  if (status.ok()) {
    status = CopyAsync(slot->buffers.table.data(), table,
                       chunk.pieces.size() * sizeof(SegmentCopyEntry), stream,
                       "cudaMemcpyAsync (staged gather table)");
  }
  if (status.ok()) status = SegmentCopyAsync(params, stream, "staged gather kernel");
  if (status.ok()) {
    status = CopyAsync(destination, slot->buffers.staging.data(), chunk.staged_bytes, stream,
                       "cudaMemcpyAsync (staged device to host)");
  }
  // The event covers whatever was enqueued, so the slot is reused only after it.
  absl::Status recorded = slot->buffers.done.Record(stream);
  slot->transfer = status.ok() ? t->id : 0;
  slot->local_handle = t->local_handle;
  slot->staged_bytes = chunk.staged_bytes;
  slot->state = recorded.ok() ? SenderSlot::State::kGpu : SenderSlot::State::kBroken;
  if (!status.ok()) return status;
  if (!recorded.ok()) return recorded;
  slot->header = EncodeStagedHeader(StagedType::kChunk, core->uid, peer->stamp);
  slot->body = EncodeChunk(message);
  ++s.next_chunk;
  return absl::OkStatus();
}

void IssueChunks(UcxCore* core, UcxPeer* peer) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  StagedOut* out = peer->out.get();
  if (out == nullptr || out->link != StagedOut::Link::kReady || !peer->status.ok()) return;
  CudaDeviceScope scope(core->staged->device);
  while (!out->queue.empty()) {
    UcxTransfer* t = out->queue.front();
    StagedSend& s = *t->staged;
    if (!s.planned) {
      absl::StatusOr<std::vector<StagedChunk>> chunks =
          PlanStagedChunks(s.segments, out->slot_bytes);
      if (!chunks.ok()) {
        core->FailTransfer(t, chunks.status());  // removes it from the queue
        continue;
      }
      s.chunks = std::move(chunks).value();
      s.planned = true;
    }
    if (s.next_chunk == s.chunks.size()) {
      out->queue.pop_front();
      continue;
    }
    SenderSlot* slot = nullptr;
    for (auto& candidate : out->slots) {
      if (candidate->state == SenderSlot::State::kFree) {
        slot = candidate.get();
        break;
      }
    }
    if (slot == nullptr) return;
    absl::Status status = scope.status();
    if (status.ok()) status = IssueChunk(core, peer, t, slot);
    if (!status.ok()) core->FailTransfer(t, status);
  }
}

// Sets up the sending side from the receiver's welcome.
absl::Status AcceptWelcome(UcxCore* core, UcxPeer* peer, const StagedWelcome& welcome)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  StagedOut& out = *peer->out;
  ASSIGN_OR_RETURN(UcxMemoryDescriptor landing,
                   DecodeMemoryDescriptor(welcome.landing_descriptor));
  if (landing.kind != UcxRegionKind::kHost ||
      landing.length != uint64_t{welcome.slots} * welcome.slot_bytes) {
    return absl::InvalidArgumentError("UCX staged welcome: the landing area does not match");
  }
  ucp_rkey_h raw_rkey = nullptr;
  RETURN_IF_ERROR(UcxStatusToStatus(
      ucp_ep_rkey_unpack(peer->ep.get(), landing.rkey.data(), &raw_rkey),
      "ep_rkey_unpack (staged landing area)", peer->label));
  out.rkey = UcxRkey(NoOwner{}, raw_rkey);
  out.landing_address = landing.address;
  out.slot_bytes = welcome.slot_bytes;
  CudaDeviceScope scope(core->staged->device);
  RETURN_IF_ERROR(scope.status());
  // The receiver's slot sizes are its claim: the sender copies into the mapped area itself,
  // so all of it must lie in what the key really mapped here.
  ASSIGN_OR_RETURN(char* mapped, MapPeerRegion(core, *peer, raw_rkey, landing.address,
                                               landing.length, "staged welcome: the landing area"));
  if (mapped != nullptr) {
    absl::Status locked = HostRegister(mapped, landing.length, "staged landing area, mapped");
    if (locked.ok()) {
      out.mapped = static_cast<char*>(mapped);
    } else {
      Log(LogLevel::kWarning, absl::StrCat("UCX staged path to ", peer->label,
                                           ": puts instead of mapped copies: ",
                                           locked.message()));
    }
  }
  if (out.mapped == nullptr) {
    ASSIGN_OR_RETURN(out.bounce, DeviceBuffer::Create(landing.length, MemoryKind::kPinned));
    ucp_mem_map_params_t params;
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = out.bounce.data();
    params.length = landing.length;
    ucp_mem_h memh = nullptr;
    RETURN_IF_ERROR(UcxStatusToStatus(ucp_mem_map(core->context.get(), &params, &memh),
                                      "mem_map (staged bounce area)"));
    out.bounce_memh = std::make_unique<UcxMemHandle>(core->context.get(), memh);
  }
  for (uint32_t i = 0; i < welcome.slots; ++i) {
    auto slot = std::make_unique<SenderSlot>();
    slot->peer = peer;
    slot->index = i;
    ASSIGN_OR_RETURN(slot->buffers, NewSlotBuffers(welcome.slot_bytes));
    out.slots.push_back(std::move(slot));
  }
  out.link = StagedOut::Link::kReady;
  return absl::OkStatus();
}

void FailQueued(UcxCore* core, UcxPeer* peer, const absl::Status& status)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::vector<UcxTransfer*> queued(peer->out->queue.begin(), peer->out->queue.end());
  for (UcxTransfer* t : queued) core->FailTransfer(t, status);
}

void HandleWelcome(UcxCore* core, UcxPeer* peer, absl::string_view body)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (peer->out == nullptr || peer->out->link != StagedOut::Link::kHelloSent) return;
  StagedOut& out = *peer->out;
  absl::StatusOr<StagedWelcome> welcome = DecodeWelcome(body);
  absl::Status status = welcome.status();
  if (status.ok() && !welcome->ok) {
    status = absl::FailedPreconditionError(absl::StrCat(
        "UCX staged write to ", peer->label, " refused by the receiver: ", welcome->reason));
  }
  if (status.ok()) status = AcceptWelcome(core, peer, *welcome);
  if (!status.ok()) {
    out.link = StagedOut::Link::kRefused;
    out.refused = absl::FailedPreconditionError(
        absl::StrCat("UCX staged path to ", peer->label, ": ", status.message()));
    FailQueued(core, peer, out.refused);
    return;
  }
  IssueChunks(core, peer);
}

void HandleCredits(UcxCore* core, UcxPeer* peer, absl::string_view body)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (peer->out == nullptr) return;
  absl::StatusOr<std::vector<uint32_t>> slots = DecodeCredits(body);
  if (!slots.ok()) {
    Log(LogLevel::kWarning, absl::StrCat("UCX: dropped a malformed staged credit from ",
                                         peer->label, ": ", slots.status().message()));
    return;
  }
  for (uint32_t index : *slots) {
    if (index < peer->out->slots.size() &&
        peer->out->slots[index]->state == SenderSlot::State::kAtPeer) {
      peer->out->slots[index]->state = SenderSlot::State::kFree;
    }
  }
  IssueChunks(core, peer);
}

// Polls the sender's GPU work: finished chunks cross (or are dropped).
void PollSender(UcxCore* core, UcxPeer* peer) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  for (auto& slot : peer->out->slots) {
    if (slot->state != SenderSlot::State::kGpu) continue;
    absl::StatusOr<bool> done = slot->buffers.done.Query();
    if (done.ok() && !*done) continue;
    if (!done.ok()) {
      slot->state = SenderSlot::State::kBroken;
      if (UcxTransfer* t = ActiveTransfer(core, slot->transfer)) {
        core->FailTransfer(t, done.status());
      }
      continue;
    }
    if (peer->out->mapped != nullptr) {
      SendChunk(core, slot.get());
    } else {
      PutChunk(core, slot.get());
    }
  }
}

}  // namespace

absl::StatusOr<SlotBuffers> NewSlotBuffers(uint64_t slot_bytes) {
  SlotBuffers b;
  ASSIGN_OR_RETURN(b.staging, DeviceBuffer::Create(slot_bytes, MemoryKind::kDevice));
  ASSIGN_OR_RETURN(b.table, DeviceBuffer::Create(kTableBytes, MemoryKind::kDevice));
  ASSIGN_OR_RETURN(b.host_table, DeviceBuffer::Create(kTableBytes, MemoryKind::kPinned));
  ASSIGN_OR_RETURN(b.done, CudaEvent::Create());
  return b;
}

StagedOut::~StagedOut() {
  // The mapping is unlocked before the rkey (declared earlier) unmaps it.
  if (mapped != nullptr) HostUnregister(mapped);
  bounce_memh.reset();  // before the pinned memory it registers
}

absl::Status EnsureStagedEngine(UcxCore* core, int device) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (core->staged != nullptr) {
    if (core->staged->device != device) {
      return absl::InvalidArgumentError(absl::StrCat(
          "UCX: device memory on GPU ", device, ", but this transport stages through GPU ",
          core->staged->device, " (one GPU per transport)"));
    }
    return absl::OkStatus();
  }
  auto engine = std::make_unique<StagedEngine>();
  engine->device = device;
  engine->options = core->staged_options;
  ASSIGN_OR_RETURN(engine->order, CudaStream::Create(device));
  for (int i = 0; i < 2; ++i) {
    ASSIGN_OR_RETURN(engine->gather[i], CudaStream::Create(device));
    ASSIGN_OR_RETURN(engine->scatter[i], CudaStream::Create(device));
  }
  core->staged = std::move(engine);
  return absl::OkStatus();
}

bool StagedSendFinished(const StagedSend& send) {
  if (!send.planned || send.chunks_sent < send.chunks.size()) return false;
  if (send.ready.empty()) return true;
  absl::StatusOr<bool> done = send.ready.Query();
  return !done.ok() || *done;  // an error surfaces in the write's own GPU work
}

absl::StatusOr<TransferId> PostStagedWrite(UcxCore* core, UcxPeer* peer,
                                           const UcxRegistration& local, const UcxRemote& remote,
                                           absl::Span<const Segment> segments,
                                           absl::string_view notification,
                                           const WriteOrder& order)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (core->staged == nullptr) {
    return absl::FailedPreconditionError("UCX PostWrite: no device memory registered here");
  }
  if (peer->out != nullptr && peer->out->link == StagedOut::Link::kRefused) {
    return peer->out->refused;
  }
  auto send = std::make_unique<StagedSend>();
  for (const Segment& s : segments) {
    if (s.length != 0) send->segments.push_back(s);
  }
  send->region_id = remote.region_id();
  send->local_base = static_cast<const char*>(local.base());
  if (order.ready_event != nullptr) {
    CudaDeviceScope scope(core->staged->device);
    RETURN_IF_ERROR(scope.status());
    ASSIGN_OR_RETURN(send->ready, CudaEvent::Create());
    void* stream = core->staged->order.get();
    RETURN_IF_ERROR(CudaEventWait(order.ready_event, stream));
    RETURN_IF_ERROR(send->ready.Record(stream));
  }
  const bool has_bytes = !send->segments.empty();
  if (!has_bytes) {
    send->planned = true;  // nothing to stage: only the ready event to wait for
  } else {
    send->has_seq = true;
    send->seq = peer->staged_posted++;
  }
  auto owned = std::make_unique<UcxTransfer>();
  UcxTransfer* t = owned.get();
  t->core = core;
  t->id = core->next_transfer++;
  t->peer = peer;
  t->phase = Phase::kCopying;
  t->payload.assign(notification.data(), notification.size());
  t->tail = order.notification_tail;
  t->tail_bytes = order.notification_tail_bytes;
  t->watermark = peer->staged_posted;
  t->local_handle = &local;
  t->remote_handle = &remote;
  t->staged = std::move(send);
  core->transfers.emplace(t->id, std::move(owned));
  peer->outstanding.insert(t);
  peer->waiting.push_back(t);
  if (has_bytes) {
    if (peer->out == nullptr) peer->out = std::make_unique<StagedOut>();
    peer->out->queue.push_back(t);
    if (peer->out->link == StagedOut::Link::kNone) {
      peer->out->link = StagedOut::Link::kHelloSent;
      core->SendControl(peer, StagedType::kHello, EncodeHello(core->local_info));
    }
    IssueChunks(core, peer);
  } else {
    core->Pump(peer);
  }
  return t->id;
}

void StagedTransferFailed(UcxCore* core, UcxTransfer* t) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  UcxPeer* peer = t->peer;
  StagedSend& s = *t->staged;
  if (peer->out != nullptr) {
    auto& queue = peer->out->queue;
    queue.erase(std::remove(queue.begin(), queue.end(), t), queue.end());
  }
  // Settled at the receiver already: every chunk was sent.
  if (!s.has_seq || (s.planned && s.chunks_posted == s.chunks.size())) return;
  StagedAbort abort;
  abort.seq = s.seq;
  abort.chunks_sent = s.chunks_posted;
  s.has_seq = false;  // aborted once
  core->SendControl(peer, StagedType::kAbort, EncodeAbort(abort));
}

void ProgressStaged(UcxCore* core) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::deque<StagedInbound> inbox;
  inbox.swap(core->staged_inbox);
  for (StagedInbound& m : inbox) {
    // What a writer this side disconnected from still sends into it is dropped (ucx_core.h:
    // refused_uids); answers to this side's own writes (welcome, credits) are not writes.
    const bool into_this_side =
        m.header.type != StagedType::kWelcome && m.header.type != StagedType::kCredit;
    if (into_this_side && core->Fenced(m.header.sender_uid, m.header.stamp)) continue;
    UcxPeer* peer = core->PeerForUid(m.header.sender_uid);
    switch (m.header.type) {
      case StagedType::kWelcome:
        HandleWelcome(core, peer, m.body);
        break;
      case StagedType::kCredit:
        HandleCredits(core, peer, m.body);
        break;
      case StagedType::kHello:
      case StagedType::kChunk:
      case StagedType::kAbort:
        HandleReceived(core, peer, m);
        break;
    }
  }
  if (core->staged == nullptr) return;
  CudaDeviceScope scope(core->staged->device);
  if (!scope.status().ok()) return;
  for (auto& [id, peer] : core->peers) {
    if (peer->out != nullptr) {
      PollSender(core, peer.get());
      IssueChunks(core, peer.get());
    }
    if (peer->in != nullptr) PollReceiver(core, peer.get());
    // A write whose last chunk went out, or whose ready event completed, moves on.
    if (!peer->waiting.empty() && peer->waiting.front()->staged != nullptr) {
      core->Pump(peer.get());
    }
  }
}

bool StagedPeerIdle(const UcxPeer& peer) {
  if (peer.out != nullptr) {
    for (const auto& slot : peer.out->slots) {
      if (slot->request != nullptr) return false;
      if (slot->state == SenderSlot::State::kGpu) return false;
    }
  }
  return ReceiverIdle(peer);
}

bool StagedRequestsPending(const UcxPeer& peer) {
  if (peer.out == nullptr) return false;
  for (const auto& slot : peer.out->slots) {
    if (slot->request != nullptr) return true;
  }
  return false;
}

void WaitForStagedRegionIdle(UcxCore* core, const void* handle, uint64_t region_id)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::vector<const CudaEvent*> events;
  for (auto& [id, peer] : core->peers) {
    if (peer->out != nullptr) {
      for (auto& slot : peer->out->slots) {
        if (slot->state == SenderSlot::State::kGpu && slot->local_handle == handle) {
          events.push_back(&slot->buffers.done);
        }
      }
    }
    if (peer->in != nullptr) CollectScatterEvents(*peer, region_id, &events);
  }
  for (const CudaEvent* event : events) {
    absl::Status status = event->Synchronize(kShutdownTimeout);
    if (!status.ok()) {
      Log(LogLevel::kError, absl::StrCat("UCX: device registration destroyed while its staged "
                                         "GPU work did not finish: ", status.message()));
    }
  }
}

void DrainStaged(UcxCore* core, absl::Time deadline) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (core->staged == nullptr) return;
  StagedEngine& engine = *core->staged;
  bool drained = true;
  for (CudaStream* stream : {&engine.order, &engine.gather[0], &engine.gather[1],
                             &engine.scatter[0], &engine.scatter[1]}) {
    const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
    drained = drained && stream->Synchronize(left).ok();
  }
  if (drained) return;
  Log(LogLevel::kError, "UCX transport destroyed while staged GPU work did not finish: "
                        "its staging buffers are leaked");
  for (auto& [id, peer] : core->peers) {
    (void)peer->out.release();
    (void)peer->in.release();
  }
}

ucs_status_t OnStagedMessage(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto* core = static_cast<UcxCore*>(arg);
  absl::StatusOr<StagedHeader> decoded = DecodeStagedHeader(
      absl::string_view(static_cast<const char*>(header), header_length));
  if (!decoded.ok() || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    Log(LogLevel::kWarning,
        absl::StrCat("UCX: dropped a malformed staged message: ",
                     decoded.ok() ? "rendezvous" : decoded.status().message()));
    return UCS_OK;
  }
  StagedInbound m;
  m.header = *decoded;
  m.body.assign(static_cast<const char*>(data), length);
  core->staged_inbox.push_back(std::move(m));
  return UCS_OK;
}

}  // namespace internal
}  // namespace kvstream
