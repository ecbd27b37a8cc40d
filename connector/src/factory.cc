// Connectors by name.
#include "kvstream/connector/factory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/connector/layerwise_connector.h"
#include "kvstream/transfer/ucx_transport.h"

namespace kvstream {

std::vector<std::string> KvConnectorNames() { return {"LayerwiseConnector", "kvstream"}; }

absl::StatusOr<std::unique_ptr<KvConnector>> CreateKvConnector(
    const KvTransferConfig& config, std::unique_ptr<Transport> transport) {
  if (config.kv_connector != "LayerwiseConnector" && config.kv_connector != "kvstream") {
    return absl::NotFoundError(absl::StrCat("unknown kv_connector '", config.kv_connector,
                                            "' (choices: ", absl::StrJoin(KvConnectorNames(), ", "),
                                            ")"));
  }
  if (transport == nullptr) {
    if (config.kvstream.transport != "ucx") {
      return absl::InvalidArgumentError(absl::StrCat(
          "transport '", config.kvstream.transport,
          "' cannot be created from a config (the loopback transport is injected by tests)"));
    }
    UcxTransportOptions options;
    options.tls = config.kvstream.ucx_tls;
    options.net_devices = config.kvstream.ucx_net_devices;
    options.copy_threads = config.kvstream.ucx_copy_threads;
    ASSIGN_OR_RETURN(transport, CreateUcxTransport(options));
  }
  return CreateLayerwiseConnector(config, std::move(transport));
}

}  // namespace kvstream
