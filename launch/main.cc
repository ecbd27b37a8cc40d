// The kvstream command. Subcommands: demo (prefill and decode workers on this machine),
// worker (one prefill or decode worker) and selftest (the attention stack against the golden
// reference). Only launch/ reads argv and the environment.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/connector/config.h"
#include "kvstream/connector/layer_routing.h"
#include "attention_example.h"
#include "demo.h"
#include "worker.h"

namespace {

// Under mpirun, the rank picks the role: ranks below --prefill-workers prefill, the others
// decode. With a pipeline size P (--pp-size, else pipeline_parallel_size in the config),
// every P consecutive decode ranks form one decode worker whose pipeline stages they are.
// Returns an empty string, or what is wrong.
std::string RoleFromMpiRank(kvstream::WorkerOptions& w) {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (rank == nullptr || size == nullptr) return "--mpi needs to run under mpirun";
  const int r = std::atoi(rank), n = std::atoi(size);
  if (n <= w.num_prefill) return "--mpi needs an mpirun world larger than --prefill-workers";
  int pp = w.pp_size.value_or(1);
  if (!w.pp_size && !w.pp_layers.empty()) {
    auto ranges = kvstream::ParseLayerRanges(w.pp_layers);
    if (ranges.ok()) pp = static_cast<int>(ranges->size());
  }
  if (!w.pp_size && w.pp_layers.empty()) {
    auto config = kvstream::ParseKvTransferConfig(
        w.kv_transfer_config.empty() ? "{}" : w.kv_transfer_config);
    if (config.ok()) pp = config->kvstream.pipeline_parallel_size;
  }
  const int decode_ranks = n - w.num_prefill;
  if (pp < 1 || decode_ranks % pp != 0) {
    return "the " + std::to_string(decode_ranks) + " decode ranks cannot form pipelines of " +
           std::to_string(pp) + " stages";
  }
  w.num_decode = decode_ranks / pp;
  const bool prefill = r < w.num_prefill;
  w.role = prefill ? "prefill" : "decode";
  w.index = prefill ? r : (r - w.num_prefill) / pp;
  if (!prefill && pp > 1) {
    w.pp_size = pp;
    w.pp_rank = (r - w.num_prefill) % pp;
  }
  return "";
}

// Under mpirun: this rank's local rank (OMPI_COMM_WORLD_LOCAL_RANK) modulo the GPUs
// visible, so that the ranks of one host take one GPU each where there are enough (and share
// GPU 0 where it is the only one).
int MpiLocalGpu() {
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  const int gpus = kvstream::GpuCount();
  if (local == nullptr || gpus <= 0) return 0;
  return std::max(0, std::atoi(local)) % gpus;
}

// Applies the --model preset to the shape fields whose flags were not given.
absl::Status ApplyPreset(const CLI::App* cmd, const std::string& preset,
                         kvstream::ToyModelConfig& m) {
  if (preset.empty()) return absl::OkStatus();
  const kvstream::ToyModelConfig given = m;
  absl::Status s = kvstream::ApplyModelPreset(preset, m);
  if (!s.ok()) return s;
  if (cmd->count("--layers") > 0) m.num_layers = given.num_layers;
  if (cmd->count("--heads") > 0) m.num_heads = given.num_heads;
  if (cmd->count("--kv-heads") > 0) m.num_kv_heads = given.num_kv_heads;
  if (cmd->count("--head-size") > 0) m.head_size = given.head_size;
  if (cmd->count("--vocab") > 0) m.vocab_size = given.vocab_size;
  if (cmd->count("--intermediate") > 0) m.intermediate_size = given.intermediate_size;
  if (cmd->count("--rope-theta") > 0) m.rope_theta = given.rope_theta;
  return absl::OkStatus();
}

// `kvstream bench NAME [flags]` runs the Google Benchmark program kvstream_bench_NAME that
// was built (or installed) beside this binary, passing the flags through.
int RunBench(const std::string& name, const std::vector<std::string>& args) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) {
    std::cerr << "kvstream bench: cannot locate this program\n";
    return 1;
  }
  self[n] = '\0';
  std::string dir(self);
  dir = dir.substr(0, dir.rfind('/'));
  const std::string program = "kvstream_bench_" + name;
  for (const std::string& candidate : {dir + "/" + program, dir + "/../bench/" + program}) {
    if (access(candidate.c_str(), X_OK) != 0) continue;
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(candidate.c_str()));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(candidate.c_str(), argv.data());
    std::cerr << "kvstream bench: cannot run " << candidate << "\n";
    return 1;
  }
  std::cerr << "kvstream bench: " << program << " was not built (it needs Google Benchmark"
            << (name == "attention_cpu" ? " and a CBLAS" : "") << ")\n";
  return 1;
}

void AddModelFlags(CLI::App* cmd, kvstream::ToyModelConfig& m, std::string& preset) {
  cmd->add_option("--model", preset,
                  "Model shape preset: " + absl::StrJoin(kvstream::ModelPresetNames(), ", ") +
                      " (llama3-8b: 32 layers, hidden 4096, 32 heads, 8 KV heads of 128, MLP "
                      "14336, vocabulary 128256, for big machines; shape flags given with it "
                      "override it, e.g. --vocab)")
      ->check(CLI::IsMember(kvstream::ModelPresetNames()));
  cmd->add_option("--layers", m.num_layers, "Attention layers of the model")
      ->capture_default_str()->check(CLI::Range(1, 256));
  cmd->add_option("--heads", m.num_heads, "Query heads")->capture_default_str()->check(CLI::Range(1, 256));
  cmd->add_option("--kv-heads", m.num_kv_heads, "KV heads (divides --heads)")
      ->capture_default_str()->check(CLI::Range(1, 256));
  cmd->add_option("--head-size", m.head_size, "Elements per head")
      ->capture_default_str()->check(CLI::Range(1, 512));
  cmd->add_option("--vocab", m.vocab_size, "Vocabulary size")->capture_default_str()->check(CLI::Range(2, 1 << 20));
  cmd->add_option("--intermediate", m.intermediate_size, "MLP width")
      ->capture_default_str()->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--rope-theta", m.rope_theta, "Rotary embedding base")
      ->capture_default_str()->check(CLI::Range(1.5, 1e9));
  cmd->add_option("--blas-threads", m.blas_threads,
                  "OpenBLAS threads per process (workers compared bit for bit must agree)")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  cmd->add_option("--block-size", m.block_size, "Tokens per KV-cache block")
      ->capture_default_str()->check(CLI::Range(1, 4096));
  cmd->add_option("--kv-cache-dtype", m.kv_cache_dtype,
                  "auto, bfloat16, float16, float32, fp8, fp8_e4m3 or fp8_e5m2")->capture_default_str();
  cmd->add_option("--layout", m.layout, "KV-cache layout: NHD or HND")->capture_default_str();
  cmd->add_option("--seed", m.seed, "Seed of the weights and prompts")->capture_default_str();
  cmd->add_option("--backend", m.backend, "Attention backend: cpu or cpu_reference")
      ->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvstream: layer-wise KV streaming for disaggregated LLM serving"};
  app.require_subcommand(1);
  // A flag given twice takes its last value, so scripts can override defaults they pass.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");

  kvstream::DemoOptions demo_options;
  std::string demo_preset;
  std::string demo_device = "cpu";
  CLI::App* real_demo = app.add_subcommand(
      "demo",
      "Start a prefill worker process and a decode worker on this machine, serve requests of "
      "varied prompt lengths with their KV streamed layer by layer, check the tokens against "
      "a colocated run and print a report (TTFT, bytes, GB/s, exposed transfer, timeline)");
  AddModelFlags(real_demo, demo_options.model, demo_preset);
  real_demo->add_option("--requests", demo_options.num_requests, "Number of requests")
      ->capture_default_str()->check(CLI::Range(1, 10000));
  real_demo->add_option("--prompts", demo_options.prompt_lengths,
                        "Prompt lengths (default: --requests lengths spread over 64..960)")
      ->delimiter(',');
  real_demo->add_option("--decode-steps", demo_options.decode_steps, "Tokens generated per request")
      ->capture_default_str()->check(CLI::Range(1, 100000));
  real_demo->add_option("--num-blocks", demo_options.num_blocks, "KV-cache blocks per layer")
      ->capture_default_str()->check(CLI::Range(1, 1 << 24));
  real_demo->add_option("--device", demo_device,
                        "cpu, or cuda: the workers run the CUDA model, the prefill worker on GPU 0 "
                        "and the decode worker on GPU 1 (GPU 0 too where it is the only one), "
                        "KV over CUDA IPC (exits 1 without a usable GPU)")
      ->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  real_demo->add_option("--transport", demo_options.transport, "UCX over shm or tcp")
      ->capture_default_str()->check(CLI::IsMember({"shm", "tcp"}));
  real_demo->add_option("--failure-policy", demo_options.failure_policy,
                        "kv_load_failure_policy: recompute or fail")
      ->capture_default_str()->check(CLI::IsMember({"recompute", "fail"}));
  real_demo->add_option("--json", demo_options.json_path, "Write the report as JSON to this file");
  real_demo->add_option("--verify-checksum", demo_options.verify_checksum,
                        "Checksum every layer and request and verify it at the decode worker "
                        "(the connector's verify_checksum; true or false)");
  bool demo_load_async_value = false;
  CLI::Option* demo_load_async = real_demo->add_option(
      "--load-async", demo_load_async_value,
      "The decode worker runs a request once all its layers arrived, rather than waiting for "
      "each layer in its first step (the connector's load_async; true or false; default: true "
      "where both workers share GPU 0, false on the CPU or with a GPU each)");
  real_demo->add_flag("--one-at-a-time", demo_options.one_at_a_time,
                      "Start each request once the one before it finished, in both runs (time "
                      "to first token without queueing)");
  real_demo->add_option("--timeout", demo_options.timeout_s,
                        "Seconds each of the disaggregated and colocated runs may take (and the "
                        "prefill worker waits idle); raise it for --model=llama3-8b")
      ->capture_default_str()->check(CLI::Range(1.0, 1e6));

  kvstream::AttentionExampleOptions demo;
  CLI::App* demo_cmd = app.add_subcommand(
      "selftest",
      "Run kvstream's attention stack on the CPU: a mixed batch of prefill, chunked prefill "
      "and decode steps through a stack of attention layers over paged caches, checked "
      "against the golden reference");
  demo_cmd->add_option("--layers", demo.num_layers, "Number of attention layers")
      ->capture_default_str()->check(CLI::Range(1, 256));
  demo_cmd->add_option("--heads", demo.num_heads, "Query heads per layer")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  demo_cmd->add_option("--kv-heads", demo.num_kv_heads, "KV heads per layer (divides --heads)")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  demo_cmd->add_option("--head-size", demo.head_size, "Elements per head")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  demo_cmd->add_option("--block-size", demo.block_size, "Tokens per KV-cache block")
      ->capture_default_str()->check(CLI::Range(1, 4096));
  demo_cmd->add_option("--kv-cache-dtype", demo.kv_cache_dtype,
                       "auto, bfloat16, float16, float32, fp8, fp8_e4m3 or fp8_e5m2")
      ->capture_default_str();
  demo_cmd->add_option("--dtype", demo.model_dtype, "Activation dtype: bfloat16, float16, float32")
      ->capture_default_str();
  demo_cmd->add_option("--layout", demo.layout, "KV-cache layout: NHD or HND")->capture_default_str();
  demo_cmd->add_option("--decode-steps", demo.decode_steps, "Decode steps after the prompts")
      ->capture_default_str()->check(CLI::Range(0, 10000));
  demo_cmd->add_option("--seed", demo.seed, "Seed of the synthetic inputs")->capture_default_str();
  demo_cmd->add_option("--tolerance", demo.tolerance,
                       "Largest |fast - reference| accepted on outputs")
      ->capture_default_str();

  kvstream::WorkerOptions worker;
  std::string worker_device = "cpu";
  std::string worker_preset;
  bool worker_mpi = false;
  CLI::App* worker_cmd = app.add_subcommand(
      "worker",
      "Run a prefill or a decode worker. The decode worker hands its requests to the prefill "
      "worker named by --kv-transfer-config (kv_ip, kv_port), decodes them as their KV "
      "streams in layer by layer, then checks its outputs bit for bit against a colocated "
      "run. Exit status: 0 ok, 1 error, 2 outputs differ, 3 a request failed, 4 blocks leaked");
  worker_cmd->add_option("--role", worker.role, "prefill or decode");
  worker_cmd->add_option("--device", worker_device,
                         "cpu (the CPU model, host caches) or cuda (the CUDA model on the GPU "
                         "kv_connector_extra_config.cuda_device names, device caches, cuda_ipc)")
      ->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  int worker_gpu = 0;
  CLI::Option* worker_gpu_option = worker_cmd->add_option(
      "--gpu", worker_gpu,
      "With --device=cuda: this GPU instead of the config's cuda_device; under --mpi the "
      "default is the rank's local rank modulo the GPUs visible (one GPU each where there are "
      "enough)")->check(CLI::Range(0, 1023));
  worker_cmd->add_flag("--mpi", worker_mpi,
                       "Take the role from the mpirun rank: ranks below --prefill-workers "
                       "prefill, the others decode (xPyD)");
  worker_cmd->add_option("--prefill-workers", worker.num_prefill,
                         "Number of prefill workers (xPyD; decode worker d sends request i to "
                         "prefill worker (i + d) mod this)")->capture_default_str()->check(CLI::Range(1, 1024));
  worker_cmd->add_option("--decode-workers", worker.num_decode,
                         "Number of decode workers (xPyD, set by --mpi from the world size)")
      ->capture_default_str()->check(CLI::Range(1, 1024));
  worker_cmd->add_option("--index", worker.index, "This worker's index among its role (xPyD)")
      ->capture_default_str()->check(CLI::Range(0, 1023));
  worker_cmd->add_option("--kv-transfer-config", worker.kv_transfer_config,
                         "vLLM's kv_transfer_config JSON (kvstream settings under "
                         "kv_connector_extra_config)");
  AddModelFlags(worker_cmd, worker.model, worker_preset);
  worker_cmd->add_option("--num-blocks", worker.num_blocks, "KV-cache blocks per layer")
      ->capture_default_str()->check(CLI::Range(1, 1 << 24));
  worker_cmd->add_option("--prompts", worker.prompt_lengths, "Prompt lengths of the requests")
      ->delimiter(',')->capture_default_str();
  worker_cmd->add_option("--decode-steps", worker.decode_steps, "Tokens generated per request")
      ->capture_default_str()->check(CLI::Range(1, 100000));
  worker_cmd->add_option("--serve", worker.serve,
                         "Prefill: exit after serving this many requests (0: when idle)")
      ->capture_default_str();
  worker_cmd->add_option("--idle-timeout", worker.idle_timeout_s,
                         "Prefill: seconds without work before exiting, and at most to "
                         "finish the work in hand on SIGTERM or SIGINT")->capture_default_str();
  worker_cmd->add_option("--connect-timeout", worker.connect_timeout_s,
                         "Decode: seconds to wait for the prefill worker (and pipeline stages "
                         "for each other)")->capture_default_str();
  worker_cmd->add_option("--run-timeout", worker.run_timeout_s,
                         "Decode: seconds each of the disaggregated and colocated runs may take "
                         "(0: 120 plus twice the load and send timeouts; 600 colocated)")
      ->capture_default_str()->check(CLI::Range(0.0, 1e6));
  worker_cmd->add_option("--crash-after-layer", worker.crash_after_layer,
                         "Fault injection for tests: SIGKILL this worker after this layer's "
                         "transfer hook ran in a step with remote traffic")->capture_default_str();
  worker_cmd->add_flag("!--no-check", worker.check_colocated,
                       "Decode: skip the comparison with a colocated run");
  worker_cmd->add_option("--json", worker.json_path,
                         "Write a JSON report to this file (decode: requests and checks; "
                         "prefill, at exit: requests served and their layer timelines)");
  worker_cmd->add_flag("--one-at-a-time", worker.one_at_a_time,
                       "Decode: start each request once the one before it finished, in both runs");
  worker_cmd->add_option("--waves", worker.waves,
                         "Decode: run the prompts this many times, one wave after the other, "
                         "reading the prefill workers' rendezvous files again before each "
                         "(prefill: --serve counts every wave)")
      ->capture_default_str()->check(CLI::Range(1, 10000));
  worker_cmd->add_option("--wave-gate", worker.wave_gate,
                         "Decode: before wave w >= 1 wait for the file <this>.w<w>; after wave "
                         "w write <this>.d<index>.w<w>.done");
  worker_cmd->add_option("--metrics-port", worker.metrics_port,
                         "Serve Prometheus metrics on this port (0: any free port; default off)")
      ->check(CLI::Range(0, 65535));
  worker_cmd->add_option("--pp-size", worker.pp_size,
                         "Decode: stages of this decode worker's pipeline (kv_connector_extra_"
                         "config pipeline_parallel_size; under --mpi, every this many decode "
                         "ranks form one decode worker)")
      ->check(CLI::Range(1, 1024));
  worker_cmd->add_option("--pp-rank", worker.pp_rank,
                         "Decode: this worker's pipeline stage (pipeline_rank; set by --mpi)")
      ->check(CLI::Range(0, 1023));
  worker_cmd->add_option("--pp-layers", worker.pp_layers,
                         "Decode: every stage's layers, in stage order (pipeline_layers, e.g. "
                         "0-15,16-31; default: an even split)");
  worker_cmd->add_option("--pp-rendezvous", worker.pp_rendezvous,
                         "Decode: path prefix where pipeline stages publish their addresses "
                         "(default: <address-file>.d<index>)");
  worker_cmd->add_option("--pp-timeout", worker.pp_timeout_s,
                         "Decode: seconds a pipeline stage waits for the others in one step")
      ->capture_default_str()->check(CLI::Range(0.001, 1e6));
  worker_cmd->add_option("--address-file", worker.address_file,
                         "Rendezvous file: the prefill worker writes its control address "
                         "(host:port) there, the decode worker reads it (overrides kv_ip, "
                         "kv_port; lets the prefill worker use kv_port 0)");

  std::string bench_name;
  std::vector<std::string> bench_args;
  CLI::App* bench_cmd = app.add_subcommand(
      "bench",
      "Run a benchmark, printing its figure, the ceiling or peer measured in the same run, and "
      "the ratio: attention (CPU attention vs OpenBLAS sgemm), cache (cache update vs memcpy), "
      "transfer (two processes over UCX vs ucx_perftest). Flags after the name go to the "
      "Google Benchmark program (e.g. --benchmark_repetitions=3; transfer: --memory, --tls, "
      "--depth, --copy-threads, --perftest-heap=false)");
  bench_cmd->add_option("name", bench_name, "attention, cache or transfer")
      ->required()->check(CLI::IsMember({"attention", "cache", "transfer"}));
  bench_cmd->add_option("args", bench_args, "Flags for the benchmark program");
  bench_cmd->allow_extras();

  CLI11_PARSE(app, argc, argv);

  if (bench_cmd->parsed()) {
    std::vector<std::string> args = bench_args;
    for (const std::string& extra : bench_cmd->remaining()) args.push_back(extra);
    const std::string program = bench_name == "attention" ? "attention_cpu"
                                : bench_name == "cache"   ? "cache_update"
                                                          : "transfer";
    return RunBench(program, args);
  }

  if (real_demo->parsed()) {
    absl::Status s = ApplyPreset(real_demo, demo_preset, demo_options.model);
    if (!s.ok()) {
      std::cerr << "kvstream demo: " << s << "\n";
      return 1;
    }
    demo_options.device =
        demo_device == "cuda" ? kvstream::ModelDevice::kCuda : kvstream::ModelDevice::kCpu;
    if (demo_load_async->count() > 0) demo_options.load_async = demo_load_async_value;
    return kvstream::RunDemo(demo_options, std::cout, std::cerr);
  }
  if (worker_cmd->parsed()) {
    absl::Status s = ApplyPreset(worker_cmd, worker_preset, worker.model);
    if (!s.ok()) {
      std::cerr << "kvstream worker: " << s << "\n";
      return 1;
    }
    if (worker_mpi) {
      const std::string why = RoleFromMpiRank(worker);
      if (!why.empty()) {
        std::cerr << "kvstream worker: " << why << "\n";
        return 1;
      }
    }
    if (worker.serve == 0 && worker.role == "prefill" && (worker_mpi || worker.num_decode > 1)) {
      worker.serve = kvstream::RequestsServedBy(worker, worker.index);
    }
    worker.device =
        worker_device == "cuda" ? kvstream::ModelDevice::kCuda : kvstream::ModelDevice::kCpu;
    if (worker_gpu_option->count() > 0) {
      worker.gpu = worker_gpu;
    } else if (worker_mpi && worker.device == kvstream::ModelDevice::kCuda) {
      worker.gpu = MpiLocalGpu();
    }
    return kvstream::RunWorker(worker, std::cout, std::cerr);
  }

  if (demo_cmd->parsed()) {
    absl::Status s = kvstream::RunAttentionExample(demo, std::cout);
    if (!s.ok()) {
      std::cerr << "kvstream selftest: FAILED: " << s << "\n";
      return 1;
    }
    std::cout << "kvstream selftest: OK\n";
  }
  return 0;
}
