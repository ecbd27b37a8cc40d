// The loopback transport: several Transport instances in one process, joined by a
// LoopbackFabric, for unit tests of the layers above (connector). Writes are memcpy
// performed inside Progress(), so tests see real asynchrony; a peer can be failed on demand
// to test error paths.
#ifndef KVSTREAM_TRANSFER_LOOPBACK_TRANSPORT_H_
#define KVSTREAM_TRANSFER_LOOPBACK_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {

// The shared medium of loopback transports. Thread-safe. Must outlive its transports.
class LoopbackFabric {
 public:
  LoopbackFabric();
  ~LoopbackFabric();
  LoopbackFabric(const LoopbackFabric&) = delete;
  LoopbackFabric& operator=(const LoopbackFabric&) = delete;

  // A new transport on this fabric; its LocalInfo() names it for Connect().
  absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(const std::string& name);

  // Makes every peer of `name` see it as failed with `error` (outstanding transfers fail).
  void FailEndpoint(const std::string& name, const absl::Status& error);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_LOOPBACK_TRANSPORT_H_
