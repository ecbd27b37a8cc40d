// TransferTable: the transfer bookkeeping of the transports whose notification is a frame
// they send themselves once the transfer's data is in place (cuda_ipc, nccl): ids, the
// per-transfer phase, post order per peer, completion and failure, Cancel and Release as
// transport.h's contract says, and the inbox of received notifications. It knows no GPU
// and no socket: what makes a transfer's data "in place" (a copy's event, a count of NCCL
// batches) is the transport's `Work`, judged by the predicate it passes, and sending a frame
// is the transport's callback. Thread-compatible: the transport's mutex guards it.
//
// A transfer's life:
//   kQueued   from Add, in its peer's queue, post order;
//   kSending  once it is at the front of the queue and its data is in place (the ready
//             predicate says so): its notification frame (notification + tail) was handed
//             to the send callback, which returned the connection's byte count that marks
//             its end;
//   kDone     once the connection has sent past that mark (FinishSent), or at once when it
//             has no notification;
//   kFailed   by Fail, FailPeer, FailAll or Cancel, from kQueued or kSending; Cancel only
//             from kQueued (a frame handed to the socket cannot be taken back: such a
//             transfer completes kDone).
// Release forgets a transfer in any phase; queues skip ids that are gone.
//
//   TransferTable<CopyWork> table("cuda_ipc");
//   TransferId id = table.Add(peer, "layer 3", nullptr, 0, CopyWork{});
//   ...  table.Find(id)->work.copy_done = true;
//   RETURN_IF_ERROR(table.StartReady(peer, [](auto& t) { return t.work.copy_done; },
//                                    [&](std::string frame) { return conn.Queue(frame); }));
//   table.FinishSent(peer, conn.bytes_sent());
#ifndef KVSTREAM_TRANSFER_SRC_TRANSFER_TABLE_H_
#define KVSTREAM_TRANSFER_SRC_TRANSFER_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {
namespace internal {

enum class TransferPhase { kQueued, kSending, kDone, kFailed };

// What every transfer of the table holds, whatever moves its data.
struct TransferRecord {
  PeerId peer = 0;
  TransferPhase phase = TransferPhase::kQueued;
  std::string notification;    // empty: none; moved into the frame at kSending
  const void* tail = nullptr;  // WriteOrder::notification_tail, read when the frame is made
  size_t tail_bytes = 0;
  uint64_t send_mark = 0;  // kSending: done once the connection has sent this many bytes
  absl::Status status;     // kFailed: why

  bool active() const {
    return phase == TransferPhase::kQueued || phase == TransferPhase::kSending;
  }
};

// Test()'s answer for a record: kInProgress, kDone, or its failure.
absl::StatusOr<TransferState> TransferRecordState(const TransferRecord& record);
// The frame a transfer's notification goes out as: the notification, then its tail's bytes.
std::string NotificationFrame(TransferRecord& record);

// Received notifications, returned in arrival order.
class NotificationInbox {
 public:
  void Deliver(Notification note) { notes_.push_back(std::move(note)); }
  std::vector<Notification> Take();

 private:
  std::vector<Notification> notes_;
};

template <typename Work>
class TransferTable {
 public:
  struct Transfer : TransferRecord {
    Work work;  // the transport's own state of the transfer's data
  };

  // `name` ("cuda_ipc", "nccl") prefixes every message.
  explicit TransferTable(std::string name) : name_(std::move(name)) {}

  // A new kQueued transfer at the end of `peer`'s queue. Ids start at 1 and are never
  // reused.
  TransferId Add(PeerId peer, absl::string_view notification, const void* tail,
                 size_t tail_bytes, Work work) {
    const TransferId id = next_id_++;
    Transfer t;
    t.peer = peer;
    t.notification.assign(notification.data(), notification.size());
    t.tail = tail;
    t.tail_bytes = tail_bytes;
    t.work = std::move(work);
    transfers_.emplace(id, std::move(t));
    lines_[peer].queued.push_back(id);
    return id;
  }

  // The transfer in any phase; null once released (or never added).
  Transfer* Find(TransferId id) {
    auto it = transfers_.find(id);
    return it == transfers_.end() ? nullptr : &it->second;
  }
  // The transfer while it may still need its data moved (not failed); null otherwise.
  Transfer* Unfailed(TransferId id) {
    Transfer* t = Find(id);
    return t == nullptr || t->phase == TransferPhase::kFailed ? nullptr : t;
  }

  // Transport::Test: NotFound for an unknown or released id.
  absl::StatusOr<TransferState> Test(TransferId id) const {
    auto it = transfers_.find(id);
    if (it == transfers_.end()) return UnknownTransfer(id);
    return TransferRecordState(it->second);
  }

  // Transport::Cancel: a kQueued transfer fails with Cancelled; any other phase is kept.
  // NotFound for an unknown or released id.
  absl::Status Cancel(TransferId id) {
    auto it = transfers_.find(id);
    if (it == transfers_.end()) return UnknownTransfer(id);
    if (it->second.phase == TransferPhase::kQueued) Fail(id, CancelledTransfer(id));
    return absl::OkStatus();
  }

  // Transport::Release: forgets the transfer (a no-op for an unknown id).
  void Release(TransferId id) { transfers_.erase(id); }

  // kQueued or kSending -> kFailed with `status`; no-op otherwise.
  void Fail(TransferId id, const absl::Status& status) {
    Transfer* t = Find(id);
    if (t == nullptr || !t->active()) return;
    t->phase = TransferPhase::kFailed;
    t->status = status;
  }

  // Fails every unfinished transfer of `peer` with `status` and forgets its queue (the peer
  // failed, or was disconnected: nothing more is sent to it).
  void FailPeer(PeerId peer, const absl::Status& status) {
    auto line = lines_.find(peer);
    if (line == lines_.end()) return;
    for (TransferId id : line->second.queued) Fail(id, status);
    for (TransferId id : line->second.sending) Fail(id, status);
    lines_.erase(line);
  }

  // Fails every unfinished transfer (the transport is destroyed).
  void FailAll(const absl::Status& status) {
    for (auto& [id, t] : transfers_) Fail(id, status);
    lines_.clear();
  }

  // Forgets everything (the end of the transport's destruction).
  void Clear() {
    transfers_.clear();
    lines_.clear();
  }

  // Moves `peer`'s queued transfers, oldest first, to kSending (or kDone without a
  // notification) while the front one's data is in place: `ready(Transfer&)` returns
  // absl::StatusOr<bool> (or bool), true when it is; `send(std::string frame)` queues the
  // frame on the peer's connection and returns the connection's byte count at its end.
  // Stops at the first transfer not ready; returns ready's error (that transfer stays
  // queued; the caller fails the peer).
  template <typename Ready, typename Send>
  absl::Status StartReady(PeerId peer, Ready ready, Send send) {
    auto line = lines_.find(peer);
    if (line == lines_.end()) return absl::OkStatus();
    std::deque<TransferId>& queued = line->second.queued;
    while (!queued.empty()) {
      const TransferId id = queued.front();
      Transfer* t = Find(id);
      if (t == nullptr || t->phase != TransferPhase::kQueued) {
        queued.pop_front();  // released, cancelled or failed
        continue;
      }
      // Its data, and that of every earlier transfer to the peer, is not all in place yet.
      absl::StatusOr<bool> in_place = ready(*t);
      if (!in_place.ok()) return in_place.status();
      if (!*in_place) break;
      queued.pop_front();
      if (t->notification.empty()) {
        t->phase = TransferPhase::kDone;
        continue;
      }
      t->send_mark = send(NotificationFrame(*t));
      t->phase = TransferPhase::kSending;
      line->second.sending.push_back(id);
    }
    return absl::OkStatus();
  }

  // kSending transfers of `peer` whose frame ends at or before `bytes_sent` become kDone.
  void FinishSent(PeerId peer, uint64_t bytes_sent) {
    auto line = lines_.find(peer);
    if (line == lines_.end()) return;
    std::deque<TransferId>& sending = line->second.sending;
    while (!sending.empty()) {
      Transfer* t = Find(sending.front());
      if (t != nullptr && t->phase == TransferPhase::kSending) {
        if (t->send_mark > bytes_sent) break;
        t->phase = TransferPhase::kDone;
      }
      sending.pop_front();
    }
  }

  NotificationInbox& inbox() { return inbox_; }

 private:
  // A peer's transfers not yet done, by phase, in post order.
  struct Line {
    std::deque<TransferId> queued;
    std::deque<TransferId> sending;
  };

  absl::Status UnknownTransfer(TransferId id) const;
  absl::Status CancelledTransfer(TransferId id) const;

  const std::string name_;
  std::map<TransferId, Transfer> transfers_;
  std::map<PeerId, Line> lines_;
  NotificationInbox inbox_;
  TransferId next_id_ = 1;
};

// Messages of every TransferTable (transfer_table.cc).
absl::Status UnknownTransferError(absl::string_view name, TransferId id);
absl::Status CancelledTransferError(absl::string_view name, TransferId id);

template <typename Work>
absl::Status TransferTable<Work>::UnknownTransfer(TransferId id) const {
  return UnknownTransferError(name_, id);
}

template <typename Work>
absl::Status TransferTable<Work>::CancelledTransfer(TransferId id) const {
  return CancelledTransferError(name_, id);
}

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_TRANSFER_TABLE_H_
