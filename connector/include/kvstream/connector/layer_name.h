// Layer names drive routing and transfer tags: "model.layers.12.self_attn.attn" is layer 12.
#ifndef KVSTREAM_CONNECTOR_LAYER_NAME_H_
#define KVSTREAM_CONNECTOR_LAYER_NAME_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvstream {

// The layer index in `layer_name`: the name must contain exactly one run of decimal digits
// between separators ("model.layers.12.self_attn.attn" -> 12). InvalidArgument naming the
// layer when it has none or several ("model.layers.12.experts.3.attn").
absl::StatusOr<int32_t> ParseLayerIndex(absl::string_view layer_name);

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_LAYER_NAME_H_
