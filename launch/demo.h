// `kvstream demo`: the whole idea on one machine. It starts a prefill worker process (this
// same program, `kvstream worker --role=prefill`), runs the decode worker itself, serves a
// batch of requests of varied prompt lengths through the synthetic model with their KV
// streamed layer by layer from the prefill process, runs the same requests colocated, and
// prints a report: per request prompt length, time to first token beside the colocated
// run's, the prefill pass with the stream on (at the prefill worker) beside the colocated
// one, bytes moved and GB/s, the transfer left after the prefill worker's last layer beside
// one layer's transfer (layer_overlap.h), and the layer timeline of the longest request.
#ifndef KVSTREAM_LAUNCH_DEMO_H_
#define KVSTREAM_LAUNCH_DEMO_H_

#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "kvstream/serving/engine.h"
#include "kvstream/serving/toy_model.h"

namespace kvstream {

// The defaults make `kvstream demo` run for about a minute on a 2-core machine (a model of
// 16 layers and 113 million parameters, eight prompts of 64 to 960 tokens, 96 tokens
// generated each, then the same colocated); the progress lines show how a run goes.
struct DemoOptions {
  DemoOptions() {
    model.num_layers = 16;
    model.num_heads = 12;
    model.num_kv_heads = 4;
    model.head_size = 64;
    model.intermediate_size = 2048;
    model.vocab_size = 8192;
  }
  ToyModelConfig model;
  // kCuda: both workers run the CUDA model on GPU 0, KV over cuda_ipc (the transport flag
  // is then unused); without a usable GPU the demo says so and exits 1.
  ModelDevice device = ModelDevice::kCpu;
  int num_requests = 8;
  std::vector<int> prompt_lengths;  // empty: num_requests lengths spread over 64..960
  int decode_steps = 96;
  int64_t num_blocks = 1024;
  std::string transport = "shm";           // UCX over "shm" or "tcp" (loopback)
  std::string failure_policy = "recompute";
  std::string json_path;
  // Each request starts once the one before it finished (WorkerOptions::one_at_a_time).
  bool one_at_a_time = false;
  // The connector's verify_checksum (docs/configuration.md), for both workers.
  bool verify_checksum = true;
  // The connector's load_async (docs/configuration.md), for the decode worker; unset:
  // DefaultDemoLoadAsync.
  std::optional<bool> load_async;
  // The prefill worker's idle timeout, and the limit of each of the disaggregated and the
  // colocated runs.
  double timeout_s = 600;
};

// The GPU of the demo's decode worker with `gpu_count` GPUs visible: 1 where there are two
// or more (the prefill worker has GPU 0), else 0 (both share GPU 0).
int DemoDecodeGpu(int gpu_count);

// load_async where the options do not say: true when both workers run on one GPU, where a
// decode worker waiting layer by layer would interleave its kernels with the prefill's
// (contexts time-slice one GPU: 3-8% slower prefill at 8k tokens, against 0-2% with
// load_async, docs/benchmarks.md); false on the CPU and with a GPU each.
bool DefaultDemoLoadAsync(ModelDevice device, int decode_gpu);

// Exit status as `kvstream worker` (0 ok; 2 tokens differ; 3 a request failed; ...); a
// request whose KV did not arrive and was recomputed counts as failed (3) here.
int RunDemo(const DemoOptions& options, std::ostream& out, std::ostream& err);

}  // namespace kvstream

#endif  // KVSTREAM_LAUNCH_DEMO_H_
