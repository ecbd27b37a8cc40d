// One connection of the cuda_ipc transport's notification socket (and of the nccl
// transport's side connection, a TCP socket carrying frames of its own FrameFormat): a
// non-blocking stream socket with an outgoing byte queue (frames wait there while the socket is full, so that
// posting never blocks) and an incoming frame reader. Progress drives it: Flush() writes
// what the socket takes, ReadAvailable() reads what is there.
//
// Thread-compatible: the transport calls it under its lock.
#ifndef KVSTREAM_TRANSFER_CUDA_IPC_IPC_CONNECTION_H_
#define KVSTREAM_TRANSFER_CUDA_IPC_IPC_CONNECTION_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cuda_ipc/cuda_ipc_wire.h"
#include "kvstream/transfer/socket.h"

namespace kvstream {
namespace internal {

class IpcConnection {
 public:
  IpcConnection(ScopedFd fd, std::string label, const FrameFormat& format = kCudaIpcFrames)
      : fd_(std::move(fd)), label_(std::move(label)), format_(format), reader_(format) {}

  const std::string& label() const { return label_; }
  void set_label(std::string label) { label_ = std::move(label); }

  // Queues a frame; returns the stream position just past it (compare with bytes_sent()).
  // REQUIRES: payload.size() <= kMaxIpcFramePayloadBytes, type valid for the format.
  uint64_t QueueFrame(uint8_t type, absl::string_view payload);
  uint64_t Queue(IpcFrameType type, absl::string_view payload) {
    return QueueFrame(static_cast<uint8_t>(type), payload);
  }
  // Writes what the socket takes now. Unavailable naming the peer when the connection broke.
  absl::Status Flush();
  uint64_t bytes_sent() const { return sent_; }
  bool idle() const { return out_pos_ == out_.size(); }

  // Reads what is waiting (at most about `max_bytes`) into reader(). True when the peer
  // closed the connection (after everything it sent before is in reader()); an error when
  // the connection broke.
  absl::StatusOr<bool> ReadAvailable(size_t max_bytes);
  IpcFrameReader& reader() { return reader_; }

 private:
  ScopedFd fd_;
  std::string label_;
  FrameFormat format_;
  std::string out_;     // queued bytes; [out_pos_, size) not yet written
  size_t out_pos_ = 0;
  uint64_t queued_ = 0;  // bytes queued since the connection opened
  uint64_t sent_ = 0;    // of which written to the socket
  IpcFrameReader reader_;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CUDA_IPC_IPC_CONNECTION_H_
