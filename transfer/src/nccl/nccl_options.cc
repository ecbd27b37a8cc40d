// The nccl transport's options check (nccl_transport.h), in every build: options are
// refused before anything else is looked at, with or without CUDA and NCCL.
#include "absl/strings/str_cat.h"
#include "kvstream/transfer/nccl_transport.h"
#include "nccl/nccl_wire.h"

namespace kvstream {

absl::Status ValidateNcclTransportOptions(const NcclTransportOptions& o) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("nccl transport: ", parts...));
  };
  if (o.device < 0) return bad("device ", o.device);
  if (o.job_id.size() > internal::kMaxNcclJobIdBytes) {
    return bad("job_id of ", o.job_id.size(), " bytes, more than ", internal::kMaxNcclJobIdBytes);
  }
  if (o.listen_host.empty() || o.listen_host.size() > internal::kMaxNcclHostBytes) {
    return bad("listen_host '", o.listen_host, "' is empty or longer than ",
               internal::kMaxNcclHostBytes, " bytes");
  }
  if (o.staging_bytes < (uint64_t{1} << 20) || o.staging_bytes > (uint64_t{1} << 30)) {
    return bad("staging_bytes ", o.staging_bytes, " outside 1 MiB..1 GiB");
  }
  if (o.in_place_min_bytes < (uint64_t{4} << 10) || o.in_place_min_bytes > o.staging_bytes) {
    return bad("in_place_min_bytes ", o.in_place_min_bytes, " outside 4 KiB..staging_bytes (",
               o.staging_bytes, ")");
  }
  const uint64_t piece = o.max_piece_bytes;
  if (piece < (uint64_t{4} << 10) || piece > (uint64_t{1} << 30) || (piece & (piece - 1)) != 0) {
    return bad("max_piece_bytes ", piece, " is not a power of two from 4 KiB to 1 GiB");
  }
  if (o.table_entries < 4096 || o.table_entries > (size_t{1} << 22)) {
    return bad("table_entries ", o.table_entries, " outside 4096..", size_t{1} << 22);
  }
  // Half the ring holds a batch: its pieces plus the cuts of its staged bytes.
  if (o.table_entries / 2 < o.staging_bytes / piece + 1 + 64) {
    return bad("table_entries ", o.table_entries, " leave too few pieces per batch for ",
               o.staging_bytes, " staged bytes cut at ", piece, " (raise table_entries or "
               "max_piece_bytes)");
  }
  if (o.copy_ctas < 0 || o.copy_ctas > 4096) return bad("copy_ctas ", o.copy_ctas, " outside 0..4096");
  if (o.join_timeout <= absl::ZeroDuration() || o.op_timeout <= absl::ZeroDuration()) {
    return bad("join_timeout and op_timeout must be positive");
  }
  if (o.shutdown_timeout < absl::ZeroDuration()) return bad("negative shutdown_timeout");
  return absl::OkStatus();
}

}  // namespace kvstream
