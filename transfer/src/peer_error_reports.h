// PeerErrorReports: peer failures a transport notices under its own lock, told to its
// PeerErrorCallback (transport.h) once it has dropped the lock, since the callback may take
// locks of its own. Thread-compatible: the transport's mutex guards it; what Take returns is
// delivered without it.
//
//   PeerErrorReports::Pending pending;
//   { absl::MutexLock lock(&mu_); ...; reports_.Add(peer, status); pending = reports_.Take(); }
//   pending.Deliver();
#ifndef KVSTREAM_TRANSFER_SRC_PEER_ERROR_REPORTS_H_
#define KVSTREAM_TRANSFER_SRC_PEER_ERROR_REPORTS_H_

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {
namespace internal {

class PeerErrorReports {
 public:
  // The failures taken at once, and the callback current then.
  class Pending {
   public:
    // Tells the callback (if any) every failure, in the order they were added.
    void Deliver() const {
      if (!callback_) return;
      for (const auto& [peer, error] : errors_) callback_(peer, error);
    }

   private:
    friend class PeerErrorReports;
    std::vector<std::pair<PeerId, absl::Status>> errors_;
    PeerErrorCallback callback_;
  };

  void SetCallback(PeerErrorCallback callback) { callback_ = std::move(callback); }
  void Add(PeerId peer, absl::Status error) { errors_.emplace_back(peer, std::move(error)); }
  // The failures added since the last Take (then forgotten here).
  Pending Take() {
    Pending pending;
    if (errors_.empty()) return pending;
    pending.errors_.swap(errors_);
    pending.callback_ = callback_;
    return pending;
  }

 private:
  std::vector<std::pair<PeerId, absl::Status>> errors_;
  PeerErrorCallback callback_;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_PEER_ERROR_REPORTS_H_
