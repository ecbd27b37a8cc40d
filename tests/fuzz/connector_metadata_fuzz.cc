// Fuzz target for the bytes between a connector's two sides (connector_metadata.h): the
// step's metadata and the worker's output. Any input decodes to a value or an error, never a
// crash or an out-of-bounds read (run under ASan); an accepted input re-encodes to exactly
// itself (strict decoding admits only the encoder's image). The first byte picks which.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kvstream/connector/connector_metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const absl::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    auto meta = kvstream::DecodeConnectorMetadata(input);
    if (meta.ok()) {
      auto again = kvstream::EncodeConnectorMetadata(*meta);
      if (!again.ok() || *again != input) std::abort();
    }
  } else {
    auto out = kvstream::DecodeConnectorOutput(input);
    if (out.ok()) {
      auto again = kvstream::EncodeConnectorOutput(*out);
      if (!again.ok() || *again != input) std::abort();
    }
  }
  return 0;
}
