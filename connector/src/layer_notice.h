// The layer notice: the notification a producer's layer write carries, which the consumer
// receives only after that layer's bytes are in place (transport.h's ordering); and the stop
// notice (below).
//
//   u32 magic "KVN3"   str request_id (u32 length, at most kMaxIdBytes)   u64 attempt
//   u32 layer   u64 bytes   u8 checksum kind   u64 post time (ns, CLOCK_MONOTONIC:
//   comparable between processes of one host)   u64 checksum
// `attempt` is the hand-off's (HandOffMsg::attempt): a late notice of an earlier attempt of
// the same request id must not count for a retry.
// little-endian. The checksum is last so that, for a device cache, the GPU can supply it:
// the producer posts the notice without it (EncodeLayerNoticeHead) and hands the transport
// the 8 bytes a kernel writes as the notification's tail (WriteOrder::notification_tail).
// Decoded strictly; an undecodable notice is InvalidArgument.
#ifndef KVSTREAM_CONNECTOR_SRC_LAYER_NOTICE_H_
#define KVSTREAM_CONNECTOR_SRC_LAYER_NOTICE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvstream/common/monotonic_clock.h"  // the clock of post_ns

namespace kvstream {
namespace internal {

// How the checksum of a layer was computed.
enum class ChecksumKind : uint8_t {
  kNone = 0,
  kXxh3 = 1,     // XXH3-64 of the K runs then the V runs (host caches)
  kKvsum64 = 2,  // kvsum64 (cache/layer_checksum.h) of the same bytes (device caches)
};

struct LayerNotice {
  std::string request_id;
  uint64_t attempt = 0;
  uint32_t layer = 0;
  uint64_t bytes = 0;
  ChecksumKind checksum_kind = ChecksumKind::kNone;
  // When the producer posted the layer (MonotonicNs); 0: unknown, as for device caches,
  // whose host post runs ahead of the GPU (the producer's RequestSendStats has their times).
  uint64_t post_ns = 0;
  uint64_t checksum = 0;
};

inline constexpr size_t kLayerNoticeChecksumBytes = 8;

// The whole notice.
absl::StatusOr<std::string> EncodeLayerNotice(const LayerNotice& notice);
// The notice without its last kLayerNoticeChecksumBytes (the checksum), to be completed by
// the bytes of a little-endian u64 appended later.
absl::StatusOr<std::string> EncodeLayerNoticeHead(const LayerNotice& notice);
absl::StatusOr<LayerNotice> DecodeLayerNotice(absl::string_view payload);

// The stop notice: what a producer posts through the transport, to the consumer's peer,
// once every transfer of a request it stopped (it failed, or the consumer aborted it) has
// ended. The transport delivers it after the data of every write posted before it to that
// peer (transport.h's ordering), so a consumer that receives it knows that nothing of the
// request is still on its way and may let its blocks be reused; a confirmation on the
// control channel could overtake data still in the transport's socket.
//
//   u32 magic "KVS1"   str request_id (at most kMaxIdBytes)   u64 attempt
//   str reason (at most kMaxStopReasonBytes)
struct StopNotice {
  std::string request_id;
  uint64_t attempt = 0;  // the hand-off's (HandOffMsg::attempt)
  std::string reason;    // why it stopped (the consumer's load error quotes it)
};
inline constexpr uint32_t kMaxStopReasonBytes = 1024;
absl::StatusOr<std::string> EncodeStopNotice(const StopNotice& notice);
absl::StatusOr<StopNotice> DecodeStopNotice(absl::string_view payload);
// Whether `payload` starts as a stop notice does (which kind of notice to decode it as).
bool IsStopNotice(absl::string_view payload);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_SRC_LAYER_NOTICE_H_
