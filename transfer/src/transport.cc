// WaitForTransfer: the one deadline-bounded wait shared by every Transport implementation.
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {

absl::StatusOr<TransferState> WaitForTransfer(Transport& transport, TransferId id,
                                              absl::Time deadline) {
  // Spins on Progress() (transports never block inside it), yielding the CPU after a while so
  // that a peer process on the same cores can run; no sleep, because a sleep's granularity
  // would dominate small transfers.
  constexpr int kSpinsBeforeYield = 256;
  for (int spins = 0;; ++spins) {
    RETURN_IF_ERROR(transport.Progress());
    ASSIGN_OR_RETURN(TransferState state, transport.Test(id));
    if (state != TransferState::kInProgress) return state;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          transport.name(), " transfer ", id, " did not finish before its deadline"));
    }
    if (spins >= kSpinsBeforeYield) std::this_thread::yield();
  }
}

}  // namespace kvstream
