// The cuda_ipc transport's bookkeeping (cuda_ipc_transport.h says what the transport does):
// transfers, peers, copies in flight, and the handles it gives out. Private to
// transfer/src/cuda_ipc/; guarded by the transport's mutex.
//
// A transfer's life is TransferTable's (transfer_table.h): kQueued from PostWrite or
// PostNotification, in post order per peer. Its copy (if it has one) is an InFlightCopy in
// the transport's `inflight` FIFO, in stream order; when the copy's event has completed the
// transfer is copy_done, which is what lets it leave the queue: its notification frame goes
// on the peer's outgoing connection (kSending), and once the socket took the frame's last
// byte it is kDone. A failure or Cancel moves it to kFailed: its copy keeps running, and
// the InFlightCopy keeps the destination mapped until it ends.
#ifndef KVSTREAM_TRANSFER_CUDA_IPC_CUDA_IPC_STATE_H_
#define KVSTREAM_TRANSFER_CUDA_IPC_CUDA_IPC_STATE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "cuda_ipc/cuda_ipc_memory.h"
#include "cuda_ipc/ipc_connection.h"
#include "cuda_ipc/staging_ring.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/transfer/transport.h"
#include "transfer_table.h"

namespace kvstream {
namespace internal {

// The cuda_ipc part of a transfer (TransferTable holds the rest): whether its copy, and
// by stream order every earlier one, has completed.
struct IpcCopyWork {
  bool copy_done = false;
};
using IpcTransfers = TransferTable<IpcCopyWork>;

struct IpcPeer {
  PeerId id = 0;
  uint64_t uid = 0;
  uint32_t pid = 0;
  std::string label;  // "cuda_ipc peer 3 (uid 0x..., pid 1234)"
  // Ours, opened by Connect (null before, and once failed); theirs, accepted (notifications
  // arrive there; null until its hello, after its goodbye, and once failed).
  std::unique_ptr<IpcConnection> out;
  std::unique_ptr<IpcConnection> in;
  bool connected = false;  // Connect was called
  absl::Status status;     // OK while healthy
  // Peer allocations opened here, by IPC handle bytes.
  std::map<std::string, std::shared_ptr<IpcMapping>> mappings;
};

// GPU work of one PostWrite on the transport's stream.
struct InFlightCopy {
  TransferId transfer = 0;  // 0: work of a post that failed after enqueueing
  CudaEvent done;           // recorded after the copy; a timing event when `start` is set
  // While copy timing is on (CudaIpcSetCopyTiming): timing events recorded before the
  // write's first operation on the stream and right before its copy.
  CudaEvent start;
  CudaEvent kernel_start;
  StagingRing* ring = nullptr;  // whose oldest reservation is this copy's table; or null
  std::shared_ptr<IpcMapping> mapping;  // the destination, kept open until `done`
};

// A registered local range; from AllocateMemory it owns the memory.
class IpcRegistration final : public MemoryRegistration {
 public:
  IpcRegistration(const void* owner, void* base, size_t length, std::string descriptor,
                  DeviceBuffer owned)
      : owned_(std::move(owned)), owner_(owner), base_(base), length_(length),
        descriptor_(std::move(descriptor)) {}

  void* base() const override { return base_; }
  size_t length() const override { return length_; }
  MemoryKind memory_kind() const override { return MemoryKind::kDevice; }
  const std::string& descriptor() const override { return descriptor_; }
  const void* owner() const { return owner_; }

 private:
  DeviceBuffer owned_;  // empty unless from AllocateMemory
  const void* owner_;   // the transport
  void* base_;
  size_t length_;
  std::string descriptor_;
};

// A peer region: which allocation (its IPC handle, the key of the peer's mapping cache),
// where in it, how long.
class IpcRemote final : public RemoteMemory {
 public:
  IpcRemote(const void* owner, PeerId peer, std::string handle, uint64_t offset, uint64_t length)
      : owner_(owner), peer_(peer), handle_(std::move(handle)), offset_(offset),
        length_(length) {}

  PeerId peer() const override { return peer_; }
  size_t length() const override { return length_; }
  const void* owner() const { return owner_; }
  const std::string& handle() const { return handle_; }
  uint64_t offset() const { return offset_; }

 private:
  const void* owner_;
  PeerId peer_;
  std::string handle_;
  uint64_t offset_;
  uint64_t length_;
};

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_CUDA_IPC_CUDA_IPC_STATE_H_
