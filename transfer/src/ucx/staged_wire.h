// The active messages of the UCX transport's staged device path (private to transfer/;
// the protocol is described in ucx/staged_engine.h). All go under one active-message id;
// the header names the message and its sender, the body carries its fields. Integers
// little-endian (common/byte_io.h).
//
//   header:  u32 magic "SVUS"   u16 version (kUcxWireVersion)   u8 type   u8 reserved (0)
//            u64 sender uid   u64 stamp (the receiver's fence epoch, ucx_wire.h)
//   hello    (sender -> receiver): u32 n, n bytes: the sender's encoded UcxWorkerInfo
//   welcome  (receiver -> sender): u8 0 (ok) u32 slots u64 slot bytes u32 n, n bytes: the
//            encoded UcxMemoryDescriptor of the landing area (slots * slot bytes, host);
//            or u8 1 (refused) u32 n, n bytes of reason
//   chunk    (sender -> receiver): u64 seq   u32 chunk index   u32 chunk count   u32 slot
//            u64 region id   u32 n   n x (u64 remote offset, u64 length)
//   credit   (receiver -> sender): u32 n   n x u32 slot
//   abort    (sender -> receiver): u64 seq   u32 chunks sent
// Decoding is strict (InvalidArgument for a wrong magic or version, an unknown type, a
// non-zero reserved byte, truncation, trailing bytes, counts over their bounds, an index
// outside its count). What the fields must satisfy against the receiver's state (slot in
// range, pieces inside the region, the chunk's layout fitting a slot) is the engine's to
// check.
#ifndef KVSTREAM_TRANSFER_SRC_UCX_STAGED_WIRE_H_
#define KVSTREAM_TRANSFER_SRC_UCX_STAGED_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvstream {
namespace internal {

// Active-message id of the staged path's messages.
inline constexpr unsigned kStagedAmId = 18;
inline constexpr size_t kStagedHeaderBytes = 24;
inline constexpr uint32_t kMaxStagedSlots = 64;
inline constexpr uint32_t kMaxStagedCredits = 1024;
inline constexpr uint32_t kMaxRefusalBytes = 1024;

enum class StagedType : uint8_t { kHello = 1, kWelcome = 2, kChunk = 3, kCredit = 4, kAbort = 5 };

struct StagedHeader {
  StagedType type = StagedType::kHello;
  uint64_t sender_uid = 0;
  uint64_t stamp = 0;
};

struct StagedWelcome {
  bool ok = false;
  uint32_t slots = 0;
  uint64_t slot_bytes = 0;
  std::string landing_descriptor;  // ok only
  std::string reason;              // refused only
};

struct StagedChunkPiece {
  uint64_t remote_offset = 0;
  uint64_t length = 0;
};

struct StagedChunkMessage {
  uint64_t seq = 0;
  uint32_t index = 0;
  uint32_t count = 0;
  uint32_t slot = 0;
  uint64_t region_id = 0;
  std::vector<StagedChunkPiece> pieces;
};

struct StagedAbort {
  uint64_t seq = 0;
  uint32_t chunks_sent = 0;
};

std::string EncodeStagedHeader(StagedType type, uint64_t sender_uid, uint64_t stamp);
absl::StatusOr<StagedHeader> DecodeStagedHeader(absl::string_view bytes);

std::string EncodeHello(absl::string_view worker_info);
absl::StatusOr<std::string> DecodeHello(absl::string_view body);

std::string EncodeWelcome(const StagedWelcome& welcome);
absl::StatusOr<StagedWelcome> DecodeWelcome(absl::string_view body);

std::string EncodeChunk(const StagedChunkMessage& chunk);
absl::StatusOr<StagedChunkMessage> DecodeChunk(absl::string_view body);

std::string EncodeCredits(const std::vector<uint32_t>& slots);
absl::StatusOr<std::vector<uint32_t>> DecodeCredits(absl::string_view body);

std::string EncodeAbort(const StagedAbort& abort);
absl::StatusOr<StagedAbort> DecodeAbort(absl::string_view body);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_STAGED_WIRE_H_
