// The nccl transport's NCCL calls (nccl_api.h): the only file that includes nccl.h.
#include "nccl/nccl_api.h"

#include <nccl.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "nccl/nccl_status.h"
#include "nccl/nccl_wire.h"

namespace kvstream {
namespace internal {
namespace {

static_assert(kNcclSuccess == ncclSuccess && kNcclUnhandledCudaError == ncclUnhandledCudaError &&
                  kNcclSystemError == ncclSystemError &&
                  kNcclInternalError == ncclInternalError &&
                  kNcclInvalidArgument == ncclInvalidArgument &&
                  kNcclInvalidUsage == ncclInvalidUsage && kNcclRemoteError == ncclRemoteError &&
                  kNcclInProgress == ncclInProgress,
              "nccl_status.h mirrors ncclResult_t");
static_assert(kNcclUniqueIdBytes == NCCL_UNIQUE_ID_BYTES &&
                  sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES,
              "nccl_wire.h carries the unique id as it is");

// A result as NcclPoll; the error names the operation and carries ncclGetLastError's text.
NcclPoll Poll(ncclResult_t result, ncclComm_t comm, absl::string_view operation,
              absl::string_view label) {
  if (result == ncclSuccess) return NcclPoll::Done();
  if (result == ncclInProgress) return NcclPoll::InProgress();
  const char* detail = ncclGetLastError(comm);
  return NcclPoll::Failed(NcclResultToStatus(static_cast<int>(result), operation, label,
                                             detail != nullptr ? detail : ""));
}

}  // namespace

absl::StatusOr<uint32_t> NcclLibraryVersion() {
  int version = 0;
  NcclPoll poll = Poll(ncclGetVersion(&version), nullptr, "ncclGetVersion", "");
  if (!poll.error.ok()) return poll.error;
  return static_cast<uint32_t>(version);
}

std::string NcclVersionText(uint32_t code) {
  // NCCL_VERSION(X, Y, Z): X * 1000 + Y * 100 + Z up to 2.8, X * 10000 + Y * 100 + Z after.
  if (code < 10000) return absl::StrCat(code / 1000, ".", code % 1000 / 100, ".", code % 100);
  return absl::StrCat(code / 10000, ".", code % 10000 / 100, ".", code % 100);
}

absl::StatusOr<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  NcclPoll poll = Poll(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId", "");
  if (!poll.error.ok()) return poll.error;
  return std::string(id.internal, sizeof(id.internal));
}

std::pair<NcclComm, NcclPoll> NcclComm::Init(absl::string_view unique_id, int rank,
                                             absl::string_view label) {
  NcclComm owner;
  owner.label_ = std::string(label);
  if (unique_id.size() != sizeof(ncclUniqueId) || (rank != 0 && rank != 1)) {
    return {std::move(owner),
            NcclPoll::Failed(absl::InvalidArgumentError(absl::StrCat(
                "NCCL init (", label, "): unique id of ", unique_id.size(), " bytes, rank ",
                rank)))};
  }
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // init and groups return ncclInProgress instead of waiting
  ncclComm_t comm = nullptr;
  const ncclResult_t result = ncclCommInitRankConfig(&comm, 2, id, rank, &config);
  owner.comm_ = comm;
  return {std::move(owner), Poll(result, comm, "ncclCommInitRankConfig", label)};
}

NcclComm& NcclComm::operator=(NcclComm&& other) noexcept {
  if (this != &other) {
    Abort();
    comm_ = std::exchange(other.comm_, nullptr);
    label_ = std::move(other.label_);
  }
  return *this;
}

NcclPoll NcclComm::AsyncState() const {
  if (comm_ == nullptr) {
    return NcclPoll::Failed(
        absl::FailedPreconditionError(absl::StrCat("NCCL (", label_, "): no communicator")));
  }
  ncclComm_t comm = static_cast<ncclComm_t>(comm_);
  ncclResult_t state = ncclSuccess;
  NcclPoll call = Poll(ncclCommGetAsyncError(comm, &state), comm, "ncclCommGetAsyncError", label_);
  if (!call.error.ok()) return call;
  return Poll(state, comm, "communicator", label_);
}

void NcclComm::Abort() {
  if (comm_ == nullptr) return;
  // Nothing can be done about a failed abort: the communicator is gone either way.
  (void)ncclCommAbort(static_cast<ncclComm_t>(comm_));
  comm_ = nullptr;
}

NcclPoll IssueNcclGroup(const NcclComm& comm, int peer, absl::Span<const NcclOp> ops,
                        void* stream, absl::string_view label) {
  ncclComm_t c = static_cast<ncclComm_t>(comm.get());
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  NcclPoll started = Poll(ncclGroupStart(), c, "ncclGroupStart", label);
  if (!started.error.ok()) return started;
  NcclPoll failed;
  for (const NcclOp& op : ops) {
    const ncclResult_t r = op.send ? ncclSend(op.buffer, op.bytes, ncclUint8, peer, c, s)
                                   : ncclRecv(op.buffer, op.bytes, ncclUint8, peer, c, s);
    failed = Poll(r, c, op.send ? "ncclSend" : "ncclRecv", label);
    if (!failed.error.ok()) break;
  }
  NcclPoll ended = Poll(ncclGroupEnd(), c, "ncclGroupEnd", label);
  return failed.error.ok() ? ended : failed;
}

}  // namespace internal
}  // namespace kvstream
