// The byte strings the UCX transport hands to peers (private to transfer/): the worker info
// behind Transport::LocalInfo(), the memory descriptor behind MemoryRegistration::
// descriptor(), and the header of notification active messages. Written and read with
// common/byte_io.h (ByteWriter / ByteReader).
//
// Worker info and memory descriptor, all integers little-endian:
//   u32 magic   u16 version (3)   u16 reserved (0)
//   worker info: u64 transport uid   u64 fence epoch   u32 n   n bytes of UCX worker
//                address (n >= 1)
//   descriptor:  u8 kind (1 host, 2 device)   u8 reserved (0)   u16 reserved (0)
//                u64 address   u64 length   u64 region id   u32 n   n bytes of packed rkey
//   u64 FNV-1a-64 checksum of every byte before it
// A host region (memory UCX registered; any of kHost and kPinned) carries an rkey (n >= 1)
// and region id 0. A device region (MemoryKind::kDevice, which this UCX cannot register:
// writes into it are staged, see ucx/staged_engine.h) carries no rkey (n = 0) and the
// non-zero id under which its owner's transport knows it; its address is informative.
// Decoding is strict: a wrong magic, an unknown version, a non-zero reserved field, an
// unknown kind, a kind whose rkey or region id does not match it, a length running past the
// input, trailing bytes, a zero or overflowing region, or a checksum mismatch is
// InvalidArgument. The checksum is there because UCX unpacks worker addresses and rkeys
// without a length: garbled bytes must never reach it.
//
// The fence epoch: how many times the transport had fenced a writer off (Disconnect) when
// it gave out this info. A writer stamps everything it sends to this transport with the
// epoch of the info it connected with, and the receiver drops what a writer it fenced off
// sent with a stamp from before that fence, even once it accepted that writer again: what
// was still in a TCP stream when the receiver gave the writer up, and arrives after a new
// handshake, cannot land in memory the receiver has given to others since.
//
// Version history: 1 had no kind, region id or notification watermark (host memory only);
// 2 added them; 3 added the fence epoch and the stamps. Older peers' bytes are refused by
// their version.
#ifndef KVSTREAM_TRANSFER_SRC_UCX_UCX_WIRE_H_
#define KVSTREAM_TRANSFER_SRC_UCX_UCX_WIRE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvstream {
namespace internal {

inline constexpr uint16_t kUcxWireVersion = 3;
// Generous bounds on the blobs (UCX's are at most a few hundred bytes).
inline constexpr uint32_t kMaxUcxAddressBytes = 1u << 16;
inline constexpr uint32_t kMaxUcxRkeyBytes = 1u << 16;

struct UcxWorkerInfo {
  uint64_t uid = 0;  // identifies the transport instance (notifications carry it)
  uint64_t fence_epoch = 0;
  std::string address;
};

enum class UcxRegionKind : uint8_t { kHost = 1, kDevice = 2 };

struct UcxMemoryDescriptor {
  UcxRegionKind kind = UcxRegionKind::kHost;
  uint64_t address = 0;
  uint64_t length = 0;
  uint64_t region_id = 0;  // device regions only (non-zero); 0 for host regions
  std::string rkey;        // host regions only (non-empty); empty for device regions
};

std::string EncodeWorkerInfo(const UcxWorkerInfo& info);
absl::StatusOr<UcxWorkerInfo> DecodeWorkerInfo(absl::string_view bytes);

std::string EncodeMemoryDescriptor(const UcxMemoryDescriptor& descriptor);
absl::StatusOr<UcxMemoryDescriptor> DecodeMemoryDescriptor(absl::string_view bytes);

// Notification active-message header:
//   u32 magic   u16 version   u16 reserved   u64 sender uid   u64 stamp   u64 staged
//   watermark
// The stamp is the receiver's fence epoch from the worker info the sender connected with.
// The watermark is how many staged (device) writes the sender had posted to the receiver
// when it posted this notification: the receiver delivers the notification only once that
// many of the sender's staged writes have landed (ucx/staged_engine.h).
inline constexpr size_t kNotificationHeaderBytes = 32;
using NotificationHeader = std::array<char, kNotificationHeaderBytes>;
struct NotificationHeaderFields {
  uint64_t sender_uid = 0;
  uint64_t stamp = 0;
  uint64_t watermark = 0;
};
NotificationHeader EncodeNotificationHeader(uint64_t sender_uid, uint64_t stamp,
                                            uint64_t watermark);
absl::StatusOr<NotificationHeaderFields> DecodeNotificationHeader(absl::string_view bytes);

// Write active-message header (writes sent as active messages, ucx/am_writes.h):
//   u32 magic   u16 version   u16 reserved   u64 sender uid   u64 stamp   u64 destination
//   address
// The payload is the bytes to write at the destination, an address in the receiver.
inline constexpr size_t kWriteHeaderBytes = 32;
using WriteHeader = std::array<char, kWriteHeaderBytes>;
struct WriteHeaderFields {
  uint64_t sender_uid = 0;
  uint64_t stamp = 0;
  uint64_t address = 0;
};
WriteHeader EncodeWriteHeader(uint64_t sender_uid, uint64_t stamp, uint64_t address);
absl::StatusOr<WriteHeaderFields> DecodeWriteHeader(absl::string_view bytes);

// Preamble and checksum helpers for the other UCX wire messages (ucx/staged_wire.h).
void PutUcxPreamble(std::string& out, uint32_t magic);
uint64_t UcxChecksum(absl::string_view bytes);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_UCX_WIRE_H_
