// A minimal serving engine over ToyModel, for kvstream's workers and demo: a FIFO scheduler
// with whole-request block allocation, prefill and decode in one batch per step, greedy
// sampling, and the connector's two sides called in the places vLLM calls them: the
// scheduler side (KvConnectorScheduler) by the scheduler, the worker side
// (KvConnectorWorker) around the forward pass. The two sides meet only through the step's
// metadata and the worker's output, which the engine passes as bytes (encoded and decoded
// each step, as they would cross vLLM's process boundary).
//
//   producer (prefill worker): requests arrive through the connector, their prompts but
//     the last token (which the consumer computes) are prefilled and streamed layer by
//     layer, and nothing more; blocks are freed once the connector reports the sends done.
//   consumer (decode worker): requests with a RemotePrefill get all prompt tokens but the
//     last from the producer and decode from there; load errors are handled by the policy
//     (recompute: prefill locally; fail: the request ends with the error).
//   colocated: no connector.
//   pipeline stage (decode): the engine runs one range of the model's layers and its
//     StageChannel joins it to the other stages of its decode group; every stage schedules
//     the same batches (they get the same requests), the first embeds the tokens, each
//     passes its hidden states on, the last computes the logits, which come back to every
//     stage with the union of the stages' load errors. A batch that differs between stages
//     (e.g. the cache ran out of blocks on one of them) is an error, not a silent mismatch.
//
// Rows are grouped into segments for the model's matrix products (toy_model.h): the prompt
// but its last token, the last prompt token, each generated token.
#ifndef KVSTREAM_SERVING_ENGINE_H_
#define KVSTREAM_SERVING_ENGINE_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvstream/attention/layer_registry.h"
#include "kvstream/cache/block_pool.h"
#include "kvstream/connector/kv_connector_scheduler.h"
#include "kvstream/connector/kv_connector_worker.h"
#include "kvstream/connector/layer_routing.h"
#include "kvstream/serving/pipeline_link.h"
#include "kvstream/serving/cuda_model.h"
#include "kvstream/serving/toy_model.h"

namespace kvstream {

// Where the model runs: the CPU model (toy_model.h) or the CUDA one (serving's
// cuda_model.h) on the calling thread's current GPU, with device caches.
enum class ModelDevice { kCpu, kCuda };

struct EngineOptions {
  ToyModelConfig model;
  ModelDevice device = ModelDevice::kCpu;
  // A prompt's last token in a step of its own, after the rest of the prompt, and one-row
  // sequences first in each step's batch: what the CUDA model needs so that a colocated
  // run computes that token with the attention kernel a decode worker uses (on for kCuda
  // whatever this says; the CPU model gives the same bits either way).
  bool split_last_prompt_token = false;
  int64_t num_blocks = 1024;
  // The connector's two sides (not owned): both, or neither (colocated).
  KvConnectorScheduler* scheduler = nullptr;
  KvConnectorWorker* worker = nullptr;
  TransferHook* hook = nullptr;  // not owned; default: the worker side
  LoadFailurePolicy failure_policy = LoadFailurePolicy::kRecompute;
  // Non-zero: shuffle the free list with this seed, so requests get scattered blocks.
  uint32_t scatter_seed = 0;
  // Pipeline stage: the model layers this engine runs (and whose caches it registers with
  // the connector), and its link to the other stages (not owned). Unset / null: the whole
  // model, no pipeline.
  std::optional<LayerRange> layers;
  StageChannel* pipeline = nullptr;
  // How long a stage waits for its neighbours in one step (their compute and KV waits).
  absl::Duration stage_timeout = absl::Seconds(600);
};

struct RequestSpec {
  std::string id;
  std::vector<int32_t> prompt;
  int max_new_tokens = 1;
  std::optional<RemotePrefill> remote;  // consumer: where the prompt is prefilled
};

struct RequestResult {
  std::string id;
  int prompt_tokens = 0;
  std::vector<int32_t> output_tokens;
  std::vector<float> logits;  // of every generated token, concatenated
  absl::Status status;
  double ttft_ms = 0;
  // Wall time of the forward passes (whole batches, the connector's hook work in them) that
  // computed its prompt tokens but the last, and when the first began (MonotonicNs). With
  // the last prompt token in a step of its own, a prefill worker's and a colocated run's
  // are the same passes.
  double prefill_ms = 0;
  uint64_t prefill_start_ns = 0;
  int64_t remote_tokens = 0;  // prompt tokens whose KV came from a producer
  bool recomputed = false;
};

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options);

  // Queues a request. InvalidArgument for an empty prompt or tokens outside the vocabulary,
  // ResourceExhausted when it could never fit the cache.
  absl::Status AddRequest(RequestSpec spec);

  // Runs one step (admission, forward, sampling, connector bookkeeping). Returns false when
  // there was nothing to run. A pipeline stage blocks until its neighbours ran the step
  // (bounded by stage_timeout); an error of the pipeline ends the engine's work.
  absl::StatusOr<bool> Step();

  // Requests queued, running, or whose blocks the connector still holds.
  bool HasWork() const;
  std::vector<RequestResult> TakeFinished();

  int32_t num_free_blocks() const { return pool_->num_free(); }
  int32_t num_blocks() const { return pool_->num_blocks(); }
  int64_t steps() const { return steps_; }
  // Producer: requests from consumers whose prefill finished.
  int64_t served() const { return served_; }
  // Producer: the results of those requests since the last call (their ids are the
  // connector's for them; tokens and timings as for any request); the latest 4096 kept.
  std::vector<RequestResult> TakeServed();

 private:
  struct Request {
    RequestSpec spec;
    std::vector<int32_t> blocks;
    int32_t computed = 0;       // tokens whose KV is in the cache (or arriving)
    std::vector<int32_t> generated;
    RequestResult result;
    absl::Time arrival;
    bool from_consumer = false;  // producer: handed over by a consumer
    bool detached = false;       // its remote load failed: the connector is done with it
  };

  Engine() = default;
  absl::Status Admit();
  void FinishRequest(std::unique_ptr<Request> r, absl::Status status);
  // Takes the worker's output, gives it to the scheduler side, queues incoming requests,
  // frees held blocks, keeps load errors for the step's end.
  absl::Status PollConnector();
  // A request whose remote KV failed to load (its blocks already freed or held): fails it
  // (LoadFailurePolicy::kFail) or queues it to recompute its prompt locally.
  void AfterFailedLoad(std::unique_ptr<Request> r, const absl::Status& error);
  // Frees a failed load's blocks when nothing can land in them any more, else holds them
  // until the connector says so.
  absl::Status ReleaseFailedLoad(Request& r);
  // The step's metadata, from the scheduler side to the worker side as bytes.
  absl::Status BindStep(absl::Span<const ScheduledRequest> scheduled);
  bool connected() const { return options_.worker != nullptr; }

  EngineOptions options_;
  LayerRegistry registry_;
  // Exactly one of the two, by options_.device.
  std::unique_ptr<ToyModel> model_;
  std::unique_ptr<CudaModel> cuda_model_;
  // EngineOptions::split_last_prompt_token, forced on for the CUDA model.
  bool split_last_prompt_token_ = false;
  std::unique_ptr<BlockPool> pool_;
  std::deque<std::unique_ptr<Request>> waiting_;
  std::vector<std::unique_ptr<Request>> running_;
  // Consumer with the connector's asynchronous load: requests whose KV is still arriving;
  // they run once the connector reports them finished receiving.
  std::map<std::string, std::unique_ptr<Request>> loading_;
  // Their loads completed (PollConnector, which may run in the middle of a step): they join
  // running_ at the next step's start.
  std::vector<std::unique_ptr<Request>> loaded_;
  std::map<std::string, std::vector<int32_t>> held_blocks_;  // freed when the connector says
  // Reported finished receiving while still running: a later load error frees at once.
  std::set<std::string> recv_finished_;
  std::vector<LoadError> load_errors_;  // reported, not yet acted on
  std::vector<RequestResult> finished_;
  std::deque<RequestResult> served_results_;
  int64_t steps_ = 0;
  int64_t served_ = 0;
};

}  // namespace kvstream

#endif  // KVSTREAM_SERVING_ENGINE_H_
