// The nccl transport's NCCL calls (private to transfer/): a move-only owner of a
// communicator and the few operations the transport makes, with results as NcclPoll or
// Status (nccl_status.h). No NCCL or CUDA type in this header: communicators and streams are
// void*, so the transport's bookkeeping compiles without nccl.h. Defined in nccl_api.cc.
//
// Every call REQUIRES the transport's device to be the calling thread's current device.
#ifndef KVSTREAM_TRANSFER_SRC_NCCL_NCCL_API_H_
#define KVSTREAM_TRANSFER_SRC_NCCL_NCCL_API_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "nccl/nccl_comm_state.h"

namespace kvstream {
namespace internal {

// The linked NCCL's version code (ncclGetVersion), e.g. 22809 for 2.28.9.
absl::StatusOr<uint32_t> NcclLibraryVersion();
// "2.28.9" for a version code.
std::string NcclVersionText(uint32_t code);

// A fresh ncclUniqueId (kNcclUniqueIdBytes): this process becomes the bootstrap root of
// the communicator made from it.
absl::StatusOr<std::string> NewNcclUniqueId();

// Owns an ncclComm_t. Destruction (or Abort) calls ncclCommAbort, which never waits for the
// peer and stops the communicator's kernels still running. Move-only.
class NcclComm {
 public:
  // ncclCommInitRankConfig of a non-blocking communicator of two ranks from `unique_id`
  // (kNcclUniqueIdBytes) as `rank` (0 or 1). Returns the communicator (empty when NCCL gave
  // none back) and what the call said: usually in progress; the state then comes from
  // AsyncState(). `label` names the peer in errors.
  static std::pair<NcclComm, NcclPoll> Init(absl::string_view unique_id, int rank,
                                            absl::string_view label);

  NcclComm() = default;
  NcclComm(NcclComm&& other) noexcept
      : comm_(std::exchange(other.comm_, nullptr)), label_(std::move(other.label_)) {}
  NcclComm& operator=(NcclComm&& other) noexcept;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  ~NcclComm() { Abort(); }

  bool empty() const { return comm_ == nullptr; }
  void* get() const { return comm_; }

  // ncclCommGetAsyncError: done, in progress (joining, or a group being enqueued), or the
  // communicator's error. An empty owner is an error.
  NcclPoll AsyncState() const;
  // ncclCommAbort (no-op when empty); the owner is empty afterwards.
  void Abort();

 private:
  void* comm_ = nullptr;
  std::string label_;
};

// One operation of a group.
struct NcclOp {
  bool send = false;  // ncclSend, else ncclRecv
  void* buffer = nullptr;
  uint64_t bytes = 0;
};

// ncclGroupStart, each op (bytes as ncclUint8, with the other rank `peer` of `comm`, on
// `stream`), ncclGroupEnd. What ncclGroupEnd said; an op's own error ends the group first.
// REQUIRES: comm not empty, 1 <= ops.size() <= 2048.
NcclPoll IssueNcclGroup(const NcclComm& comm, int peer, absl::Span<const NcclOp> ops,
                        void* stream, absl::string_view label);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_NCCL_NCCL_API_H_
