// `kvstream demo` (demo.h).
#include "demo.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "kvstream/common/cuda_status.h"
#include "layer_overlap.h"
#include "worker.h"

extern char** environ;

namespace kvstream {
namespace {

std::string SelfExe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "kvstream";
  buf[n] = '\0';
  return buf;
}

std::vector<std::string> ModelFlags(const ToyModelConfig& m) {
  return {absl::StrCat("--layers=", m.num_layers),
          absl::StrCat("--heads=", m.num_heads),
          absl::StrCat("--kv-heads=", m.num_kv_heads),
          absl::StrCat("--head-size=", m.head_size),
          absl::StrCat("--vocab=", m.vocab_size),
          absl::StrCat("--intermediate=", m.intermediate_size),
          absl::StrCat("--block-size=", m.block_size),
          absl::StrCat("--kv-cache-dtype=", m.kv_cache_dtype),
          absl::StrCat("--layout=", m.layout),
          absl::StrCat("--rope-theta=", m.rope_theta),
          absl::StrCat("--blas-threads=", m.blas_threads),
          absl::StrCat("--backend=", m.backend),
          absl::StrCat("--seed=", m.seed)};
}

// A child process running `kvstream worker --role=prefill`, output to a log file. Killed on
// destruction if still running.
class PrefillProcess {
 public:
  ~PrefillProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  absl::Status Start(const std::vector<std::string>& args, const std::string& log) {
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    const int rc = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("starting the prefill worker: ", std::strerror(rc)));
    }
    return absl::OkStatus();
  }
  // The exit status, or -1 if it did not exit by the deadline (it is then killed).
  int Wait(absl::Time deadline) {
    while (pid_ > 0) {
      int status = 0;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (absl::Now() > deadline) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
};

}  // namespace

int DemoDecodeGpu(int gpu_count) { return gpu_count >= 2 ? 1 : 0; }

bool DefaultDemoLoadAsync(ModelDevice device, int decode_gpu) {
  return device == ModelDevice::kCuda && decode_gpu == 0;
}

int RunDemo(const DemoOptions& o, std::ostream& out, std::ostream& err) {
  std::vector<int> lengths = o.prompt_lengths;
  if (lengths.empty()) {
    for (int i = 0; i < o.num_requests; ++i) {
      lengths.push_back(64 + (896 * i) / std::max(1, o.num_requests - 1));
    }
  }
  char dir_template[] = "/tmp/kvstream-demo-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) {
    err << "kvstream demo: cannot create a scratch directory: " << std::strerror(errno) << "\n";
    return 1;
  }
  const std::string dir = dir_template;
  const std::string address_file = dir + "/prefill.addr";
  const std::string log = dir + "/prefill.log";
  const std::string prefill_json = dir + "/prefill.json";
  const bool cuda = o.device == ModelDevice::kCuda;
  if (cuda) {
    const absl::Status gpu = CudaAvailability();
    if (!gpu.ok()) {
      err << "kvstream demo --device=cuda: " << gpu.message() << "\n";
      return 1;
    }
  }
  const int decode_gpu = cuda ? DemoDecodeGpu(GpuCount()) : 0;
  const bool load_async = o.load_async.value_or(DefaultDemoLoadAsync(o.device, decode_gpu));
  const std::string tls = o.transport == "tcp" ? "tcp" : "shm";
  // The workers' kv_transfer_config; `gpu`: the worker's cuda_device.
  const auto config_for = [&](int gpu) {
    return absl::StrCat(
        R"({"kv_connector": "LayerwiseConnector", "kv_port": 0, "kv_load_failure_policy": ")",
        o.failure_policy, R"(", "kv_connector_extra_config": {"verify_checksum": )",
        o.verify_checksum ? "true" : "false", R"(, "load_async": )",
        load_async ? "true" : "false",
        cuda ? absl::StrCat(R"(, "cuda_device": )", gpu) : std::string(), R"(, "ucx_tls": ")", tls,
        "\"", tls == "tcp" ? R"(, "ucx_net_devices": "lo")" : "", "}}");
  };

  if (cuda) {
    out << "kvstream demo: one prefill worker process on GPU 0 and one decode worker on GPU "
        << decode_gpu
        << ", KV over CUDA IPC, the CUDA model (bf16, cuBLAS) with the batch-invariant cuda "
           "attention backend\n";
  } else {
    out << "kvstream demo: one prefill and one decode worker process on this machine, UCX over "
        << (tls == "tcp" ? "TCP (loopback)" : "shared memory") << ", " << o.model.backend
        << " attention backend\n";
  }
  out << (load_async ? "KV streamed layer by layer; the decode worker runs a request once all "
                         "its layers arrived (load_async)\n"
                       : "KV streamed layer by layer; the decode worker's first step waits for "
                         "each layer as it arrives\n");
  out
      << absl::StrFormat("model: %d layers, %d query / %d KV heads x %d, MLP %d, vocabulary %d "
                         "(%.0f M parameters), block size %d, cache %s %s; %d requests, %d "
                         "tokens generated each\n",
                         o.model.num_layers, o.model.num_heads, o.model.num_kv_heads,
                         o.model.head_size, o.model.intermediate_size, o.model.vocab_size,
                         o.model.ParameterCount() / 1e6, o.model.block_size,
                         o.model.kv_cache_dtype, o.model.layout, lengths.size(), o.decode_steps);

  std::vector<std::string> args = {SelfExe(), "worker", "--role=prefill",
                                   "--kv-transfer-config=" + config_for(0),
                                   "--address-file=" + address_file,
                                   absl::StrCat("--serve=", lengths.size()),
                                   absl::StrCat("--num-blocks=", o.num_blocks),
                                   absl::StrCat("--idle-timeout=", o.timeout_s),
                                   "--json=" + prefill_json};
  for (const std::string& f : ModelFlags(o.model)) args.push_back(f);
  if (cuda) args.push_back("--device=cuda");
  PrefillProcess prefill;
  absl::Status started = prefill.Start(args, log);
  if (!started.ok()) {
    err << "kvstream demo: " << started << "\n";
    return 1;
  }

  WorkerOptions w;
  w.role = "decode";
  w.kv_transfer_config = config_for(decode_gpu);
  w.model = o.model;
  w.device = o.device;
  w.num_blocks = o.num_blocks;
  w.prompt_lengths = lengths;
  w.decode_steps = o.decode_steps;
  w.address_file = address_file;
  w.check_colocated = true;
  w.one_at_a_time = o.one_at_a_time;
  w.progress = &out;
  w.run_timeout_s = o.timeout_s;
  out << "running: prefill in the child process, decode here, then the same requests colocated"
      << std::endl;
  std::ostringstream worker_out;
  DecodeReport report;
  const int rc = RunWorker(w, worker_out, err, &report);
  const int prc = prefill.Wait(absl::Now() + absl::Seconds(30));
  if (report.results.empty()) {
    err << worker_out.str();
    std::ifstream plog(log);
    err << "--- prefill worker log (" << log << ")\n" << plog.rdbuf();
    return rc != 0 ? rc : 1;
  }

  // The prefill worker's side of each request: its prefill time and layer timeline.
  std::map<std::string, ProducerTimeline> producer;
  if (prc == 0) {
    absl::StatusOr<std::map<std::string, ProducerTimeline>> p = ReadPrefillReport(prefill_json);
    if (p.ok()) {
      producer = std::move(*p);
    } else {
      err << "kvstream demo: " << p.status() << " (no layer timeline)\n";
    }
  }

  // Report.
  out << absl::StrFormat("\n%-7s %6s %6s | %8s %8s %6s | %8s %8s %6s | %8s %7s | %7s %7s  %s\n",
                         "request", "prompt", "remote", "ttft ms", "coloc ms", "+%",
                         "prefill", "coloc", "+%", "KV MB", "GB/s", "last ms", "layer ms",
                         "check");
  out << absl::StrFormat("%-7s %6s %6s | %25s | %24s | %16s | %15s\n", "", "", "",
                         "time to first token", "prefill (stream on/off)", "transfer",
                         "after last layer");
  uint64_t total_bytes = 0;
  double total_transfer_ms = 0, ttft_sum = 0;
  nlohmann::json requests = nlohmann::json::array();
  std::map<std::string, LayerOverlap> overlaps;
  const auto pct = [](double a, double b) { return b > 0 ? (a / b - 1) * 100 : 0.0; };
  for (size_t i = 0; i < report.results.size(); ++i) {
    const RequestResult& r = report.results[i];
    const auto t = report.transfer.find(r.id);
    const auto p = producer.find(r.id);
    std::optional<LayerOverlap> overlap;
    if (t != report.transfer.end() && p != producer.end()) {
      absl::StatusOr<LayerOverlap> ov = ComputeLayerOverlap(t->second, p->second);
      if (ov.ok()) {
        overlap = *ov;
        overlaps[r.id] = *ov;
      } else {
        err << "kvstream demo: " << ov.status() << "\n";
      }
    }
    const uint64_t bytes = t != report.transfer.end() ? t->second.bytes : 0;
    const double transfer_ms = overlap ? overlap->transfer_ms : 0;
    const double gbps = transfer_ms > 0 ? bytes / (transfer_ms * 1e6) : 0;
    const double prefill_ms = p != producer.end() ? p->second.prefill_ms : 0;
    total_bytes += bytes;
    total_transfer_ms += transfer_ms;
    ttft_sum += r.ttft_ms;
    const bool match = i < report.matches_colocated.size() && report.matches_colocated[i];
    const RequestResult* coloc = i < report.colocated.size() && !report.colocated[i].id.empty()
                                     ? &report.colocated[i]
                                     : nullptr;
    const double coloc_ttft = coloc != nullptr ? coloc->ttft_ms : 0;
    const double coloc_prefill = coloc != nullptr ? coloc->prefill_ms : 0;
    out << absl::StrFormat(
        "%-7s %6d %6d | %8.1f %8.1f %+6.1f | %8.1f %8.1f %+6.1f | %8.1f %7.1f | %7.2f %7.2f  "
        "%s%s\n",
        r.id, r.prompt_tokens, r.remote_tokens, r.ttft_ms, coloc_ttft, pct(r.ttft_ms, coloc_ttft),
        prefill_ms, coloc_prefill, pct(prefill_ms, coloc_prefill), bytes / 1e6, gbps,
        overlap ? overlap->last_exposed_ms : 0.0, overlap ? overlap->median_copy_ms : 0.0,
        match ? "== colocated" : "!= colocated", r.recomputed ? " (recomputed)" : "");
    nlohmann::json j = {{"id", r.id},
                        {"prompt_tokens", r.prompt_tokens},
                        {"remote_tokens", r.remote_tokens},
                        {"ttft_ms", r.ttft_ms},
                        {"colocated_ttft_ms", coloc_ttft},
                        {"prefill_ms", prefill_ms},
                        {"colocated_prefill_ms", coloc_prefill},
                        {"transfer_bytes", bytes},
                        {"transfer_ms", transfer_ms},
                        {"exposed_transfer_ms",
                         t != report.transfer.end() ? t->second.exposed_ms : 0.0},
                        {"layer_wait_ms", t != report.transfer.end() ? t->second.wait_ms : 0.0},
                        {"kv_complete_ms",
                         t != report.transfer.end() ? t->second.complete_ms : 0.0},
                        {"output_tokens", r.output_tokens},
                        {"matches_colocated", match},
                        {"status", r.status.ToString()}};
    if (overlap) j["layers"] = LayerOverlapJson(*overlap);
    requests.push_back(std::move(j));
  }
  const double total_gbps = total_transfer_ms > 0 ? total_bytes / (total_transfer_ms * 1e6) : 0;
  out << absl::StrFormat(
      "total:  %.1f MB of KV in %.1f ms of transfer (%.2f GB/s), mean TTFT %.1f ms; %d decode "
      "steps in %.0f ms\n",
      total_bytes / 1e6, total_transfer_ms, total_gbps, ttft_sum / report.results.size(),
      report.steps, report.total_ms);
  out << "  (prefill: the forward pass of the prompt but its last token, at the prefill "
         "worker with the stream on and colocated without; last ms: from the prefill worker's "
         "last layer ready to its arrival at the decode worker; layer ms: one layer's "
         "transfer, the median)\n";

  // Timeline of the longest prompt: each layer ready at the prefill worker, its transfer
  // done, its arrival at the decode worker.
  const LayerOverlap* longest = nullptr;
  std::string longest_id;
  for (const auto& [id, ov] : overlaps) {
    if (longest == nullptr || ov.ready_ms.back() - ov.prefill_start_ms >
                                  longest->ready_ms.back() - longest->prefill_start_ms) {
      longest = &ov;
      longest_id = id;
    }
  }
  if (longest != nullptr) {
    const double max_ms = longest->arrival_ms.back();
    out << "\nlayers of " << longest_id
        << ", ms after the hand-off (ready: computed at the prefill worker; arrived: at the "
           "decode worker):\n";
    for (size_t l = 0; l < longest->arrival_ms.size(); ++l) {
      const int ready = static_cast<int>(longest->ready_ms[l] / max_ms * 50 + 0.5);
      const int arrived = static_cast<int>(longest->arrival_ms[l] / max_ms * 50 + 0.5);
      out << absl::StrFormat("  layer %2d ready %8.2f arrived %8.2f |%s%s\n", l,
                             longest->ready_ms[l], longest->arrival_ms[l],
                             std::string(std::clamp(ready, 0, 50), '#'),
                             std::string(std::clamp(arrived - ready, 0, 50), '>'));
    }
  }
  out << "\nprefill worker: exit status " << prc << " (log " << log << ")\n";
  out << (report.tokens_match ? "check: disaggregated tokens and logits are bit-identical to "
                                "the colocated run\n"
                              : "check: FAILED: disaggregated outputs differ from the colocated run\n");
  out << (report.blocks_leaked ? "check: FAILED: blocks leaked\n" : "check: no block leaked\n");
  // The demo exists to show KV arriving from the prefill worker: a request that had to be
  // recomputed locally (its KV late or lost) is a failure here, even though the recompute
  // policy kept its output right.
  int recomputed = 0;
  for (const auto& r : report.results) recomputed += r.recomputed ? 1 : 0;
  if (recomputed > 0) {
    out << "check: FAILED: " << recomputed << " of " << report.results.size()
        << " requests did not receive their KV from the prefill worker and were recomputed "
           "(see the load errors above)\n";
  } else {
    out << "check: every request's KV came from the prefill worker\n";
  }

  if (!o.json_path.empty()) {
    nlohmann::json j;
    j["tokens_match"] = report.tokens_match;
    j["all_ok"] = report.all_ok;
    j["blocks_leaked"] = report.blocks_leaked;
    j["requests"] = requests;
    j["transfer_gbps"] = total_gbps;
    j["transfer_bytes"] = total_bytes;
    j["transport"] = cuda ? std::string("cuda_ipc") : absl::StrCat("ucx-", tls);
    j["load_async"] = load_async;
    if (cuda) j["decode_gpu"] = decode_gpu;
    j["backend"] = cuda ? std::string("cuda") : o.model.backend;
    j["device"] = cuda ? "cuda" : "cpu";
    j["load_errors"] = report.stats.load_errors;
    j["requests_recomputed"] = recomputed;
    j["connector"] = ConnectorStatsJson(report.stats, report.peer_stats);
    std::ofstream f(o.json_path);
    f << j.dump(2) << "\n";
  }
  if (rc == 0 && prc != 0) {
    err << "kvstream demo: the prefill worker exited with status " << prc << "\n";
    return prc < 0 ? 1 : prc;
  }
  if (rc == 0 && recomputed > 0) return 3;  // as a failed request (demo.h)
  return rc;
}

}  // namespace kvstream
