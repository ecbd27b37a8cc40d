// A small end-to-end run of kvstream's attention stack on the CPU: a registry of attention
// layers over paged caches, a few forward steps of a mixed batch (prefill, chunked prefill,
// decode), each step run by the fast CPU backend and by the golden reference on identical
// inputs, with the outputs and caches compared. `kvstream demo` runs it until the
// disaggregated demo exists.
#ifndef KVSTREAM_LAUNCH_ATTENTION_EXAMPLE_H_
#define KVSTREAM_LAUNCH_ATTENTION_EXAMPLE_H_

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"

namespace kvstream {

struct AttentionExampleOptions {
  int num_layers = 4;
  int num_heads = 8;
  int num_kv_heads = 2;
  int head_size = 64;
  int block_size = 16;
  std::string kv_cache_dtype = "auto";
  std::string model_dtype = "bfloat16";
  std::string layout = "HND";
  int decode_steps = 4;
  uint32_t seed = 1;
  double tolerance = 2e-2;  // max |fast - reference| allowed on outputs
};

// Runs the example, printing what it checks to `out`. Returns an error when an output or a
// cache differs beyond the tolerance, or when anything fails.
absl::Status RunAttentionExample(const AttentionExampleOptions& options, std::ostream& out);

}  // namespace kvstream

#endif  // KVSTREAM_LAUNCH_ATTENTION_EXAMPLE_H_
