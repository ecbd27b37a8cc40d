// What the nccl transport puts on the wire (nccl_transport.h says what it does): the peer
// info a peer connects with (Transport::LocalInfo), the memory descriptor a peer imports, and
// the frames of the side connection, a TCP connection from the writer to the receiver that
// carries the communicator's ncclUniqueId, each batch's destination table ahead of its data,
// and the notifications. Each has a magic and a version and is decoded strictly through
// ByteReader: hostile, truncated or garbled bytes are InvalidArgument naming the field, never
// a crash or an allocation the bytes could not describe. Plain C++ (no CUDA or NCCL header),
// built and tested everywhere. Integers little-endian; strings u32 length + bytes.
//
// Peer info: magic u32 'KVNI', version u16, uid u64, pid u32, job id (str, at most
// kMaxNcclJobIdBytes), NCCL version u32 (ncclGetVersion), device i32, device uuid (16
// bytes), host (str, a numeric IPv4 address), port u16.
//
// Memory descriptor: magic u32 'KVND', version u16, owner uid u64, region id u64, length
// u64, device i32. REQUIRES (checked): uid, region id and length non-zero, device >= 0.
//
// Frames (cuda_ipc/cuda_ipc_wire.h's framing under kNcclFrames: magic 'KVNF', version 1):
//   hello        writer -> receiver, first frame: uid u64, pid u32, job id (str), NCCL
//                version u32, device uuid (16 bytes), ncclUniqueId (128 bytes)
//   welcome      receiver -> writer: u8 1, then what a batch may hold at the receiver: staged
//                bytes u64 (> 0) and pieces u32 (1..kMaxNcclPiecesPerBatch); or u8 0 and the
//                refusal (str, at most kMaxNcclReasonBytes)
//   batch        writer -> receiver, ahead of the batch's data: serial u64, region id u64,
//                message count u32 (1..kMaxNcclMessagesPerBatch), each message's piece
//                count u32 (>= 1), piece count u32 (their sum, at most
//                kMaxNcclPiecesPerBatch), each piece's remote offset u64 and length u64
//                (> 0; no message's bytes overflow)
//   notification writer -> receiver: the bytes as delivered
//   bye          either way: the sender closes on purpose (empty)
#ifndef KVSTREAM_TRANSFER_SRC_NCCL_NCCL_WIRE_H_
#define KVSTREAM_TRANSFER_SRC_NCCL_NCCL_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cuda_ipc/cuda_ipc_wire.h"

namespace kvstream {
namespace internal {

inline constexpr size_t kNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
inline constexpr size_t kNcclUuidBytes = 16;       // sizeof(cudaUUID_t)
inline constexpr uint32_t kMaxNcclJobIdBytes = 256;
inline constexpr uint32_t kMaxNcclHostBytes = 64;
inline constexpr uint32_t kMaxNcclReasonBytes = 4096;
// A batch is one NCCL group: its messages are that group's operations (NCCL takes at most
// 2048 per group), and its frame must fit kMaxIpcFramePayloadBytes.
inline constexpr uint32_t kMaxNcclMessagesPerBatch = 1024;
inline constexpr uint32_t kMaxNcclPiecesPerBatch = 60000;

struct NcclPeerInfo {
  uint64_t uid = 0;
  uint32_t pid = 0;
  std::string job_id;
  uint32_t nccl_version = 0;
  int32_t device = 0;
  std::string device_uuid;  // kNcclUuidBytes
  std::string host;
  uint16_t port = 0;
};
std::string EncodeNcclPeerInfo(const NcclPeerInfo& info);
absl::StatusOr<NcclPeerInfo> DecodeNcclPeerInfo(absl::string_view bytes);

struct NcclMemoryDescriptor {
  uint64_t owner_uid = 0;
  uint64_t region_id = 0;
  uint64_t length = 0;
  int32_t device = 0;
};
std::string EncodeNcclDescriptor(const NcclMemoryDescriptor& descriptor);
absl::StatusOr<NcclMemoryDescriptor> DecodeNcclDescriptor(absl::string_view bytes);

enum class NcclFrameType : uint8_t {
  kHello = 1,
  kWelcome = 2,
  kBatch = 3,
  kNotification = 4,
  kBye = 5,
};
inline constexpr FrameFormat kNcclFrames{0x464E564B /* "KVNF" */, 1,
                                         static_cast<uint8_t>(NcclFrameType::kBye),
                                         "nccl frame"};

struct NcclHello {
  uint64_t uid = 0;
  uint32_t pid = 0;
  std::string job_id;
  uint32_t nccl_version = 0;
  std::string device_uuid;  // kNcclUuidBytes
  std::string unique_id;    // kNcclUniqueIdBytes
};
std::string EncodeNcclHello(const NcclHello& hello);
absl::StatusOr<NcclHello> DecodeNcclHello(absl::string_view payload);

struct NcclWelcome {
  bool ok = false;
  uint64_t max_staged_bytes = 0;  // ok only
  uint32_t max_pieces = 0;        // ok only
  std::string reason;             // refused only
};
std::string EncodeNcclWelcome(const NcclWelcome& welcome);
absl::StatusOr<NcclWelcome> DecodeNcclWelcome(absl::string_view payload);

struct NcclRemotePiece {
  uint64_t offset = 0;  // in the receiver's region
  uint64_t length = 0;
};

// What the receiver learns of a batch before its data: where each message's bytes go. The
// data of message i is the concatenation of its pieces, in order.
struct NcclBatchHeader {
  uint64_t serial = 0;  // batches sent on this link before this one
  uint64_t region_id = 0;
  std::vector<uint32_t> message_pieces;  // pieces of each message
  std::vector<NcclRemotePiece> pieces;   // message by message
};
// REQUIRES: the header satisfies what DecodeNcclBatch checks.
std::string EncodeNcclBatch(const NcclBatchHeader& header);
absl::StatusOr<NcclBatchHeader> DecodeNcclBatch(absl::string_view payload);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_NCCL_NCCL_WIRE_H_
