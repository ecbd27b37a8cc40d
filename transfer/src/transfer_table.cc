// The non-template parts of TransferTable (transfer_table.h).
#include "transfer_table.h"

#include "absl/strings/str_cat.h"

namespace kvstream {
namespace internal {

absl::StatusOr<TransferState> TransferRecordState(const TransferRecord& record) {
  switch (record.phase) {
    case TransferPhase::kQueued:
    case TransferPhase::kSending: return TransferState::kInProgress;
    case TransferPhase::kDone: return TransferState::kDone;
    case TransferPhase::kFailed: break;
  }
  return record.status;
}

std::string NotificationFrame(TransferRecord& record) {
  std::string payload = std::move(record.notification);
  record.notification.clear();
  // The tail's writer (the GPU) finished before the data was in place, which the caller's
  // ready predicate said it is.
  if (record.tail_bytes > 0) {
    payload.append(static_cast<const char*>(record.tail), record.tail_bytes);
  }
  return payload;
}

std::vector<Notification> NotificationInbox::Take() {
  std::vector<Notification> out;
  out.swap(notes_);
  return out;
}

absl::Status UnknownTransferError(absl::string_view name, TransferId id) {
  return absl::NotFoundError(absl::StrCat(name, ": unknown transfer ", id));
}

absl::Status CancelledTransferError(absl::string_view name, TransferId id) {
  return absl::CancelledError(absl::StrCat(name, " transfer ", id, " cancelled"));
}

}  // namespace internal
}  // namespace kvstream
