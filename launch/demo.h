// `kvstream demo`: the whole idea on one machine. It starts a prefill worker process (this
// same program, `kvstream worker --role=prefill`), runs the decode worker itself, serves a
// batch of requests of varied prompt lengths through the synthetic model with their KV
// streamed layer by layer from the prefill process, runs the same requests colocated, and
// prints a report: per request prompt length, time to first token, bytes moved, GB/s,
// exposed (not overlapped) transfer time, and a per-layer arrival timeline.
#ifndef KVSTREAM_LAUNCH_DEMO_H_
#define KVSTREAM_LAUNCH_DEMO_H_

#include <ostream>
#include <string>
#include <vector>

#include "toy_model.h"

namespace kvstream {

struct DemoOptions {
  ToyModelConfig model;
  int num_requests = 6;
  std::vector<int> prompt_lengths;  // empty: num_requests lengths spread over 40..600
  int decode_steps = 16;
  int64_t num_blocks = 1024;
  std::string transport = "shm";           // UCX over "shm" or "tcp" (loopback)
  std::string failure_policy = "recompute";
  std::string json_path;
  double timeout_s = 600;
};

// Exit status as `kvstream worker` (0 ok; 2 tokens differ; 3 a request failed; ...).
int RunDemo(const DemoOptions& options, std::ostream& out, std::ostream& err);

}  // namespace kvstream

#endif  // KVSTREAM_LAUNCH_DEMO_H_
