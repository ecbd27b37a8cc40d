// Connectors by name.
#include "kvstream/connector/factory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/connector/layerwise_connector.h"
#include "kvstream/transfer/transport_factory.h"

namespace kvstream {

std::vector<std::string> KvConnectorNames() { return {"LayerwiseConnector", "kvstream"}; }

namespace {

absl::Status CheckName(const KvTransferConfig& config) {
  if (config.kv_connector != "LayerwiseConnector" && config.kv_connector != "kvstream") {
    return absl::NotFoundError(absl::StrCat("unknown kv_connector '", config.kv_connector,
                                            "' (choices: ", absl::StrJoin(KvConnectorNames(), ", "),
                                            ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvConnectorScheduler>> CreateKvConnectorScheduler(
    const KvTransferConfig& config, int32_t block_size) {
  RETURN_IF_ERROR(CheckName(config));
  return CreateLayerwiseScheduler(config, block_size);
}

TransportOptions WorkerTransportOptions(const KvTransferConfig& config) {
  TransportOptions options;
  options.name = config.kvstream.transport.empty()
                     ? DefaultTransportName(config.kv_buffer_device == "cuda" ? MemoryKind::kDevice
                                                                              : MemoryKind::kHost)
                     : config.kvstream.transport;
  options.cuda_device = config.kvstream.cuda_device;
  options.nccl_job_id = config.kvstream.nccl_job_id;
  options.nccl_listen_host = config.kvstream.nccl_listen_host;
  options.ucx_tls = config.kvstream.ucx_tls;
  options.ucx_net_devices = config.kvstream.ucx_net_devices;
  options.ucx_copy_threads = config.kvstream.ucx_copy_threads;
  options.loopback_name = config.engine_id;
  return options;
}

absl::StatusOr<std::unique_ptr<KvConnectorWorker>> CreateKvConnectorWorker(
    const KvTransferConfig& config, std::unique_ptr<Transport> transport) {
  RETURN_IF_ERROR(CheckName(config));
  if (transport == nullptr) {
    ASSIGN_OR_RETURN(transport, CreateTransport(WorkerTransportOptions(config)));
  }
  return CreateLayerwiseWorker(config, std::move(transport));
}

}  // namespace kvstream
