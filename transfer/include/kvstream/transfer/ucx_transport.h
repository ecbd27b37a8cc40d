// The UCX transport: one UCP context and worker (error handling mode PEER), endpoints per
// peer, registered memory with packed remote keys, one-sided puts of segment batches, and
// notifications as active messages sent after an endpoint flush, so that a peer sees a
// notification only once the data before it is in place.
//
// Debian's UCX has no CUDA transports: host memory only here.
#ifndef KVSTREAM_TRANSFER_UCX_TRANSPORT_H_
#define KVSTREAM_TRANSFER_UCX_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {

struct UcxTransportOptions {
  // UCX transports to use (UCX_TLS syntax): "shm" (shared memory, same host), "tcp"
  // (sockets, also across hosts), or any UCX_TLS value such as "all".
  std::string tls = "shm";
  // Network devices for tcp (UCX_NET_DEVICES syntax); empty = UCX's choice. "lo" keeps TCP
  // on loopback.
  std::string net_devices;
  // How often UCX probes each peer (UCX_KEEPALIVE_INTERVAL); a peer that died without a
  // trace the transport would notice otherwise (e.g. one reached over shared memory) is
  // detected within a few intervals. Zero keeps UCX's default (20 s in UCX 1.13).
  absl::Duration keepalive_interval = absl::Seconds(1);
};

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const UcxTransportOptions& options);

}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_UCX_TRANSPORT_H_
