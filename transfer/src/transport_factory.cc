// Transports by name (transport_factory.h).
#include "kvstream/transfer/transport_factory.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvstream/transfer/cuda_ipc_transport.h"
#include "kvstream/transfer/loopback_transport.h"
#include "kvstream/transfer/nccl_transport.h"
#include "kvstream/transfer/ucx_transport.h"

namespace kvstream {
namespace {

// The fabric that "loopback" transports created by name share: one per process, never
// destroyed (transports may be destroyed during static destruction in any order).
LoopbackFabric& DefaultLoopbackFabric() {
  static LoopbackFabric* fabric = new LoopbackFabric();
  return *fabric;
}

}  // namespace

std::vector<std::string> TransportNames() {
  std::vector<std::string> names = {"ucx", "loopback"};
#if defined(KVSTREAM_HAVE_CUDA_IPC)
  names.push_back("cuda_ipc");
#endif
#if defined(KVSTREAM_HAVE_NCCL)
  names.push_back("nccl");
#endif
  return names;
}

std::string DefaultTransportName(MemoryKind cache_memory) {
#if defined(KVSTREAM_HAVE_CUDA_IPC)
  if (cache_memory == MemoryKind::kDevice) return "cuda_ipc";
#endif
  return "ucx";
}

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options) {
  if (options.name == "ucx") {
    UcxTransportOptions ucx;
    ucx.tls = options.ucx_tls;
    ucx.net_devices = options.ucx_net_devices;
    ucx.copy_threads = options.ucx_copy_threads;
    return CreateUcxTransport(ucx);
  }
  if (options.name == "loopback") {
    static std::atomic<uint64_t> next{0};
    const std::string name = options.loopback_name.empty()
                                 ? absl::StrCat("loopback-", next.fetch_add(1))
                                 : options.loopback_name;
    return DefaultLoopbackFabric().CreateTransport(name);
  }
  if (options.name == "cuda_ipc") {
#if defined(KVSTREAM_HAVE_CUDA_IPC)
    CudaIpcTransportOptions ipc;
    ipc.device = options.cuda_device;
    return CreateCudaIpcTransport(ipc);
#else
    return absl::FailedPreconditionError(
        "transport 'cuda_ipc': kvstream was built without CUDA (no nvcc when it was "
        "configured, or KVSTREAM_CUDA=OFF)");
#endif
  }
  if (options.name == "nccl") {
    NcclTransportOptions nccl;
    nccl.device = options.cuda_device;
    nccl.job_id = options.nccl_job_id;
    nccl.listen_host = options.nccl_listen_host;
    // Without NCCL in the build this says so (nccl_transport_none.cc).
    return CreateNcclTransport(nccl);
  }
  return absl::NotFoundError(absl::StrCat("unknown transport '", options.name, "' (choices: ",
                                          absl::StrJoin(TransportNames(), ", "), ")"));
}

}  // namespace kvstream
