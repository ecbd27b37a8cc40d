// Layer index from a layer name.
#include "kvstream/connector/layer_name.h"

#include <cctype>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvstream {

absl::StatusOr<int32_t> ParseLayerIndex(absl::string_view name) {
  int runs = 0;
  absl::string_view digits;
  for (size_t i = 0; i < name.size();) {
    if (std::isdigit(static_cast<unsigned char>(name[i]))) {
      size_t j = i;
      while (j < name.size() && std::isdigit(static_cast<unsigned char>(name[j]))) ++j;
      ++runs;
      digits = name.substr(i, j - i);
      i = j;
    } else {
      ++i;
    }
  }
  if (runs != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer name '", name, "' must contain exactly one integer (the layer index); it has ",
        runs));
  }
  int32_t index = 0;
  if (!absl::SimpleAtoi(digits, &index) || index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer name '", name, "': layer index ", digits, " is out of range"));
  }
  return index;
}

}  // namespace kvstream
