// What the cuda_ipc transport puts on the wire: the memory descriptor a peer imports, the
// LocalInfo a peer connects with, and the frames of the notification socket, each with a
// magic and a version, decoded strictly through ByteReader (a hostile, truncated or
// garbled input is InvalidArgument naming the field, never a crash or an allocation the
// bytes could not describe). Plain C++: no CUDA header, so it is built and tested
// everywhere.
//
// Descriptor (little-endian): magic u32 'KVID', version u16, owner uid u64, device i32,
// device uuid (16 bytes), IPC handle (64 bytes, cudaIpcMemHandle_t), allocation size u64,
// offset u64, length u64. REQUIRES (checked): length > 0, offset + length <= allocation
// size, without overflow.
//
// Peer info: magic u32 'KVII', version u16, uid u64, pid u32, socket name (u32 length +
// bytes, at most kMaxUnixSocketNameBytes).
//
// Frame: magic u32 'KVIF', version u8, type u8, reserved u16 (zero), payload length u32,
// then the payload. Hello (first frame of every connection): uid u64, pid u32.
// Notification: the bytes as delivered. Bye (the sender closes on purpose): empty.
//
// The framing (header, reader) is shared with the nccl transport's side connection, which
// uses it under its own magic and frame types (FrameFormat; nccl/nccl_wire.h).
#ifndef KVSTREAM_TRANSFER_CUDA_IPC_CUDA_IPC_WIRE_H_
#define KVSTREAM_TRANSFER_CUDA_IPC_CUDA_IPC_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvstream {
namespace internal {

inline constexpr size_t kCudaIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
inline constexpr size_t kCudaUuidBytes = 16;        // sizeof(cudaUUID_t)

struct CudaIpcMemoryDescriptor {
  uint64_t owner_uid = 0;    // the exporting transport's uid
  int32_t device = 0;        // the exporter's device ordinal (for messages only)
  std::string device_uuid;   // kCudaUuidBytes
  std::string ipc_handle;    // kCudaIpcHandleBytes: of the allocation's base
  uint64_t allocation_size = 0;
  uint64_t offset = 0;       // of the region in its allocation
  uint64_t length = 0;
};

std::string EncodeCudaIpcDescriptor(const CudaIpcMemoryDescriptor& descriptor);
absl::StatusOr<CudaIpcMemoryDescriptor> DecodeCudaIpcDescriptor(absl::string_view bytes);

struct CudaIpcPeerInfo {
  uint64_t uid = 0;
  uint32_t pid = 0;
  std::string socket_name;  // abstract Unix socket the transport listens on
};

std::string EncodeCudaIpcPeerInfo(const CudaIpcPeerInfo& info);
absl::StatusOr<CudaIpcPeerInfo> DecodeCudaIpcPeerInfo(absl::string_view bytes);

enum class IpcFrameType : uint8_t { kHello = 1, kNotification = 2, kBye = 3 };

inline constexpr size_t kIpcFrameHeaderBytes = 12;
// The largest notification (payload and tail together) a frame carries.
inline constexpr uint32_t kMaxIpcFramePayloadBytes = 1u << 20;

// What tells one user's frames from another's: the magic and version in every header, the
// frame types 1..max_type it knows, and what messages call such a frame.
struct FrameFormat {
  uint32_t magic = 0;
  uint8_t version = 0;
  uint8_t max_type = 0;
  const char* name = "";
};
inline constexpr FrameFormat kCudaIpcFrames{0x4649564B /* "KVIF" */, 1,
                                            static_cast<uint8_t>(IpcFrameType::kBye),
                                            "cuda_ipc frame"};

// REQUIRES: payload.size() <= kMaxIpcFramePayloadBytes, 1 <= type <= format.max_type.
std::string EncodeFrame(const FrameFormat& format, uint8_t type, absl::string_view payload);
// A frame of the cuda_ipc socket.
inline std::string EncodeIpcFrame(IpcFrameType type, absl::string_view payload) {
  return EncodeFrame(kCudaIpcFrames, static_cast<uint8_t>(type), payload);
}

struct IpcHello {
  uint64_t uid = 0;
  uint32_t pid = 0;
};
std::string EncodeIpcHello(const IpcHello& hello);
absl::StatusOr<IpcHello> DecodeIpcHello(absl::string_view payload);

// Cuts a byte stream into frames of `format`. Bytes are appended as they arrive; Next()
// returns the frames one by one. A header that is not a frame of this version (magic,
// version, type, reserved bits, length over the limit) is an error, after which the stream
// is unusable. Thread-compatible.
class IpcFrameReader {
 public:
  explicit IpcFrameReader(const FrameFormat& format = kCudaIpcFrames) : format_(format) {}
  void Append(const char* data, size_t n);
  // True and the frame when a whole one is buffered; false when more bytes are needed;
  // InvalidArgument for a malformed header.
  absl::StatusOr<bool> NextFrame(uint8_t* type, std::string* payload);
  // NextFrame for the cuda_ipc socket's frames.
  absl::StatusOr<bool> Next(IpcFrameType* type, std::string* payload) {
    uint8_t raw = 0;
    absl::StatusOr<bool> got = NextFrame(&raw, payload);
    if (got.ok() && *got) *type = static_cast<IpcFrameType>(raw);
    return got;
  }
  // Bytes buffered but not yet returned.
  size_t buffered() const { return buffer_.size() - pos_; }

 private:
  FrameFormat format_;
  std::string buffer_;
  size_t pos_ = 0;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CUDA_IPC_CUDA_IPC_WIRE_H_
