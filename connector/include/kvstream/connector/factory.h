// Connectors by name (kv_transfer_config's "kv_connector"): each side is created on its
// own, in the process that runs it.
#ifndef KVSTREAM_CONNECTOR_FACTORY_H_
#define KVSTREAM_CONNECTOR_FACTORY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvstream/connector/config.h"
#include "kvstream/connector/kv_connector_scheduler.h"
#include "kvstream/connector/kv_connector_worker.h"
#include "kvstream/transfer/transport.h"
#include "kvstream/transfer/transport_factory.h"

namespace kvstream {

// Names: "LayerwiseConnector" (also "kvstream"). NotFound for others, listing the choices;
// InvalidArgument for a config the connector cannot run (as CreateLayerwise*).
// `block_size`: tokens per cache block (the engine's cache configuration).
absl::StatusOr<std::unique_ptr<KvConnectorScheduler>> CreateKvConnectorScheduler(
    const KvTransferConfig& config, int32_t block_size);

// The transport is created by name (transport_factory.h) from the config
// (kv_connector_extra_config.transport, default by kv_buffer_device); pass one to inject it
// (tests wrap transports to inject faults). The producer side starts listening at once.
absl::StatusOr<std::unique_ptr<KvConnectorWorker>> CreateKvConnectorWorker(
    const KvTransferConfig& config, std::unique_ptr<Transport> transport = nullptr);

// The options CreateKvConnectorWorker creates its transport with when none is passed: the
// name (kv_connector_extra_config.transport, else DefaultTransportName of kv_buffer_device's
// memory) and every transport's settings from kv_connector_extra_config.
TransportOptions WorkerTransportOptions(const KvTransferConfig& config);

std::vector<std::string> KvConnectorNames();

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_FACTORY_H_
