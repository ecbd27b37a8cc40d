// Host writes sent as active messages (am_writes.h).
#include "ucx/am_writes.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kvstream/common/int_math.h"
#include "kvstream/common/logging.h"
#include "ucx/ucx_status.h"
#include "ucx/ucx_wire.h"

namespace kvstream {
namespace internal {
namespace {

// Whether [address, address + length) lies inside one registered host region.
bool InsideHostRegion(const UcxCore& core, uint64_t address, size_t length)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (length > UINT64_MAX - address) return false;
  const uint64_t end = address + length;
  // Regions starting at or below `address`, nearest first (there are a few: one per
  // registration, and registrations may overlap).
  auto it = core.host_regions.upper_bound(static_cast<uintptr_t>(address));
  while (it != core.host_regions.begin()) {
    --it;
    if (end - it->first <= it->second) return true;
  }
  return false;
}

// A dropped piece is logged the first time and then at every power of two, so that a flood
// of late pieces does not flood the log.
void CountDropped(UcxCore* core, absl::string_view why) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const uint64_t n = ++core->dropped_write_pieces;
  if ((n & (n - 1)) != 0) return;
  Log(LogLevel::kWarning, absl::StrCat("UCX: dropped a write piece (", n, " so far): ", why));
}

}  // namespace

absl::Status PostWritePieces(UcxCore* core, UcxTransfer* t, const char* local_base,
                             ucp_mem_h memh, uint64_t remote_base,
                             absl::Span<const Segment> segments) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  size_t pieces = 0;
  for (const Segment& s : segments) {
    pieces += static_cast<size_t>(CeilDiv(static_cast<int64_t>(s.length),
                                          static_cast<int64_t>(kWriteMessageBytes)));
  }
  // Reserved once: UCX holds pointers into it until the flush completes.
  t->write_headers.reserve(pieces);
  // No callback: a piece's completion is observed through the flush that follows, as a
  // put's was. The memory handle spares UCX a registration lookup for zero-copy sends.
  ucp_request_param_t param;
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMH;
  param.flags = UCP_AM_SEND_FLAG_EAGER;
  param.memh = memh;
  ucp_ep_h ep = t->peer->ep.get();
  for (const Segment& s : segments) {
    for (uint64_t done = 0; done < s.length;) {
      const size_t bytes = static_cast<size_t>(std::min<uint64_t>(kWriteMessageBytes,
                                                                  s.length - done));
      t->write_headers.push_back(EncodeWriteHeader(
          core->uid, t->peer->stamp, remote_base + s.remote_offset + done));
      const WriteHeader& header = t->write_headers.back();
      ucs_status_ptr_t request =
          ucp_am_send_nbx(ep, kWriteAmId, header.data(), header.size(),
                          local_base + s.local_offset + done, bytes, &param);
      if (UCS_PTR_IS_PTR(request)) {
        ucp_request_free(request);
      } else if (UCS_PTR_IS_ERR(request)) {
        core->orphan_headers.push_back(std::move(t->write_headers));
        t->write_headers.clear();
        return UcxStatusToStatus(UCS_PTR_STATUS(request), "am_send_nbx (write)",
                                 t->peer->label);
      }
      done += bytes;
    }
  }
  return absl::OkStatus();
}

void AddHostRegion(UcxCore* core, const void* base, size_t length)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  core->host_regions.emplace(reinterpret_cast<uintptr_t>(base), length);
}

void RemoveHostRegion(UcxCore* core, const void* base, size_t length)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto [first, last] = core->host_regions.equal_range(reinterpret_cast<uintptr_t>(base));
  for (auto it = first; it != last; ++it) {
    if (it->second == length) {
      core->host_regions.erase(it);
      return;
    }
  }
}

ucs_status_t OnWritePiece(void* arg, const void* header, size_t header_length, void* data,
                          size_t length, const ucp_am_recv_param_t* param)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  auto* core = static_cast<UcxCore*>(arg);
  absl::StatusOr<WriteHeaderFields> fields = DecodeWriteHeader(
      absl::string_view(static_cast<const char*>(header), header_length));
  if (!fields.ok()) {
    CountDropped(core, fields.status().message());
    return UCS_OK;
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // Senders force eager; the data of a rendezvous message would need fetching.
    CountDropped(core, "a rendezvous message (not from this version of kvstream)");
    return UCS_OK;
  }
  if (core->Fenced(fields->sender_uid, fields->stamp)) {
    CountDropped(core, absl::StrCat("from uid ", absl::Hex(fields->sender_uid), " (stamp ",
                                    fields->stamp, "), which this side fenced off"));
    return UCS_OK;
  }
  if (!InsideHostRegion(*core, fields->address, length)) {
    CountDropped(core, absl::StrCat(length, " bytes at ", absl::Hex(fields->address),
                                    " from uid ", absl::Hex(fields->sender_uid),
                                    " are not inside memory registered here (a write that "
                                    "arrived after its region was deregistered)"));
    return UCS_OK;
  }
  std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(fields->address)), data, length);
  return UCS_OK;
}

}  // namespace internal
}  // namespace kvstream
