// Fuzz target for kv_transfer_config parsing (connector/config.h): any text parses to a
// config or an InvalidArgument, never a crash, a hang or unbounded recursion.
#include <cstddef>
#include <cstdint>

#include "kvstream/connector/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  (void)kvstream::ParseKvTransferConfig(input);
  return 0;
}
