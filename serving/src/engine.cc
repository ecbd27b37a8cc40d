// The serving engine of engine.h.
#include "kvstream/serving/engine.h"

#include <algorithm>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvstream/common/int_math.h"
#include "kvstream/attention/metadata.h"
#include "kvstream/common/logging.h"
#include "kvstream/common/monotonic_clock.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

// Engine::TakeServed keeps this many results for a caller that does not take them.
constexpr size_t kServedResultsKept = 4096;

// FNV-1a over the step's batch: stages compare it to be sure they run the same rows.
class Digest {
 public:
  void Add(absl::string_view bytes) {
    for (char c : bytes) {
      h_ ^= static_cast<uint8_t>(c);
      h_ *= 1099511628211ull;
    }
    h_ ^= 0xff;  // separator
    h_ *= 1099511628211ull;
  }
  void Add(int64_t v) { Add(absl::StrCat(v)); }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

KvRequest AsKvRequest(const RequestSpec& spec) {
  KvRequest r;
  r.request_id = spec.id;
  r.prompt_token_ids = spec.prompt;
  r.remote_prefill = spec.remote;
  return r;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  std::unique_ptr<Engine> e(new Engine());
  e->options_ = options;
  if ((options.scheduler != nullptr) != (options.worker != nullptr)) {
    return absl::InvalidArgumentError("engine: a connector needs both its scheduler and worker side");
  }
  ToyModel::Allocator allocate;
  if (options.worker != nullptr) {
    KvConnectorWorker* w = options.worker;
    allocate = [w](size_t bytes) { return w->AllocateCacheMemory(bytes, MemoryKind::kHost); };
  }
  if ((options.pipeline != nullptr) != options.layers.has_value()) {
    return absl::InvalidArgumentError(
        "engine: a pipeline stage needs both its layers and its channel");
  }
  if (options.pipeline != nullptr) {
    const bool first = options.pipeline->stage() == 0;
    const bool last = options.pipeline->stage() + 1 == options.pipeline->num_stages();
    if (first != (options.layers->begin == 0) ||
        last != (options.layers->end == options.model.num_layers)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "engine: pipeline stage ", options.pipeline->stage(), " of ",
          options.pipeline->num_stages(), " cannot run layers ",
          FormatLayerRange(*options.layers), " of ", options.model.num_layers));
    }
  }
  if (options.device == ModelDevice::kCuda) {
    if (options.pipeline != nullptr) {
      return absl::InvalidArgumentError(
          "engine: pipeline stages run the CPU model only (no pipeline with --device=cuda)");
    }
    CudaModel::Allocator device_allocate;
    if (options.worker != nullptr) {
      KvConnectorWorker* w = options.worker;
      device_allocate = [w](size_t bytes) {
        return w->AllocateCacheMemory(bytes, MemoryKind::kDevice);
      };
    }
    ASSIGN_OR_RETURN(e->cuda_model_, CudaModel::Create(options.model, options.num_blocks,
                                                       &e->registry_, device_allocate));
  } else {
    ASSIGN_OR_RETURN(e->model_, ToyModel::Create(options.model, options.num_blocks,
                                                 &e->registry_, allocate, options.layers));
  }
  e->split_last_prompt_token_ =
      options.split_last_prompt_token || options.device == ModelDevice::kCuda;
  ASSIGN_OR_RETURN(e->pool_, BlockPool::Create(static_cast<int32_t>(options.num_blocks)));
  if (options.scatter_seed != 0) {
    // Freed blocks are handed out first, in reverse order of freeing.
    ASSIGN_OR_RETURN(std::vector<int32_t> all, e->pool_->Allocate(e->pool_->num_blocks()));
    std::shuffle(all.begin(), all.end(), std::mt19937(options.scatter_seed));
    for (int32_t id : all) RETURN_IF_ERROR(e->pool_->Free({id}));
  }
  if (options.worker != nullptr) {
    std::map<std::string, KvCache*> caches;
    const LayerRange layers =
        e->cuda_model_ != nullptr ? e->cuda_model_->layers() : e->model_->layers();
    for (int l = layers.begin; l < layers.end; ++l) {
      caches[options.model.LayerName(l)] =
          e->cuda_model_ != nullptr ? e->cuda_model_->cache(l) : e->model_->cache(l);
    }
    // What hand-offs from peers are checked against (a request this engine could never
    // run is refused alone), and what must match for peers to exchange KV.
    const ToyModelConfig& m = options.model;
    KvModelInfo info;
    info.vocab_size = m.vocab_size;
    info.max_model_len = options.num_blocks * m.block_size - 1;  // and one token to generate
    info.fingerprint = absl::StrCat("toy layers ", m.num_layers, " heads ", m.num_heads, " hidden ",
                                    m.hidden_size(), " mlp ", m.intermediate_size, " rope ",
                                    m.rope_theta, " seed ", m.seed,
                                    options.device == ModelDevice::kCuda ? " cuda bf16" : "");
    RETURN_IF_ERROR(options.worker->SetModelInfo(info));
    RETURN_IF_ERROR(options.worker->RegisterKvCaches(caches));
    e->registry_.SetTransferHook(options.hook != nullptr ? options.hook : options.worker);
  }
  return e;
}

absl::Status Engine::AddRequest(RequestSpec spec) {
  if (spec.prompt.empty() || spec.max_new_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("request ", spec.id,
                                                   ": empty prompt or max_new_tokens < 1"));
  }
  for (int32_t t : spec.prompt) {
    if (t < 0 || t >= options_.model.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", spec.id, ": token ", t, " outside the vocabulary"));
    }
  }
  const int64_t blocks =
      CeilDiv(static_cast<int64_t>(spec.prompt.size()) + spec.max_new_tokens, options_.model.block_size);
  if (blocks > pool_->num_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat("request ", spec.id, " needs ", blocks,
                                                     " blocks; the cache has ",
                                                     pool_->num_blocks()));
  }
  auto r = std::make_unique<Request>();
  r->spec = std::move(spec);
  r->arrival = absl::Now();
  r->result.id = r->spec.id;
  r->result.prompt_tokens = static_cast<int>(r->spec.prompt.size());
  waiting_.push_back(std::move(r));
  return absl::OkStatus();
}

bool Engine::HasWork() const {
  return !waiting_.empty() || !running_.empty() || !loading_.empty() || !loaded_.empty() ||
         !held_blocks_.empty();
}

std::vector<RequestResult> Engine::TakeFinished() { return std::move(finished_); }

std::vector<RequestResult> Engine::TakeServed() {
  std::vector<RequestResult> out(std::make_move_iterator(served_results_.begin()),
                                 std::make_move_iterator(served_results_.end()));
  served_results_.clear();
  return out;
}

absl::Status Engine::PollConnector() {
  if (!connected()) return absl::OkStatus();
  ASSIGN_OR_RETURN(KvConnectorOutput raw, options_.worker->TakeOutput());
  if (raw.empty()) return absl::OkStatus();
  // The worker's report reaches the scheduler side as bytes, as across vLLM's processes.
  ASSIGN_OR_RETURN(std::string bytes, EncodeConnectorOutput(raw));
  ASSIGN_OR_RETURN(KvConnectorOutput out, DecodeConnectorOutput(bytes));
  RETURN_IF_ERROR(options_.scheduler->UpdateConnectorOutput(out));
  for (KvRequest& in : options_.scheduler->TakeIncomingRequests()) {
    auto r = std::make_unique<Request>();
    r->spec.id = in.request_id;
    r->spec.prompt = std::move(in.prompt_token_ids);
    r->spec.max_new_tokens = 1;
    r->arrival = absl::Now();
    r->from_consumer = true;
    r->result.id = r->spec.id;
    r->result.prompt_tokens = static_cast<int>(r->spec.prompt.size());
    waiting_.push_back(std::move(r));
  }
  for (const std::set<std::string>* ids : {&out.finished_sending, &out.finished_recving}) {
    for (const std::string& id : *ids) {
      auto it = held_blocks_.find(id);
      if (it == held_blocks_.end()) {
        if (ids == &out.finished_recving) recv_finished_.insert(id);
        continue;
      }
      RETURN_IF_ERROR(pool_->Free(it->second));
      held_blocks_.erase(it);
    }
  }
  for (LoadError& e : out.load_errors) {
    auto it = loading_.find(e.request_id);
    if (it == loading_.end()) {
      load_errors_.push_back(std::move(e));
      continue;
    }
    std::unique_ptr<Request> r = std::move(it->second);
    loading_.erase(it);
    RETURN_IF_ERROR(ReleaseFailedLoad(*r));
    AfterFailedLoad(std::move(r), e.status);
  }
  // Asynchronous loads that completed: their requests run from the next step on.
  for (const std::string& id : out.finished_recving) {
    auto it = loading_.find(id);
    if (it == loading_.end()) continue;
    recv_finished_.erase(id);
    loaded_.push_back(std::move(it->second));
    loading_.erase(it);
  }
  return absl::OkStatus();
}

absl::Status Engine::ReleaseFailedLoad(Request& r) {
  if (recv_finished_.erase(r.spec.id) != 0) {
    RETURN_IF_ERROR(pool_->Free(r.blocks));
  } else {
    held_blocks_[r.spec.id] = std::move(r.blocks);
  }
  r.blocks.clear();
  r.detached = true;
  return absl::OkStatus();
}

void Engine::AfterFailedLoad(std::unique_ptr<Request> r, const absl::Status& error) {
  r->detached = true;
  if (options_.failure_policy == LoadFailurePolicy::kFail) {
    r->result.status = error;
    finished_.push_back(std::move(r->result));
    return;
  }
  Log(LogLevel::kWarning, absl::StrCat("request ", r->spec.id, ": ", error.ToString(),
                                       "; recomputing its prompt locally"));
  r->spec.remote.reset();
  r->computed = 0;
  r->result.remote_tokens = 0;
  r->result.recomputed = true;
  waiting_.push_front(std::move(r));
}

absl::Status Engine::BindStep(absl::Span<const ScheduledRequest> scheduled) {
  ASSIGN_OR_RETURN(KvConnectorMetadata raw, options_.scheduler->BuildConnectorMeta(scheduled));
  ASSIGN_OR_RETURN(std::string bytes, EncodeConnectorMetadata(raw));
  ASSIGN_OR_RETURN(KvConnectorMetadata meta, DecodeConnectorMetadata(bytes));
  RETURN_IF_ERROR(options_.worker->BindConnectorMetadata(meta));
  return options_.worker->StartLoadKv();
}

absl::Status Engine::Admit() {
  for (std::unique_ptr<Request>& r : loaded_) running_.push_back(std::move(r));
  loaded_.clear();
  KvConnectorScheduler* c = options_.scheduler;
  while (!waiting_.empty()) {
    Request& r = *waiting_.front();
    const int64_t need = CeilDiv(static_cast<int64_t>(r.spec.prompt.size()) + r.spec.max_new_tokens,
                                 options_.model.block_size);
    if (need > pool_->num_free()) break;  // wait for blocks to come back
    ASSIGN_OR_RETURN(r.blocks, pool_->Allocate(static_cast<int32_t>(need)));
    int32_t matched = 0;
    bool load_async = false;
    if (c != nullptr && !r.detached) {
      const KvRequest kr = AsKvRequest(r.spec);
      ASSIGN_OR_RETURN(MatchedTokens m, c->GetNumNewMatchedTokens(kr, 0));
      matched = m.num_tokens;
      load_async = m.load_async && matched > 0;
      RETURN_IF_ERROR(c->UpdateStateAfterAlloc(kr, r.blocks, matched));
    }
    r.computed = matched;
    r.result.remote_tokens = matched;
    if (load_async) {
      const std::string id = r.spec.id;
      loading_[id] = std::move(waiting_.front());
    } else {
      running_.push_back(std::move(waiting_.front()));
    }
    waiting_.pop_front();
  }
  return absl::OkStatus();
}

void Engine::FinishRequest(std::unique_ptr<Request> r, absl::Status status) {
  r->result.status = std::move(status);
  bool delay = false;
  if (connected() && !r->detached) {
    auto d = options_.scheduler->RequestFinished(r->spec.id);
    delay = d.ok() && *d;
  }
  recv_finished_.erase(r->spec.id);
  if (delay) {
    held_blocks_[r->spec.id] = std::move(r->blocks);
  } else if (!r->blocks.empty()) {
    absl::Status s = pool_->Free(r->blocks);
    if (!s.ok()) Log(LogLevel::kError, absl::StrCat("freeing blocks: ", s.ToString()));
  }
  if (r->from_consumer) {
    ++served_;
    if (served_results_.size() >= kServedResultsKept) served_results_.pop_front();
    served_results_.push_back(std::move(r->result));
  } else {
    finished_.push_back(std::move(r->result));
  }
}

absl::StatusOr<bool> Engine::Step() {
  RETURN_IF_ERROR(PollConnector());
  RETURN_IF_ERROR(Admit());
  if (running_.empty()) {
    // No forward pass, but the worker still gets the step's metadata (requests finished
    // since the last step) and reports what happened, as vLLM's no-forward steps do.
    if (connected()) {
      RETURN_IF_ERROR(BindStep({}));
      options_.worker->ClearConnectorMetadata();
      RETURN_IF_ERROR(PollConnector());
    }
    return false;
  }

  // One-row sequences first where the attention needs them there (split_last_prompt_token_).
  auto rows_of = [this](const Request& r) {
    const int32_t prompt = static_cast<int32_t>(r.spec.prompt.size());
    if (r.computed >= prompt) return 1;
    const int32_t rest = prompt - r.computed;
    // A prefill worker computes what it sends, the prompt but its last token (the
    // consumer's own), and no more: its GPU is then free while the consumer finishes.
    if (r.from_consumer && rest > 1) return rest - 1;
    return split_last_prompt_token_ && rest > 1 ? rest - 1 : rest;
  };
  if (split_last_prompt_token_) {
    std::stable_partition(running_.begin(), running_.end(),
                          [&](const std::unique_ptr<Request>& r) { return rows_of(*r) == 1; });
  }
  // One row per new token: the rest of each prompt (but its last token, with
  // split_last_prompt_token_), or the last generated token.
  std::vector<SequenceSchedule> schedule;
  std::vector<ScheduledRequest> scheduled;
  std::vector<int32_t> tokens;
  std::vector<int32_t> positions;
  std::vector<int32_t> segments;
  std::vector<int64_t> last_rows;
  std::vector<int64_t> logit_index;  // per running request: its row of the logits, or -1
  Digest digest;
  for (const auto& r : running_) {
    const int32_t prompt = static_cast<int32_t>(r->spec.prompt.size());
    const bool prefill = r->computed < prompt;
    const int32_t n = rows_of(*r);
    if (prefill) {
      tokens.insert(tokens.end(), r->spec.prompt.begin() + r->computed,
                    r->spec.prompt.begin() + r->computed + n);
      // The prompt but its last token, then the last token: the pieces a prefill worker and
      // a decode worker compute (toy_model.h); in one step, or (split) in two.
      if (r->computed + n < prompt) {
        segments.push_back(n);
      } else {
        if (n > 1) segments.push_back(n - 1);
        segments.push_back(1);
      }
    } else {
      tokens.push_back(r->generated.back());
      segments.push_back(1);
    }
    for (int32_t j = 0; j < n; ++j) positions.push_back(r->computed + j);
    schedule.push_back({r->computed, n, r->blocks});
    scheduled.push_back({r->spec.id, r->computed, n});
    // Logits only for the rows a token is sampled from: a prefill chunk's and a prefill
    // worker's (its consumer samples) are never read.
    if (!r->from_consumer && r->computed + n >= prompt) {
      logit_index.push_back(static_cast<int64_t>(last_rows.size()));
      last_rows.push_back(static_cast<int64_t>(tokens.size()) - 1);
    } else {
      logit_index.push_back(-1);
    }
    digest.Add(r->spec.id);
    digest.Add(r->computed);
    digest.Add(n);
  }
  ASSIGN_OR_RETURN(AttentionMetadata md,
                   BuildAttentionMetadata(schedule, options_.model.block_size));
  registry_.SetForwardContext({&md});
  KvConnectorScheduler* c = options_.scheduler;
  if (connected()) RETURN_IF_ERROR(BindStep(scheduled));
  StageChannel* pipe = options_.pipeline;
  const bool first = pipe == nullptr || pipe->stage() == 0;
  const bool last = pipe == nullptr || pipe->stage() + 1 == pipe->num_stages();
  const absl::Time stage_deadline = absl::Now() + options_.stage_timeout;
  // Load errors of this step, on this stage and (in a pipeline) the stages before it.
  std::vector<StageError> errors;
  auto check = [&](const StageMessage& m, absl::string_view from) -> absl::Status {
    if (m.step != static_cast<uint64_t>(steps_) || m.schedule != digest.value()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "pipeline stage ", pipe->stage(), ": the ", from, " stage ran step ", m.step,
          " over another batch than this stage's step ", steps_,
          " (stages must schedule the same requests; did one run out of cache blocks?)"));
    }
    return absl::OkStatus();
  };
  absl::StatusOr<std::vector<float>> hidden = std::vector<float>();
  absl::StatusOr<std::vector<float>> logits = std::vector<float>();
  const uint64_t forward_start_ns = MonotonicNs();
  if (cuda_model_ != nullptr) {
    // The whole model in one call, logits included (no pipeline on CUDA).
    logits = cuda_model_->Forward(tokens, positions, segments, last_rows);
    if (!logits.ok()) hidden = logits.status();
  } else if (first) {
    hidden = model_->Embed(tokens);
  } else {
    absl::StatusOr<StageMessage> in = pipe->ReceiveForward(stage_deadline);
    absl::Status ok = in.ok() ? check(*in, "previous") : in.status();
    if (ok.ok() && in->values.size() != tokens.size() * static_cast<size_t>(
                                            options_.model.hidden_size())) {
      ok = absl::InvalidArgumentError(absl::StrCat("pipeline stage ", pipe->stage(), ": got ",
                                                   in->values.size(), " hidden values for ",
                                                   tokens.size(), " rows"));
    }
    if (ok.ok()) {
      hidden = std::move(in->values);
      errors = std::move(in->errors);
    } else {
      hidden = ok;
    }
  }
  absl::Status ran = hidden.status();
  if (ran.ok() && model_ != nullptr) ran = model_->RunLayers(*hidden, positions, segments);
  const double forward_ms = static_cast<double>(MonotonicNs() - forward_start_ns) / 1e6;
  registry_.SetForwardContext({});
  if (connected()) {
    absl::Status s = options_.worker->WaitForSave();
    if (!s.ok()) Log(LogLevel::kWarning, absl::StrCat("saving KV: ", s.ToString()));
    options_.worker->ClearConnectorMetadata();
  }
  RETURN_IF_ERROR(ran);
  RETURN_IF_ERROR(PollConnector());

  // Requests whose remote KV failed to load: their output of this step is garbage. An error
  // for a request that already gave up its remote KV (detached) is stale.
  std::set<std::string> own_errors;
  if (connected()) {
    std::set<std::string> live;
    for (const auto& r : running_) {
      if (!r->detached) live.insert(r->spec.id);
    }
    for (LoadError& e : load_errors_) {
      if (live.count(e.request_id) == 0) continue;
      own_errors.insert(e.request_id);
      errors.push_back({e.request_id, static_cast<int32_t>(e.status.code()),
                        std::string(e.status.message())});
    }
    load_errors_.clear();
  }
  if (!last) {
    RETURN_IF_ERROR(pipe->SendForward({static_cast<uint64_t>(steps_), digest.value(),
                                       std::move(*hidden), errors},
                                      stage_deadline));
    ASSIGN_OR_RETURN(StageMessage back, pipe->ReceiveBackward(stage_deadline));
    RETURN_IF_ERROR(check(back, "next"));
    if (back.values.size() != last_rows.size() * static_cast<size_t>(options_.model.vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat("pipeline stage ", pipe->stage(), ": got ",
                                                     back.values.size(), " logits for ",
                                                     last_rows.size(), " rows"));
    }
    logits = std::move(back.values);
    errors = std::move(back.errors);
  } else if (model_ != nullptr) {
    logits = model_->Logits(*hidden, last_rows);
    if (!logits.ok()) return logits.status();
  }
  if (!first) {
    RETURN_IF_ERROR(pipe->SendBackward({static_cast<uint64_t>(steps_), digest.value(), *logits,
                                        errors},
                                       stage_deadline));
  }
  ++steps_;

  std::map<std::string, absl::Status> load_errors;
  for (const StageError& e : errors) {
    load_errors.emplace(e.request_id,
                        absl::Status(static_cast<absl::StatusCode>(e.code), e.message));
  }
  const int vocab = options_.model.vocab_size;
  std::vector<std::unique_ptr<Request>> still_running;
  for (size_t i = 0; i < running_.size(); ++i) {
    std::unique_ptr<Request>& r = running_[i];
    auto err = load_errors.find(r->spec.id);
    if (err != load_errors.end() && !r->detached) {
      if (own_errors.count(r->spec.id) != 0 || c == nullptr) {
        // The blocks may still receive writes until the connector says the producer stopped
        // (unless it said so already).
        RETURN_IF_ERROR(ReleaseFailedLoad(*r));
      } else {
        // Another pipeline stage failed to load its layers: give up this stage's part too.
        auto delay = c->RequestFinished(r->spec.id);
        if (delay.ok() && *delay) {
          held_blocks_[r->spec.id] = std::move(r->blocks);
        } else {
          RETURN_IF_ERROR(pool_->Free(r->blocks));
        }
      }
      r->blocks.clear();
      AfterFailedLoad(std::move(r), err->second);
      continue;
    }
    const int32_t prompt = static_cast<int32_t>(r->spec.prompt.size());
    if (r->computed < prompt - 1) {  // this pass computed prompt tokens but the last
      if (r->result.prefill_start_ns == 0) r->result.prefill_start_ns = forward_start_ns;
      r->result.prefill_ms += forward_ms;
    }
    r->computed += schedule[i].query_len;
    if (r->from_consumer && r->computed >= prompt - 1) {
      FinishRequest(std::move(r), absl::OkStatus());  // its KV is what it was for
      continue;
    }
    if (r->computed < prompt) {
      still_running.push_back(std::move(r));  // the prompt's last token is still to come
      continue;
    }
    if (logit_index[i] < 0) {
      return absl::InternalError(absl::StrCat("request ", r->spec.id, " has no logits row"));
    }
    const float* row = logits->data() + static_cast<size_t>(logit_index[i]) * vocab;
    const int32_t token = Argmax(absl::MakeConstSpan(row, vocab));
    r->generated.push_back(token);
    r->result.output_tokens.push_back(token);
    r->result.logits.insert(r->result.logits.end(), row, row + vocab);
    if (r->generated.size() == 1) {
      r->result.ttft_ms = absl::ToDoubleMilliseconds(absl::Now() - r->arrival);
    }
    if (static_cast<int>(r->generated.size()) >= r->spec.max_new_tokens) {
      FinishRequest(std::move(r), absl::OkStatus());
    } else {
      still_running.push_back(std::move(r));
    }
  }
  running_ = std::move(still_running);
  return true;
}

}  // namespace kvstream
