// `kvstream worker`: one prefill (producer) or decode (consumer) worker process running the
// toy model through the Engine with a LayerwiseConnector. The decode worker hands its
// requests to the prefill worker, decodes them, then runs the same requests colocated in
// its own process and checks that every generated token and every logit is bit-identical.
//
// Pipeline-parallel decode: a decode worker can be one stage of a decode group
// (kv_connector_extra_config pipeline_parallel_size / pipeline_rank / pipeline_layers, or
// the --pp-* flags). It builds and registers only its stage's layers, receives only their
// KV, and runs each step together with the other stages (pipeline_link.h); the last stage
// checks the group's outputs against a colocated run of the whole model.
#ifndef KVSTREAM_LAUNCH_WORKER_H_
#define KVSTREAM_LAUNCH_WORKER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "kvstream/serving/engine.h"
#include "kvstream/connector/kv_connector.h"
#include "kvstream/serving/toy_model.h"

namespace kvstream {

struct WorkerOptions {
  std::string role;                 // "prefill" or "decode"
  std::string kv_transfer_config;   // vLLM's JSON
  ToyModelConfig model;
  // kCuda: the CUDA model on GPU kv_connector_extra_config.cuda_device (default 0), device
  // caches, kv_buffer_device "cuda" (so the transport defaults to cuda_ipc); the colocated
  // check runs on the same GPU.
  ModelDevice device = ModelDevice::kCpu;
  // kCuda: this GPU instead of the config's cuda_device (`kvstream worker --gpu`; under
  // --mpi, unless given, the rank's local rank modulo the GPUs visible).
  std::optional<int> gpu;
  int64_t num_blocks = 512;
  std::vector<int> prompt_lengths = {37, 120, 9, 64};
  int decode_steps = 8;
  int serve = 0;                    // prefill: exit after serving this many requests (0 = run until idle)
  double idle_timeout_s = 60;       // prefill: exit after this long without work
  double connect_timeout_s = 30;    // decode: how long to wait for the prefill worker
  // Decode: each of the disaggregated and the colocated runs must end within this (0: 120 s
  // plus twice the load and send timeouts, and 600 s for the colocated run).
  double run_timeout_s = 0;
  int crash_after_layer = -1;       // fault injection: SIGKILL self after this layer's hook
  bool check_colocated = true;      // decode: compare with a colocated run
  // Decode: each request starts once the one before it finished, in the disaggregated and
  // the colocated run alike, so that a request's time to first token has no queueing in it
  // (what the TTFT benchmarks measure); otherwise all start at once.
  bool one_at_a_time = false;
  // Decode: the prompts run this many times, one wave after the other (wave w's request
  // ids carry "w<w>-" when waves > 1, and its prompts are new tokens). Before each wave the
  // prefill workers' addresses are read again from their rendezvous files (a restarted
  // prefill worker publishes its new port there); from the second wave on, a prefill worker
  // that does not answer is not waited for: its requests are load errors (the failure
  // policy decides). Prefill: --serve counts every wave.
  int waves = 1;
  // Decode, with waves > 1: before wave w >= 1 wait (within the run's deadline) for the
  // file "<wave_gate>.w<w>" to exist, and after each wave w write
  // "<wave_gate>.d<index>.w<w>.done", so that a test or an operator can act between waves
  // (kill and restart a prefill worker). Empty: the waves follow each other at once.
  std::string wave_gate;
  // Write a JSON report here. Decode: the requests and their checks, the transfer stats;
  // one of several decode workers appends ".d<index>", a pipeline stage ".pp<rank>" (so
  // ranks of one mpirun can share the flag). Prefill: at exit, the requests served (prefill
  // time, each layer's ready and sent times: PrefillReportJson).
  std::string json_path;
  // Rendezvous through a file: the prefill worker writes "host:port" of its control channel
  // there once it listens (so it can use port 0); the decode worker waits for it and uses it
  // instead of kv_ip/kv_port.
  std::string address_file;
  // xPyD: several prefill and decode workers. Prefill worker p writes
  // "<address_file>.<p>" when num_prefill > 1; decode worker d names its requests
  // "d<d>-req-<i>" and sends request i to prefill worker (i + d) % num_prefill.
  int num_prefill = 1;
  int num_decode = 1;
  int index = 0;  // this worker's index among its role
  int metrics_port = -1;  // >= 0: serve Prometheus metrics on this port (0 = any free port)
  // Pipeline-parallel decode; each set value overrides the kv_transfer_config key.
  std::optional<int> pp_size;      // pipeline_parallel_size
  std::optional<int> pp_rank;      // pipeline_rank
  std::string pp_layers;           // pipeline_layers, e.g. "0-15,16-31"
  // Where the stages of decode worker `index` meet: stage s > 0 writes its address to
  // "<pp_rendezvous>.pp<s>". Empty: "<address_file>.d<index>".
  std::string pp_rendezvous;
  double pp_timeout_s = 600;       // how long a stage waits for the others in one step
  std::ostream* progress = nullptr;  // decode: progress lines of long runs go here
};

// What a decode worker saw, for reports.
struct DecodeReport {
  std::vector<RequestResult> results;           // sorted by id
  std::vector<bool> matches_colocated;          // per result
  // Per result, the same request's colocated run (logits dropped; an empty id where it
  // has none); empty without the check.
  std::vector<RequestResult> colocated;
  std::map<std::string, RequestTransferStats> transfer;  // by request id
  ConnectorStats stats;
  std::vector<PeerConnectorStats> peer_stats;
  double total_ms = 0;
  int64_t steps = 0;
  bool tokens_match = true;
  bool all_ok = true;
  bool blocks_leaked = false;
};

// Exit codes: 0 success; 1 error; 2 outputs differ from the colocated run; 3 a request
// failed; 4 blocks leaked; kExitNotDisaggregated (5) a decode worker whose requests all ran
// (recomputed) although no prefill worker could be reached or accepted it (so nothing was
// disaggregated). A decode worker fills `report` when it is not null.
inline constexpr int kExitNotDisaggregated = 5;
int RunWorker(const WorkerOptions& options, std::ostream& out, std::ostream& err,
              DecodeReport* report = nullptr);

// The connector's counters as JSON (the fields of the Prometheus metrics): the totals, and
// with `peers` a "peers" object holding the same counters by peer.
nlohmann::json ConnectorStatsJson(const ConnectorStats& stats,
                                  const std::vector<PeerConnectorStats>& peers = {});

// A prefill worker's --json report: per request served, the engine's id, prompt length,
// prefill_ms and prefill_start_ns (RequestResult), and from its RequestSendStats (matched by
// id) the consumer's id, layer_ready_ns and layer_sent_ns; the connector's stats.
nlohmann::json PrefillReportJson(const std::vector<RequestResult>& served,
                                 const std::map<std::string, RequestSendStats>& sends,
                                 const ConnectorStats& stats,
                                 const std::vector<PeerConnectorStats>& peers);

// How many requests prefill worker `prefill_index` serves in an xPyD run of these options.
int RequestsServedBy(const WorkerOptions& options, int prefill_index);

}  // namespace kvstream

#endif  // KVSTREAM_LAUNCH_WORKER_H_
