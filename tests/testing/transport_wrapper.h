// TransportWrapper: a Transport that forwards every call to another one, as LevelDB's
// EnvWrapper forwards to an Env. A test double derives from it and overrides only the calls
// it changes (faulty_transport.h injects faults this way), so the real transports carry no
// test hooks.
//
//   class CountingTransport : public TransportWrapper {
//    public:
//     using TransportWrapper::TransportWrapper;
//     using Transport::PostWrite;
//     absl::StatusOr<TransferId> PostWrite(..., const WriteOrder& order) override {
//       ++posts_;
//       return TransportWrapper::PostWrite(..., order);
//     }
//   };
//
// Ownership: the wrapper owns the wrapped transport and destroys it with itself.
// Thread safety: as the wrapped transport's (every call is forwarded as is).
#ifndef KVSTREAM_TESTS_TESTING_TRANSPORT_WRAPPER_H_
#define KVSTREAM_TESTS_TESTING_TRANSPORT_WRAPPER_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvstream/transfer/transport.h"

namespace kvstream {

class TransportWrapper : public Transport {
 public:
  // REQUIRES: `target` is not null.
  explicit TransportWrapper(std::unique_ptr<Transport> target) : target_(std::move(target)) {}
  ~TransportWrapper() override = default;
  TransportWrapper(const TransportWrapper&) = delete;
  TransportWrapper& operator=(const TransportWrapper&) = delete;

  // The 5-argument PostWrite (no GPU work to wait for) stays visible next to the override.
  using Transport::PostWrite;

  Transport& target() const { return *target_; }

  absl::string_view name() const override { return target_->name(); }
  TransportCapabilities capabilities() const override { return target_->capabilities(); }
  absl::StatusOr<std::string> LocalInfo() override { return target_->LocalInfo(); }
  absl::StatusOr<std::unique_ptr<MemoryRegistration>> RegisterMemory(void* base, size_t length,
                                                                      MemoryKind kind) override {
    return target_->RegisterMemory(base, length, kind);
  }
  absl::StatusOr<std::unique_ptr<MemoryRegistration>> AllocateMemory(size_t length,
                                                                      MemoryKind kind) override {
    return target_->AllocateMemory(length, kind);
  }
  absl::StatusOr<PeerId> Connect(absl::string_view peer_info) override {
    return target_->Connect(peer_info);
  }
  absl::StatusOr<PeerId> Accept(absl::string_view peer_info) override {
    return target_->Accept(peer_info);
  }
  absl::StatusOr<std::unique_ptr<RemoteMemory>> ImportRemote(
      PeerId peer, absl::string_view descriptor) override {
    return target_->ImportRemote(peer, descriptor);
  }
  absl::StatusOr<TransferId> PostWrite(PeerId peer, const MemoryRegistration& local,
                                       const RemoteMemory& remote,
                                       absl::Span<const Segment> segments,
                                       absl::string_view notification,
                                       const WriteOrder& order) override {
    return target_->PostWrite(peer, local, remote, segments, notification, order);
  }
  absl::StatusOr<TransferId> PostNotification(PeerId peer, absl::string_view payload) override {
    return target_->PostNotification(peer, payload);
  }
  absl::StatusOr<TransferState> Test(TransferId id) override { return target_->Test(id); }
  absl::Status Cancel(TransferId id) override { return target_->Cancel(id); }
  void Release(TransferId id) override { target_->Release(id); }
  absl::Status Progress() override { return target_->Progress(); }
  std::vector<Notification> PollNotifications() override {
    return target_->PollNotifications();
  }
  absl::Status Disconnect(PeerId peer) override { return target_->Disconnect(peer); }
  absl::Status PeerStatus(PeerId peer) override { return target_->PeerStatus(peer); }
  void SetPeerErrorCallback(PeerErrorCallback callback) override {
    target_->SetPeerErrorCallback(std::move(callback));
  }

 private:
  const std::unique_ptr<Transport> target_;
};

}  // namespace kvstream

#endif  // KVSTREAM_TESTS_TESTING_TRANSPORT_WRAPPER_H_
