// `kvstream worker` (worker.h).
#include "worker.h"

#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "kvstream/serving/engine.h"
#include "metrics_server.h"
#include "worker_rendezvous.h"
#include "kvstream/serving/pipeline_link.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/connector/config.h"
#include "kvstream/connector/factory.h"
#include "kvstream/connector/layer_name.h"
#include "kvstream/transfer/control_channel.h"

namespace kvstream {
namespace {

// Fault injection for the kill tests: forwards to the connector, then kills this process
// (SIGKILL: no cleanup, as a crash) once the given layer's hook has run.
class CrashingHook : public TransferHook {
 public:
  CrashingHook(TransferHook* inner, int layer) : inner_(inner), layer_(layer) {}
  absl::Status BeforeAttention(absl::string_view layer_name, void* stream) override {
    absl::Status s = inner_->BeforeAttention(layer_name, stream);
    MaybeCrash(layer_name, /*producer_side=*/false);
    return s;
  }
  absl::Status AfterAttention(absl::string_view layer_name, const KvCache& cache,
                              const AttentionMetadata& md, void* stream) override {
    absl::Status s = inner_->AfterAttention(layer_name, cache, md, stream);
    MaybeCrash(layer_name, /*producer_side=*/true);
    return s;
  }
  bool producer = false;
  bool armed = false;  // set once the step carries remote traffic

 private:
  void MaybeCrash(absl::string_view layer_name, bool producer_side) {
    if (!armed || producer_side != producer) return;
    auto index = ParseLayerIndex(layer_name);
    if (index.ok() && *index == layer_) {
      std::fprintf(stderr, "worker: crashing on purpose after layer %d\n", layer_);
      std::fflush(stderr);
      raise(SIGKILL);
    }
  }
  TransferHook* inner_;
  int layer_;
};

}  // namespace

// Requests a prefill worker serves in an xPyD run: request i of decode worker d goes to
// prefill worker (i + d) % num_prefill.
int RequestsServedBy(const WorkerOptions& o, int prefill_index) {
  int n = 0;
  for (int d = 0; d < o.num_decode; ++d) {
    for (size_t i = 0; i < o.prompt_lengths.size(); ++i) {
      if (static_cast<int>((i + d) % o.num_prefill) == prefill_index) ++n;
    }
  }
  return n * std::max(1, o.waves);  // the same in every wave
}

namespace {

// Every wave's requests, wave after wave (WorkerOptions::waves).
std::vector<RequestSpec> MakeRequests(const WorkerOptions& o) {
  std::vector<RequestSpec> out;
  std::mt19937 rng(o.model.seed * 7919u + 17u);
  for (int w = 0; w < std::max(1, o.waves); ++w) {
    const std::string wave = o.waves > 1 ? absl::StrCat("w", w, "-") : "";
    for (size_t i = 0; i < o.prompt_lengths.size(); ++i) {
      RequestSpec r;
      r.id = o.num_decode > 1 ? absl::StrCat("d", o.index, "-", wave, "req-", i)
                              : absl::StrCat(wave, "req-", i);
      for (int t = 0; t < o.prompt_lengths[i]; ++t) {
        r.prompt.push_back(
            static_cast<int32_t>(rng() % static_cast<uint32_t>(o.model.vocab_size)));
      }
      r.max_new_tokens = o.decode_steps;
      out.push_back(std::move(r));
    }
  }
  return out;
}

// Runs `engine` until it has no work or `deadline` passes. With `progress`, a line every
// second of a long run says how far it got.
absl::Status Drain(Engine& engine, absl::Time deadline, std::ostream* progress = nullptr,
                   absl::string_view what = "") {
  const absl::Time start = absl::Now();
  absl::Time next_report = start + absl::Seconds(1);
  while (engine.HasWork()) {
    const absl::Time now = absl::Now();
    if (now > deadline) {
      return absl::DeadlineExceededError("the engine did not finish its requests in time");
    }
    if (progress != nullptr && now > next_report) {
      *progress << absl::StrFormat("  %s: %.0f s, %d steps\n", what,
                                   absl::ToDoubleSeconds(now - start), engine.steps())
                << std::flush;
      next_report = now + absl::Seconds(1);
    }
    auto ran = engine.Step();
    if (!ran.ok()) return ran.status();
    // Nothing ran: the engine waits for blocks or for KV to arrive.
    if (!*ran) absl::SleepFor(absl::Microseconds(100));
  }
  return absl::OkStatus();
}

// Adds `requests` to `engine` and runs it until they finished: all at once, or each after
// the one before it finished (WorkerOptions::one_at_a_time). `producer_of(i)` is request
// i's producer (none for a colocated run).
absl::Status RunRequests(Engine& engine, const std::vector<RequestSpec>& requests,
                         const std::function<std::optional<RemotePrefill>(size_t)>& producer_of,
                         bool one_at_a_time, absl::Time deadline, std::ostream* progress,
                         absl::string_view what) {
  for (size_t i = 0; i < requests.size(); ++i) {
    RequestSpec r = requests[i];
    r.remote = producer_of(i);
    RETURN_IF_ERROR(engine.AddRequest(std::move(r)));
    if (one_at_a_time) RETURN_IF_ERROR(Drain(engine, deadline, progress, what));
  }
  return Drain(engine, deadline, progress, what);
}

// What the pipeline stages of one decode group must share (StageChannelOptions::group_key):
// the group's engine id, every model field that changes the numbers the stages pass along,
// and under mpirun the job (its PMIx namespace), so that stages of another job or model that
// find the same rendezvous files are refused at the hello.
std::string StageGroupKey(const std::string& group_engine_id, const ToyModelConfig& m) {
  const char* job = std::getenv("PMIX_NAMESPACE");
  return absl::StrCat("engine ", group_engine_id, "; model vocab ", m.vocab_size, " layers ",
                      m.num_layers, " heads ", m.num_heads, "/", m.num_kv_heads, " head size ",
                      m.head_size, " mlp ", m.intermediate_size, " rope ", m.rope_theta,
                      " block ", m.block_size, " kv ", m.kv_cache_dtype, " ", m.layout,
                      " seed ", m.seed, "; job ", job != nullptr ? job : "-");
}

int Fail(std::ostream& err, const absl::Status& s) {
  err << "kvstream worker: " << s << "\n";
  return 1;
}

// The SIGTERM or SIGINT a serving prefill worker received (0: none); see StopSignals.
volatile sig_atomic_t g_stop_signal = 0;
extern "C" void RecordStopSignal(int signal_number) { g_stop_signal = signal_number; }

// While it lives, SIGTERM and SIGINT are recorded (received()) instead of ending the
// process, so that a prefill worker asked to stop (a service manager, Ctrl-C) finishes the
// transfers in hand and checks its blocks before it exits. The previous handlers are
// restored on destruction.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction action {};
    action.sa_handler = RecordStopSignal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGTERM, &action, &old_term_);
    sigaction(SIGINT, &action, &old_int_);
  }
  ~StopSignals() {
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGINT, &old_int_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  int received() const { return g_stop_signal; }

 private:
  struct sigaction old_term_ {};
  struct sigaction old_int_ {};
};

}  // namespace

int RunWorker(const WorkerOptions& o, std::ostream& out, std::ostream& err,
              DecodeReport* decode_report) {
  auto config = ParseKvTransferConfig(o.kv_transfer_config.empty() ? "{}" : o.kv_transfer_config);
  if (!config.ok()) return Fail(err, config.status());
  if (config->kv_connector.empty()) config->kv_connector = "LayerwiseConnector";
  const bool prefill = o.role == "prefill";
  if (!prefill && o.role != "decode") {
    return Fail(err, absl::InvalidArgumentError(
                         absl::StrCat("--role must be prefill or decode, not '", o.role, "'")));
  }
  config->kv_role = prefill ? KvRole::kProducer : KvRole::kConsumer;
  // The CUDA model's GPU is this thread's for the whole run.
  std::optional<CudaDeviceScope> gpu;
  if (o.device == ModelDevice::kCuda) {
    config->kv_buffer_device = "cuda";  // the CUDA model's caches are device memory
    const absl::Status available = CudaAvailability();
    if (!available.ok()) {
      return Fail(err, absl::FailedPreconditionError(
                           absl::StrCat("--device=cuda: ", available.message())));
    }
    if (o.gpu) config->kvstream.cuda_device = *o.gpu;
    gpu.emplace(config->kvstream.cuda_device);
    if (!gpu->status().ok()) return Fail(err, gpu->status());
    out << o.role << " worker " << o.index << " on GPU " << config->kvstream.cuda_device
        << std::endl;
  }
  // Pipeline-parallel decode: flags override the config's keys.
  KvstreamSettings& k = config->kvstream;
  if (prefill) {
    // The pipeline settings describe decode workers (one mpirun passes the same flags and
    // config to every rank): a prefill worker has every layer.
    k.pipeline_parallel_size = 1;
    k.pipeline_rank = 0;
    k.pipeline_layers.clear();
  } else {
    if (!o.pp_layers.empty()) {
      auto ranges = ParseLayerRanges(o.pp_layers);
      if (!ranges.ok()) return Fail(err, ranges.status());
      absl::Status partition = ValidatePipelinePartition(*ranges);
      if (!partition.ok()) return Fail(err, partition);
      k.pipeline_layers = *ranges;
      if (!o.pp_size) k.pipeline_parallel_size = static_cast<int32_t>(ranges->size());
    }
    if (o.pp_size) k.pipeline_parallel_size = *o.pp_size;
    if (o.pp_rank) k.pipeline_rank = *o.pp_rank;
  }
  const bool pipeline = k.pipeline_parallel_size > 1;
  LayerRange stage_layers{0, o.model.num_layers};
  std::string stage_name;
  if (pipeline) {
    if (!k.pipeline_layers.empty() &&
        static_cast<int32_t>(k.pipeline_layers.size()) != k.pipeline_parallel_size) {
      return Fail(err, absl::InvalidArgumentError(absl::StrCat(
                           "pipeline layers ", FormatLayerRanges(k.pipeline_layers), " name ",
                           k.pipeline_layers.size(), " stages, the pipeline size is ",
                           k.pipeline_parallel_size)));
    }
    if (k.pipeline_rank < 0 || k.pipeline_rank >= k.pipeline_parallel_size) {
      return Fail(err, absl::InvalidArgumentError(absl::StrCat(
                           "pipeline rank ", k.pipeline_rank, " is not below the pipeline size ",
                           k.pipeline_parallel_size)));
    }
    auto range = PipelineStageLayers(k, o.model.num_layers);
    if (!range.ok()) return Fail(err, range.status());
    stage_layers = *range;
    stage_name = absl::StrCat(" stage ", k.pipeline_rank, "/", k.pipeline_parallel_size,
                              " (layers ", FormatLayerRange(stage_layers), ")");
  }
  const bool last_stage = !pipeline || k.pipeline_rank + 1 == k.pipeline_parallel_size;
  absl::StrAppend(&config->engine_id, prefill ? "-prefill" : "-decode", o.index);
  const std::string group_engine_id = config->engine_id;
  if (pipeline) absl::StrAppend(&config->engine_id, "-pp", k.pipeline_rank);

  // The stages of a decode group meet before building their models (which can take long).
  std::unique_ptr<StageChannel> stages;
  if (pipeline) {
    StageChannelOptions so;
    so.stage = k.pipeline_rank;
    so.num_stages = k.pipeline_parallel_size;
    so.rendezvous = o.pp_rendezvous.empty() && !o.address_file.empty()
                        ? absl::StrCat(o.address_file, ".d", o.index)
                        : o.pp_rendezvous;
    if (so.rendezvous.empty()) {
      return Fail(err, absl::InvalidArgumentError(
                           "pipeline stages meet through files: give --address-file or "
                           "--pp-rendezvous"));
    }
    so.listen_host = config->kv_ip == "127.0.0.1" || config->kv_ip == "localhost"
                         ? "127.0.0.1"
                         : "0.0.0.0";
    so.timeout = absl::Seconds(o.connect_timeout_s);
    so.group_key = StageGroupKey(group_engine_id, o.model);
    auto channel = ConnectStages(so);
    if (!channel.ok()) return Fail(err, channel.status());
    stages = std::move(*channel);
  }

  // The connector's two sides, as vLLM would run them in its scheduler and worker processes.
  auto scheduler = CreateKvConnectorScheduler(*config, o.model.block_size);
  if (!scheduler.ok()) return Fail(err, scheduler.status());
  auto connector = CreateKvConnectorWorker(*config);
  if (!connector.ok()) return Fail(err, connector.status());
  std::unique_ptr<CrashingHook> crash;
  EngineOptions eo;
  eo.model = o.model;
  eo.device = o.device;
  eo.num_blocks = o.num_blocks;
  eo.scheduler = scheduler->get();
  eo.worker = connector->get();
  eo.failure_policy = config->kv_load_failure_policy;
  eo.scatter_seed = prefill ? 11 : 23;  // different scatter on each side
  if (pipeline) {
    eo.layers = stage_layers;
    eo.pipeline = stages.get();
    eo.stage_timeout = absl::Seconds(o.pp_timeout_s);
  }
  if (o.crash_after_layer >= 0) {
    crash = std::make_unique<CrashingHook>(connector->get(), o.crash_after_layer);
    crash->producer = prefill;
    crash->armed = true;
    eo.hook = crash.get();
  }
  auto engine = Engine::Create(eo);
  if (!engine.ok()) return Fail(err, engine.status());
  std::unique_ptr<MetricsServer> metrics;
  if (o.metrics_port >= 0) {
    KvConnectorWorker* c = connector->get();
    const std::string role(KvRoleName(config->kv_role));
    const std::string id = config->engine_id;
    auto m = MetricsServer::Start(o.metrics_port, [c, role, id] {
      return RenderConnectorMetrics(c->peer_stats(), role, id);
    });
    if (!m.ok()) return Fail(err, m.status());
    metrics = std::move(*m);
    out << "metrics on http://0.0.0.0:" << metrics->port() << "/metrics" << std::endl;
  }

  if (prefill) {
    out << "prefill worker " << config->engine_id << " listening on "
        << (*connector)->control_address() << std::endl;
    if (!o.address_file.empty()) {
      const absl::Status written = internal::WriteAddressFile(
          internal::AddressFileOf(o, o.index), DialableAddress((*connector)->control_address()));
      if (!written.ok()) return Fail(err, written);
    }
    const StopSignals stop;
    absl::Time last_work = absl::Now();
    // For --json: what was served, with its send timeline (by the engine's request id).
    std::vector<RequestResult> served;
    std::map<std::string, RequestSendStats> sends;
    auto collect = [&] {
      if (o.json_path.empty()) return;
      for (RequestResult& r : (*engine)->TakeServed()) served.push_back(std::move(r));
      for (RequestSendStats& t : (*connector)->TakeSendStats()) {
        sends[t.request_id] = std::move(t);
      }
    };
    while (true) {
      if (stop.received() != 0) {
        // Asked to stop: finish the work in hand (bounded by the idle timeout), then the
        // block check below.
        out << "prefill worker: " << (stop.received() == SIGTERM ? "SIGTERM" : "SIGINT")
            << ", exiting" << std::endl;
        const absl::Status drained =
            Drain(**engine, absl::Now() + absl::Seconds(o.idle_timeout_s));
        if (!drained.ok()) return Fail(err, drained);
        break;
      }
      auto ran = (*engine)->Step();
      if (!ran.ok()) return Fail(err, ran.status());
      collect();
      if (*ran || (*engine)->HasWork()) last_work = absl::Now();
      if (o.serve > 0 && (*engine)->served() >= o.serve && !(*engine)->HasWork()) break;
      if (absl::Now() - last_work > absl::Seconds(o.idle_timeout_s)) {
        out << "prefill worker: idle for " << o.idle_timeout_s << " s, exiting" << std::endl;
        break;
      }
      if (!*ran) absl::SleepFor(absl::Milliseconds(1));
    }
    const int32_t free_blocks = (*engine)->num_free_blocks();
    out << "prefill worker: served " << (*engine)->served() << " requests in "
        << (*engine)->steps() << " steps; " << free_blocks << "/" << (*engine)->num_blocks()
        << " blocks free" << std::endl;
    if (!o.json_path.empty()) {
      // Every served request's sends have ended: its blocks came back (HasWork) only after
      // the connector settled it, which is when its timeline was kept.
      collect();
      std::ofstream f(o.json_path);
      f << PrefillReportJson(served, sends, (*connector)->stats(), (*connector)->peer_stats())
               .dump(2)
        << "\n";
    }
    if (free_blocks != (*engine)->num_blocks()) {
      err << "kvstream worker: blocks leaked on the prefill worker\n";
      return 4;
    }
    return 0;
  }

  // Decode worker: find every prefill worker. The first wave waits for each to answer;
  // later waves read the rendezvous again (a restarted prefill worker publishes its new
  // address) but wait for nobody: a prefill worker that is down is the connector's to
  // report (its loads fail at once), and the failure policy's to handle.
  auto find_producers = [&](bool wait) -> absl::StatusOr<std::vector<RemotePrefill>> {
    std::vector<RemotePrefill> found;
    for (int p = 0; p < o.num_prefill; ++p) {
      RemotePrefill remote{config->kv_ip, config->kv_port};
      if (!o.address_file.empty()) {
        auto addr = internal::ReadAddressFile(internal::AddressFileOf(o, p), absl::Seconds(o.connect_timeout_s));
        if (!addr.ok()) return addr.status();
        remote = RemotePrefill{addr->first, addr->second};
      }
      if (wait) {
        RETURN_IF_ERROR(
            internal::WaitForProducer(remote.host, remote.port, absl::Seconds(o.connect_timeout_s)));
      }
      found.push_back(remote);
    }
    return found;
  };
  const std::vector<RequestSpec> requests = MakeRequests(o);
  const absl::Time t0 = absl::Now();
  const absl::Duration budget =
      o.run_timeout_s > 0
          ? absl::Seconds(o.run_timeout_s)
          : absl::Seconds(120) + absl::Milliseconds(2 * (config->kvstream.load_timeout_ms +
                                                         config->kvstream.send_timeout_ms));
  const int waves = std::max(1, o.waves);
  const size_t per_wave = o.prompt_lengths.size();
  absl::Status drained;
  for (int w = 0; w < waves && drained.ok(); ++w) {
    if (w > 0 && !o.wave_gate.empty()) {
      drained = internal::WaitForFile(absl::StrCat(o.wave_gate, ".w", w), t0 + budget);
      if (!drained.ok()) break;
    }
    auto producers = find_producers(/*wait=*/w == 0);
    if (!producers.ok()) return Fail(err, producers.status());
    const std::vector<RequestSpec> wave(requests.begin() + w * per_wave,
                                        requests.begin() + (w + 1) * per_wave);
    drained = RunRequests(
        **engine, wave,
        [&](size_t i) -> std::optional<RemotePrefill> {
          return (*producers)[(i + o.index) % producers->size()];
        },
        o.one_at_a_time, t0 + budget, o.progress, "disaggregated run");
    if (drained.ok() && waves > 1) {
      out << "decode worker " << o.index << ": wave " << w << " done" << std::endl;
      if (!o.wave_gate.empty()) {
        const std::string done = absl::StrCat(o.wave_gate, ".d", o.index, ".w", w, ".done");
        if (!std::ofstream(done)) {
          return Fail(err, absl::InternalError(absl::StrCat("cannot write ", done)));
        }
      }
    }
  }
  if (!drained.ok()) return Fail(err, drained);
  const double total_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
  std::vector<RequestResult> results = (*engine)->TakeFinished();
  std::sort(results.begin(), results.end(),
            [](const RequestResult& a, const RequestResult& b) { return a.id < b.id; });
  // What the report needs from the disaggregated run; then its engine and connector go (the
  // engine first: the connector provided its cache memory), so that big models need memory
  // for one model at a time in this process.
  const int32_t free_blocks = (*engine)->num_free_blocks();
  const int32_t num_blocks = (*engine)->num_blocks();
  const int64_t steps = (*engine)->steps();
  const bool leak = free_blocks != num_blocks;
  const ConnectorStats stats = (*connector)->stats();
  const std::vector<PeerConnectorStats> peer_stats = (*connector)->peer_stats();
  std::vector<RequestTransferStats> transfer_stats = (*connector)->TakeRequestStats();
  metrics.reset();
  engine->reset();
  connector->reset();

  // In a pipeline every stage holds the group's outputs; the last one checks them.
  const bool check = o.check_colocated && last_stage;
  std::vector<RequestResult> colocated;
  if (check) {
    EngineOptions co;
    co.model = o.model;
    co.device = o.device;
    co.num_blocks = o.num_blocks;
    auto ref = Engine::Create(co);
    if (!ref.ok()) return Fail(err, ref.status());
    const absl::Duration ref_budget =
        o.run_timeout_s > 0 ? absl::Seconds(o.run_timeout_s) : absl::Seconds(600);
    absl::Status s = RunRequests(
        **ref, requests, [](size_t) -> std::optional<RemotePrefill> { return std::nullopt; },
        o.one_at_a_time, absl::Now() + ref_budget, o.progress, "colocated run");
    if (!s.ok()) return Fail(err, s);
    colocated = (*ref)->TakeFinished();
    std::sort(colocated.begin(), colocated.end(),
              [](const RequestResult& a, const RequestResult& b) { return a.id < b.id; });
  }

  bool all_ok = true, all_match = true;
  nlohmann::json report;
  report["requests"] = nlohmann::json::array();
  for (size_t i = 0; i < results.size(); ++i) {
    const RequestResult& r = results[i];
    bool match = true;
    double colocated_ttft_ms = 0, colocated_prefill_ms = 0;
    if (check) {
      const RequestResult* c = i < colocated.size() && colocated[i].id == r.id ? &colocated[i] : nullptr;
      if (c != nullptr) {
        colocated_ttft_ms = c->ttft_ms;
        colocated_prefill_ms = c->prefill_ms;
      }
      match = c != nullptr && r.status.ok() && c->output_tokens == r.output_tokens &&
              c->logits.size() == r.logits.size() &&
              std::memcmp(c->logits.data(), r.logits.data(), r.logits.size() * sizeof(float)) == 0;
    }
    all_ok &= r.status.ok();
    all_match &= match;
    out << absl::StrFormat("  %s: prompt %4d tokens (%4d from the prefill worker%s), ttft %8.2f ms, "
                           "%d tokens [%s]%s%s\n",
                           r.id, r.prompt_tokens, r.remote_tokens,
                           r.recomputed ? ", recomputed after a load error" : "", r.ttft_ms,
                           r.output_tokens.size(), absl::StrJoin(r.output_tokens, " "),
                           check ? (match ? "  == colocated" : "  != COLOCATED") : "",
                           r.status.ok() ? "" : absl::StrCat("  FAILED: ", r.status.ToString()));
    report["requests"].push_back({{"id", r.id},
                                  {"prompt_tokens", r.prompt_tokens},
                                  {"remote_tokens", r.remote_tokens},
                                  {"ttft_ms", r.ttft_ms},
                                  {"colocated_ttft_ms", colocated_ttft_ms},
                                  {"prefill_ms", r.prefill_ms},
                                  {"colocated_prefill_ms", colocated_prefill_ms},
                                  {"output_tokens", r.output_tokens},
                                  {"recomputed", r.recomputed},
                                  {"status", r.status.ToString()},
                                  {"matches_colocated", match}});
  }
  if (pipeline) {
    out << absl::StrFormat("decode worker %d%s: received %d layer transfers, %d bytes\n",
                           o.index, stage_name, stats.layers_received, stats.bytes_received);
  }
  out << absl::StrFormat("decode worker: %d requests in %.1f ms, %d steps; %d/%d blocks free; %s\n",
                         results.size(), total_ms, steps, free_blocks, num_blocks,
                         check ? (all_match ? "outputs bit-identical to the colocated run"
                                            : "OUTPUTS DIFFER from the colocated run")
                               : o.check_colocated ? "outputs checked by the last pipeline stage"
                                                   : "colocated check skipped");
  report["tokens_match"] = all_match;
  report["all_ok"] = all_ok;
  report["blocks_leaked"] = leak;
  report["total_ms"] = total_ms;
  report["engine_id"] = config->engine_id;
  report["layers"] = FormatLayerRange(stage_layers);
  report["pipeline_rank"] = k.pipeline_rank;
  report["pipeline_parallel_size"] = k.pipeline_parallel_size;
  report["colocated_checked"] = check;
  report["connector"] = ConnectorStatsJson(stats, peer_stats);
  if (decode_report != nullptr) {
    DecodeReport& d = *decode_report;
    d.results = results;
    for (size_t i = 0; i < results.size(); ++i) {
      d.matches_colocated.push_back(report["requests"][i]["matches_colocated"]);
      if (!check) continue;
      RequestResult c;
      if (i < colocated.size() && colocated[i].id == results[i].id) {
        c = colocated[i];
        c.logits.clear();
      }
      d.colocated.push_back(std::move(c));
    }
    for (RequestTransferStats& t : transfer_stats) {
      d.transfer[t.request_id] = std::move(t);
    }
    d.stats = stats;
    d.peer_stats = peer_stats;
    d.total_ms = total_ms;
    d.steps = steps;
    d.tokens_match = all_match;
    d.all_ok = all_ok;
    d.blocks_leaked = leak;
  }
  if (!o.json_path.empty()) {
    std::string path = o.json_path;
    if (o.num_decode > 1) absl::StrAppend(&path, ".d", o.index);
    if (pipeline) absl::StrAppend(&path, ".pp", k.pipeline_rank);
    std::ofstream f(path);
    f << report.dump(2) << "\n";
  }
  if (leak) {
    err << "kvstream worker: blocks leaked on the decode worker\n";
    return 4;
  }
  if (!all_ok) return 3;
  if (!all_match) return 2;
  // Every request may have been recomputed correctly, but if no producer could ever be
  // reached or accepted us, nothing was disaggregated: a monitor must see that.
  if (stats.handshakes == 0 && !results.empty()) {
    err << "kvstream worker: no KV came from any prefill worker: " << stats.handshake_failures
        << " attempt(s) to reach one failed (see the load errors above)\n";
    return kExitNotDisaggregated;
  }
  return 0;
}

}  // namespace kvstream
