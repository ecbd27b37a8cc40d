// `kvstream worker`: one prefill (producer) or decode (consumer) worker process running the
// toy model through the Engine with a LayerwiseConnector. The decode worker hands its
// requests to the prefill worker, decodes them, then runs the same requests colocated in
// its own process and checks that every generated token and every logit is bit-identical.
#ifndef KVSTREAM_LAUNCH_WORKER_H_
#define KVSTREAM_LAUNCH_WORKER_H_

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "engine.h"
#include "kvstream/connector/kv_connector.h"
#include "toy_model.h"

namespace kvstream {

struct WorkerOptions {
  std::string role;                 // "prefill" or "decode"
  std::string kv_transfer_config;   // vLLM's JSON
  ToyModelConfig model;
  int64_t num_blocks = 512;
  std::vector<int> prompt_lengths = {37, 120, 9, 64};
  int decode_steps = 8;
  int serve = 0;                    // prefill: exit after serving this many requests (0 = run until idle)
  double idle_timeout_s = 60;       // prefill: exit after this long without work
  double connect_timeout_s = 30;    // decode: how long to wait for the prefill worker
  int crash_after_layer = -1;       // fault injection: SIGKILL self after this layer's hook
  bool check_colocated = true;      // decode: compare with a colocated run
  std::string json_path;            // decode: write a JSON report here
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
  std::ostream* progress = nullptr;  // decode: progress lines of long runs go here
};

// What a decode worker saw, for reports.
struct DecodeReport {
  std::vector<RequestResult> results;           // sorted by id
  std::vector<bool> matches_colocated;          // per result
  std::map<std::string, RequestTransferStats> transfer;  // by request id
  ConnectorStats stats;
  double total_ms = 0;
  int64_t steps = 0;
  bool tokens_match = true;
  bool all_ok = true;
  bool blocks_leaked = false;
};

// Exit codes: 0 success; 1 error; 2 outputs differ from the colocated run; 3 a request
// failed; 4 blocks leaked. A decode worker fills `report` when it is not null.
int RunWorker(const WorkerOptions& options, std::ostream& out, std::ostream& err,
              DecodeReport* report = nullptr);

// The connector's counters as JSON (the fields of the Prometheus metrics).
nlohmann::json ConnectorStatsJson(const ConnectorStats& stats);

// How many requests prefill worker `prefill_index` serves in an xPyD run of these options.
int RequestsServedBy(const WorkerOptions& options, int prefill_index);

}  // namespace kvstream

#endif  // KVSTREAM_LAUNCH_WORKER_H_
