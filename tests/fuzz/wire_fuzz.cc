// libFuzzer target for the control channel's wire decoder: any input must decode to a value
// or an error, never crash or read out of bounds (run under ASan), and an accepted frame
// must re-encode to exactly the input (strict decoding admits only the encoder's image).
//
//   tests/fuzz/wire_fuzz -max_total_time=60 corpus_dir/
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvstream/transfer/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view input(reinterpret_cast<const char*>(data), size);

  absl::StatusOr<kvstream::ControlMessage> frame = kvstream::DecodeFrame(input);
  if (frame.ok()) {
    absl::StatusOr<std::string> again = kvstream::EncodeFrame(*frame);
    if (!again.ok() || *again != input) std::abort();
  }

  // The first byte picks a type; the rest is tried as that type's payload, so the payload
  // decoders are reached without the fuzzer having to discover a valid header first.
  if (size >= 1) {
    const auto type = static_cast<kvstream::MessageType>(1 + data[0] % 6);
    const absl::string_view payload = input.substr(1);
    absl::StatusOr<kvstream::ControlMessage> message = kvstream::DecodePayload(type, payload);
    if (message.ok()) {
      absl::StatusOr<std::string> again = kvstream::EncodeFrame(*message);
      if (!again.ok() || absl::string_view(*again).substr(kvstream::kFrameHeaderBytes) != payload) {
        std::abort();
      }
    }
  }
  return 0;
}
