// Transports by name: the one place that turns a transport's name and settings into a
// concrete Transport, so that layers above (connector/) never build a concrete transport's
// options.
//
//   TransportOptions options;
//   options.name = "cuda_ipc";         // or "ucx", "loopback", "nccl"
//   options.cuda_device = 0;
//   ASSIGN_OR_RETURN(std::unique_ptr<Transport> transport, CreateTransport(options));
//
// Names: "ucx" (ucx_transport.h: host memory over shared memory or TCP; device memory staged
// through pinned host buffers), "loopback" (loopback_transport.h: the process's default
// fabric, for tests of the layers above), in builds with CUDA "cuda_ipc"
// (cuda_ipc_transport.h: device memory between processes of one host), and in builds with
// CUDA and NCCL "nccl" (nccl_transport.h: device memory between GPUs, over NCCL).
#ifndef KVSTREAM_TRANSFER_TRANSPORT_FACTORY_H_
#define KVSTREAM_TRANSFER_TRANSPORT_FACTORY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvstream/common/dtype.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {

// Every transport's settings; each transport reads its own and ignores the others.
struct TransportOptions {
  std::string name = "ucx";
  // Device transports (cuda_ipc, nccl; ucx's staged device path): the GPU this worker's
  // caches live on.
  int cuda_device = 0;
  // nccl (NcclTransportOptions): the job peers must share, and the numeric IPv4 address its
  // side connection listens on (peers on other hosts need one they can reach).
  std::string nccl_job_id;
  std::string nccl_listen_host = "127.0.0.1";
  // ucx (UcxTransportOptions): UCX_TLS, UCX_NET_DEVICES and copy threads.
  std::string ucx_tls = "shm";
  std::string ucx_net_devices;
  int32_t ucx_copy_threads = 0;
  // loopback: the name this transport has on the process's default fabric (unique per
  // process; empty: one is generated).
  std::string loopback_name;
};

// The transport named options.name. NotFound for an unknown name (the message lists
// TransportNames()); the transport's own error when it cannot start.
absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options);

// The names CreateTransport knows in this build.
std::vector<std::string> TransportNames();

// The transport a worker uses when its configuration names none: "cuda_ipc" for caches in
// device memory where the build has it (else "ucx", which stages device memory), "ucx" for
// host memory.
std::string DefaultTransportName(MemoryKind cache_memory);

}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_TRANSPORT_FACTORY_H_
