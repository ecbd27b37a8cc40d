// The range check every transport's PostWrite makes before it posts anything: each segment
// must lie inside both regions, with no overflow; and the coalescing of segments that
// continue one another on both sides. Private to transfer/.
#ifndef KVSTREAM_TRANSFER_SRC_SEGMENT_CHECK_H_
#define KVSTREAM_TRANSFER_SRC_SEGMENT_CHECK_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {
namespace internal {

// [offset, offset + length) inside [0, region_length), without overflow.
inline bool SegmentFits(uint64_t offset, uint64_t length, uint64_t region_length) {
  return length <= region_length && offset <= region_length - length;
}

// OK when every segment fits both regions; else OutOfRange naming the first that does not,
// prefixed by `transport` ("UCX", "cuda_ipc", ...).
inline absl::Status CheckSegments(absl::string_view transport, absl::Span<const Segment> segments,
                                  uint64_t local_length, uint64_t remote_length) {
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (!SegmentFits(s.local_offset, s.length, local_length) ||
        !SegmentFits(s.remote_offset, s.length, remote_length)) {
      return absl::OutOfRangeError(absl::StrCat(
          transport, " PostWrite: segment ", i, " (local ", s.local_offset, ", remote ",
          s.remote_offset, ", length ", s.length, ") is outside the local region (",
          local_length, " bytes) or the remote one (", remote_length, " bytes)"));
    }
  }
  return absl::OkStatus();
}

// The rules of WriteOrder (transport.h) that do not depend on the transport: tail and its
// size given together; a tail only with a ready event and a notification, of at most
// kMaxNotificationTailBytes; notification and tail together at most `max_notification_bytes`.
// InvalidArgument prefixed by `transport` otherwise.
inline absl::Status CheckWriteOrder(absl::string_view transport, const WriteOrder& order,
                                    absl::string_view notification,
                                    size_t max_notification_bytes) {
  if ((order.notification_tail == nullptr) != (order.notification_tail_bytes == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        transport, " PostWrite: notification_tail and notification_tail_bytes must be given "
                   "together"));
  }
  if (order.notification_tail != nullptr &&
      (order.ready_event == nullptr || notification.empty() ||
       order.notification_tail_bytes > kMaxNotificationTailBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        transport, " PostWrite: a notification tail needs a ready_event and a notification, "
                   "and is at most ", kMaxNotificationTailBytes, " bytes (",
        order.notification_tail_bytes, " given)"));
  }
  if (notification.size() + order.notification_tail_bytes > max_notification_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        transport, " PostWrite: notification of ", notification.size(), " bytes (+",
        order.notification_tail_bytes, " tail), more than ", max_notification_bytes));
  }
  return absl::OkStatus();
}

// `segments` without the empty ones, each run of segments that are contiguous on both sides
// (the next starts where the previous ended, locally and remotely) merged into one, so that
// block runs move as one piece. Order is kept.
inline std::vector<Segment> CoalesceSegments(absl::Span<const Segment> segments) {
  std::vector<Segment> runs;
  for (const Segment& s : segments) {
    if (s.length == 0) continue;
    if (!runs.empty()) {
      Segment& last = runs.back();
      if (last.local_offset + last.length == s.local_offset &&
          last.remote_offset + last.length == s.remote_offset) {
        last.length += s.length;
        continue;
      }
    }
    runs.push_back(s);
  }
  return runs;
}

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_SEGMENT_CHECK_H_
