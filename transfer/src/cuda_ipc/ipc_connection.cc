// A connection of the cuda_ipc notification socket (ipc_connection.h).
#include "cuda_ipc/ipc_connection.h"

#include "absl/strings/str_cat.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {

uint64_t IpcConnection::QueueFrame(uint8_t type, absl::string_view payload) {
  const std::string frame = EncodeFrame(format_, type, payload);
  out_.append(frame);
  queued_ += frame.size();
  return queued_;
}

absl::Status IpcConnection::Flush() {
  if (idle()) return absl::OkStatus();
  ASSIGN_OR_RETURN(size_t n,
                   SendSome(fd_.get(), absl::string_view(out_).substr(out_pos_), label_));
  out_pos_ += n;
  sent_ += n;
  if (out_pos_ == out_.size()) {
    out_.clear();
    out_pos_ = 0;
  } else if (out_pos_ > (size_t{1} << 20) && out_pos_ > out_.size() / 2) {
    out_.erase(0, out_pos_);
    out_pos_ = 0;
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> IpcConnection::ReadAvailable(size_t max_bytes) {
  char buf[64 << 10];
  size_t total = 0;
  while (total < max_bytes) {
    bool eof = false;
    ASSIGN_OR_RETURN(size_t n, RecvSome(fd_.get(), buf, sizeof(buf), label_, &eof));
    if (eof) return true;
    if (n == 0) break;
    reader_.Append(buf, n);
    total += n;
  }
  return false;
}

}  // namespace internal
}  // namespace kvstream
