// Layer ranges for routing KV by layer: in pipeline-parallel decode, a decode group is split
// into stages, each owning a contiguous range of the model's layers; the producer sends each
// layer of a request only to the stage that owns it.
//
//   "0-15,16-31"  -> {[0, 16), [16, 32)}     (ParseLayerRanges: inclusive bounds, in text)
//   EvenPipelinePartition(32, 2) -> {[0, 16), [16, 32)}
//   EvenPipelinePartition(10, 4) -> {[0, 2), [2, 5), [5, 8), [8, 10)}   (as vLLM splits)
#ifndef KVSTREAM_CONNECTOR_LAYER_ROUTING_H_
#define KVSTREAM_CONNECTOR_LAYER_ROUTING_H_

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvstream {

// Layer indices [begin, end).
struct LayerRange {
  int32_t begin = 0;
  int32_t end = 0;
  bool Contains(int32_t layer) const { return layer >= begin && layer < end; }
  int32_t size() const { return end - begin; }
  bool operator==(const LayerRange& o) const { return begin == o.begin && end == o.end; }
  bool operator!=(const LayerRange& o) const { return !(*this == o); }
};

// Parses comma-separated inclusive ranges, "A-B" or a single "A" ("0-15,16-31", "7").
// InvalidArgument naming the bad part for empty text, non-numbers, negative indices or
// B < A. The ranges are returned in the order written (not sorted, not merged).
absl::StatusOr<std::vector<LayerRange>> ParseLayerRanges(absl::string_view text);

// "0-15" for [0, 16), "7" for [7, 8); ranges joined by ",".
std::string FormatLayerRange(const LayerRange& range);
std::string FormatLayerRanges(const std::vector<LayerRange>& ranges);
// A set of layer indices as ranges ("0-3,8,10-11"); "none" when empty.
std::string FormatLayerSet(const std::set<int32_t>& layers);

// Checks that `stages` partitions layers [0, N) in order: stage 0 starts at 0, each stage
// starts where the previous one ended, none is empty. InvalidArgument saying which stages
// overlap or which layers no stage owns.
absl::Status ValidatePipelinePartition(const std::vector<LayerRange>& stages);

// vLLM's even split (vllm.distributed.utils.get_pp_indices): num_layers / num_stages layers
// per stage, the remainder given one each to the stages before the last, from the
// second-to-last backwards (the last stage also runs the LM head). InvalidArgument when
// num_stages < 1 or num_layers < num_stages.
absl::StatusOr<std::vector<LayerRange>> EvenPipelinePartition(int32_t num_layers,
                                                             int32_t num_stages);

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_LAYER_ROUTING_H_
