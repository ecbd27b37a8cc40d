// The uid a transport instance names itself by in its peer info, descriptors and hellos
// (private to transfer/): random, mixed with the pid and the clock, never 0. Distinct per
// transport instance with overwhelming probability, so that a peer can tell a restarted
// process from the one it knew.
#ifndef KVSTREAM_TRANSFER_SRC_TRANSPORT_UID_H_
#define KVSTREAM_TRANSFER_SRC_TRANSPORT_UID_H_

#include <unistd.h>

#include <cstdint>
#include <random>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvstream {
namespace internal {

inline uint64_t NewTransportUid() {
  std::random_device device;
  uint64_t uid = (static_cast<uint64_t>(device()) << 32) ^ device();
  uid ^= static_cast<uint64_t>(getpid()) << 16;
  uid ^= static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  return uid == 0 ? 1 : uid;
}

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_TRANSPORT_UID_H_
