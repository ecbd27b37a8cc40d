// Fuzz target for the connector's control messages and hello (connector/src/
// control_messages.h) and its layer and stop notices (layer_notice.h): the bytes a peer
// controls.
// Any input decodes to a value or an error, never a crash; an accepted input re-encodes to
// exactly itself. The first byte picks the decoder.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "connector/src/control_messages.h"
#include "connector/src/layer_notice.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const absl::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0: {
      auto m = kvstream::internal::DecodeConnectorMessage(input);
      if (m.ok()) {
        auto again = kvstream::internal::EncodeConnectorMessage(*m);
        if (!again.ok() || *again != input) std::abort();
      }
      break;
    }
    case 1: {
      auto h = kvstream::internal::DecodeConnectorHello(input);
      if (h.ok()) {
        auto again = kvstream::internal::EncodeConnectorHello(*h);
        if (!again.ok() || *again != input) std::abort();
      }
      break;
    }
    case 3: {
      auto n = kvstream::internal::DecodeStopNotice(input);
      if (n.ok()) {
        auto again = kvstream::internal::EncodeStopNotice(*n);
        if (!again.ok() || *again != input) std::abort();
      }
      break;
    }
    default: {
      auto n = kvstream::internal::DecodeLayerNotice(input);
      if (n.ok()) {
        auto again = kvstream::internal::EncodeLayerNotice(*n);
        if (!again.ok() || *again != input) std::abort();
      }
      break;
    }
  }
  return 0;
}
