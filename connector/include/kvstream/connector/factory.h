// Connectors by name (kv_transfer_config's "kv_connector").
#ifndef KVSTREAM_CONNECTOR_FACTORY_H_
#define KVSTREAM_CONNECTOR_FACTORY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvstream/connector/config.h"
#include "kvstream/connector/kv_connector.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {

// Names: "LayerwiseConnector" (also "kvstream"). NotFound for others, listing the choices.
// The transport is created by name (transport_factory.h) from the config
// (kv_connector_extra_config.transport, default by kv_buffer_device); pass one to inject it
// (tests wrap transports to inject faults).
absl::StatusOr<std::unique_ptr<KvConnector>> CreateKvConnector(
    const KvTransferConfig& config, std::unique_ptr<Transport> transport = nullptr);
std::vector<std::string> KvConnectorNames();

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_FACTORY_H_
