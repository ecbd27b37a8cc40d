// Helpers the connector binding files share: the kv_transfer_config dict as kvstream's
// config, the connector's stats as dicts.
#ifndef KVSTREAM_PYTHON_CONNECTOR_H_
#define KVSTREAM_PYTHON_CONNECTOR_H_

#include <nanobind/nanobind.h>

#include "kvstream/connector/config.h"
#include "kvstream/connector/connector_stats.h"

namespace kvstream::python {

// A dict (serialised with Python's json module) or a str of JSON, parsed by kvstream's own
// parser (ParseKvTransferConfig), so Python takes exactly the keys C++ does. Raises
// InvalidArgumentError naming a bad key or value; TypeError for what json cannot serialise.
KvTransferConfig ConfigFromPython(nanobind::handle config);

nanobind::dict StatsToDict(const ConnectorStats& stats);

}  // namespace kvstream::python

#endif  // KVSTREAM_PYTHON_CONNECTOR_H_
