// Layer ranges and pipeline partitions (layer_routing.h).
#include "kvstream/connector/layer_routing.h"

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace kvstream {
namespace {

// A layer index bound: decimal digits only (no sign, no spaces inside), at most 1 << 20.
bool ParseIndex(absl::string_view text, int32_t& out) {
  text = absl::StripAsciiWhitespace(text);
  if (text.empty() || text.size() > 7) return false;
  for (char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  int32_t v = 0;
  if (!absl::SimpleAtoi(text, &v) || v > (1 << 20)) return false;
  out = v;
  return true;
}

}  // namespace

absl::StatusOr<std::vector<LayerRange>> ParseLayerRanges(absl::string_view text) {
  std::vector<LayerRange> out;
  if (absl::StripAsciiWhitespace(text).empty()) {
    return absl::InvalidArgumentError("layer ranges: empty (expected e.g. \"0-15,16-31\")");
  }
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const size_t dash = part.find('-');
    int32_t first = 0, last = 0;
    bool ok = false;
    if (dash == absl::string_view::npos) {
      ok = ParseIndex(part, first);
      last = first;
    } else {
      ok = ParseIndex(part.substr(0, dash), first) && ParseIndex(part.substr(dash + 1), last);
    }
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ranges \"", text, "\": \"", part,
          "\" is not a layer index or an inclusive range A-B of non-negative indices"));
    }
    if (last < first) {
      return absl::InvalidArgumentError(absl::StrCat("layer ranges \"", text, "\": range \"",
                                                     part, "\" ends before it starts"));
    }
    out.push_back({first, last + 1});
  }
  return out;
}

std::string FormatLayerRange(const LayerRange& r) {
  if (r.end - r.begin == 1) return absl::StrCat(r.begin);
  return absl::StrCat(r.begin, "-", r.end - 1);
}

std::string FormatLayerRanges(const std::vector<LayerRange>& ranges) {
  return absl::StrJoin(ranges, ",", [](std::string* out, const LayerRange& r) {
    out->append(FormatLayerRange(r));
  });
}

std::string FormatLayerSet(const std::set<int32_t>& layers) {
  if (layers.empty()) return "none";
  std::vector<LayerRange> runs;
  for (int32_t l : layers) {
    if (!runs.empty() && runs.back().end == l) {
      ++runs.back().end;
    } else {
      runs.push_back({l, l + 1});
    }
  }
  return FormatLayerRanges(runs);
}

absl::Status ValidatePipelinePartition(const std::vector<LayerRange>& stages) {
  if (stages.empty()) return absl::InvalidArgumentError("pipeline partition: no stages");
  int32_t next = 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    const LayerRange& r = stages[s];
    if (r.size() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("pipeline partition: stage ", s, " owns no layer"));
    }
    if (r.begin < next) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pipeline partition ", FormatLayerRanges(stages), ": stage ", s, " (layers ",
          FormatLayerRange(r), ") overlaps stage ", s - 1, " (layers ",
          FormatLayerRange(stages[s - 1]), ")"));
    }
    if (r.begin > next) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pipeline partition ", FormatLayerRanges(stages), ": layers ",
          FormatLayerRange({next, r.begin}), " are owned by no stage"));
    }
    next = r.end;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<LayerRange>> EvenPipelinePartition(int32_t num_layers,
                                                             int32_t num_stages) {
  if (num_stages < 1 || num_layers < num_stages) {
    return absl::InvalidArgumentError(absl::StrCat("cannot split ", num_layers, " layers into ",
                                                   num_stages, " pipeline stages"));
  }
  std::vector<int32_t> counts(num_stages, num_layers / num_stages);
  const int32_t remaining = num_layers % num_stages;
  for (int32_t i = 2; i < remaining + 2; ++i) ++counts[num_stages - i];
  std::vector<LayerRange> out;
  int32_t begin = 0;
  for (int32_t c : counts) {
    out.push_back({begin, begin + c});
    begin += c;
  }
  return out;
}

}  // namespace kvstream
