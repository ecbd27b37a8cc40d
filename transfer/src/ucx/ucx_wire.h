// The byte strings the UCX transport hands to peers (private to transfer/): the worker info
// behind Transport::LocalInfo(), the memory descriptor behind MemoryRegistration::
// descriptor(), and the header of notification active messages.
//
// Worker info and memory descriptor, all integers little-endian:
//   u32 magic   u16 version (1)   u16 reserved (0)
//   worker info: u64 transport uid   u32 n   n bytes of UCX worker address
//   descriptor:  u64 address   u64 length   u32 n   n bytes of packed UCX rkey
//   u64 FNV-1a-64 checksum of every byte before it
// Decoding is strict: a wrong magic, an unknown version, a non-zero reserved field, a length
// running past the input, trailing bytes, a zero or overflowing region, or a checksum
// mismatch is InvalidArgument. The checksum is there because UCX unpacks worker addresses
// and rkeys without a length: garbled bytes must never reach it.
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

inline constexpr uint16_t kUcxWireVersion = 1;
// Generous bounds on the blobs (UCX's are at most a few hundred bytes).
inline constexpr uint32_t kMaxUcxAddressBytes = 1u << 16;
inline constexpr uint32_t kMaxUcxRkeyBytes = 1u << 16;

struct UcxWorkerInfo {
  uint64_t uid = 0;  // identifies the transport instance (notifications carry it)
  std::string address;
};

struct UcxMemoryDescriptor {
  uint64_t address = 0;
  uint64_t length = 0;
  std::string rkey;
};

std::string EncodeWorkerInfo(const UcxWorkerInfo& info);
absl::StatusOr<UcxWorkerInfo> DecodeWorkerInfo(absl::string_view bytes);

std::string EncodeMemoryDescriptor(const UcxMemoryDescriptor& descriptor);
absl::StatusOr<UcxMemoryDescriptor> DecodeMemoryDescriptor(absl::string_view bytes);

// Notification active-message header: u32 magic   u16 version   u16 reserved   u64 sender uid.
inline constexpr size_t kNotificationHeaderBytes = 16;
using NotificationHeader = std::array<char, kNotificationHeaderBytes>;
NotificationHeader EncodeNotificationHeader(uint64_t sender_uid);
absl::StatusOr<uint64_t> DecodeNotificationHeader(absl::string_view bytes);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_UCX_WIRE_H_
