// The layerwise connector's scheduler side (layerwise_connector.h): per-request lifecycles
// as the scheduler's process sees them. It knows blocks and token counts, never a transport.
#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvstream/common/int_math.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/connector/layerwise_connector.h"

namespace kvstream {
namespace {

// Consumer: a request whose prompt KV comes from a producer.
enum class LoadState {
  kAwaitingHandOff,  // allocated; goes to the worker in the next metadata
  kLoading,          // handed to the worker; its layers arrive
  kFailed,           // a load error came back; waits for the worker to report it finished
};

struct LoadEntry {
  LoadState state = LoadState::kAwaitingHandOff;
  KvConnectorMetadata::Load load;
};

// Producer: a request a consumer handed over.
enum class SaveState {
  kQueued,     // reported by the worker; waits for the engine to allocate it
  kAllocated,  // its blocks are known; the save goes out with the step that completes it
  kSaving,     // in a step's metadata; the worker streams it
  kSent,       // the worker reported its sends done (or failed) before the engine finished it
};

struct SaveEntry {
  SaveState state = SaveState::kQueued;
  int32_t num_tokens = 0;
  std::vector<int32_t> blocks;
  bool engine_finished = false;  // kSaving: the engine is done; free once the sends are
};

class LayerwiseScheduler final : public KvConnectorScheduler {
 public:
  LayerwiseScheduler(KvRole role, int32_t block_size, bool load_async)
      : role_(role), block_size_(block_size), load_async_(load_async) {}

  KvRole role() const override { return role_; }

  absl::StatusOr<MatchedTokens> GetNumNewMatchedTokens(const KvRequest& request,
                                                       int32_t num_computed_tokens) override {
    MatchedTokens m;
    if (!is_consumer() || !request.remote_prefill) return m;
    // All prompt tokens but the last come from the producer; the consumer computes the last
    // one itself to produce the first token.
    const int32_t remote = static_cast<int32_t>(request.prompt_token_ids.size()) - 1;
    m.num_tokens = std::max(0, remote - num_computed_tokens);
    m.load_async = load_async_ && m.num_tokens > 0;
    return m;
  }

  absl::Status UpdateStateAfterAlloc(const KvRequest& request, absl::Span<const int32_t> block_ids,
                                     int32_t num_external_tokens) override {
    if (is_consumer() && request.remote_prefill && num_external_tokens > 0) {
      RETURN_IF_ERROR(CheckBlocks(request.request_id, block_ids, num_external_tokens, "remote"));
      if (loads_.count(request.request_id) != 0) {
        return absl::AlreadyExistsError(
            absl::StrCat("request ", request.request_id, " is already loading"));
      }
      LoadEntry& e = loads_[request.request_id];
      e.load.request_id = request.request_id;
      e.load.prompt_token_ids = request.prompt_token_ids;
      e.load.block_ids.assign(block_ids.begin(), block_ids.end());
      e.load.num_tokens = num_external_tokens;
      e.load.remote = *request.remote_prefill;
      awaiting_hand_off_.push_back(request.request_id);
      return absl::OkStatus();
    }
    auto it = saves_.find(request.request_id);
    if (it == saves_.end()) return absl::OkStatus();  // a local request: nothing to send
    SaveEntry& s = it->second;
    // Stopped by the worker before the engine got to it: nothing will be saved, and
    // RequestFinished holds nothing.
    if (s.state == SaveState::kSent) return absl::OkStatus();
    if (s.state != SaveState::kQueued) {
      return absl::FailedPreconditionError(
          absl::StrCat("request ", request.request_id, " was already allocated"));
    }
    RETURN_IF_ERROR(CheckBlocks(request.request_id, block_ids, s.num_tokens, "to send"));
    s.blocks.assign(block_ids.begin(), block_ids.end());
    s.state = SaveState::kAllocated;
    return absl::OkStatus();
  }

  absl::StatusOr<KvConnectorMetadata> BuildConnectorMeta(
      absl::Span<const ScheduledRequest> scheduled) override {
    KvConnectorMetadata meta;
    for (const std::string& id : awaiting_hand_off_) {
      auto it = loads_.find(id);
      if (it == loads_.end() || it->second.state != LoadState::kAwaitingHandOff) continue;
      meta.loads.push_back(it->second.load);
      it->second.state = LoadState::kLoading;
    }
    awaiting_hand_off_.clear();
    for (const ScheduledRequest& sr : scheduled) {
      auto l = loads_.find(sr.request_id);
      if (l != loads_.end() && l->second.state == LoadState::kLoading) {
        meta.waits.push_back(sr.request_id);
      }
      auto s = saves_.find(sr.request_id);
      if (s != saves_.end() && s->second.state == SaveState::kAllocated &&
          sr.num_computed_tokens + sr.num_scheduled_tokens >= s->second.num_tokens) {
        s->second.state = SaveState::kSaving;
        meta.saves.push_back({sr.request_id, s->second.blocks, s->second.num_tokens});
      }
    }
    meta.finished = std::move(finished_);
    finished_.clear();
    return meta;
  }

  absl::Status UpdateConnectorOutput(const KvConnectorOutput& output) override {
    for (const LoadError& e : output.load_errors) {
      auto it = loads_.find(e.request_id);
      if (it != loads_.end()) it->second.state = LoadState::kFailed;
    }
    for (const std::string& id : output.finished_recving) loads_.erase(id);
    // Hand-offs before finished sends: a request handed over and stopped by the worker
    // before its next report (its consumer aborted it or was lost) comes in one output as
    // both, and the finish is about that hand-off (the worker takes no second hand-off of
    // an id before it reported the first finished).
    for (const IncomingRequest& in : output.incoming) {
      auto existing = saves_.find(in.request_id);
      if (existing != saves_.end() && existing->second.state == SaveState::kSent) {
        // Its consumer handed the id over again after the worker stopped the first attempt
        // (and forgot it), while the engine still runs that attempt: the engine cannot take
        // a second request of one id. The worker stops this one and tells the consumer.
        finished_.push_back(in.request_id);
        continue;
      }
      if (existing != saves_.end()) {
        return absl::AlreadyExistsError(absl::StrCat(
            "request ", in.request_id, " was handed over again while the first is in progress"));
      }
      SaveEntry& s = saves_[in.request_id];
      s.num_tokens = in.num_tokens;
      KvRequest r;
      r.request_id = in.request_id;
      r.prompt_token_ids = in.prompt_token_ids;
      incoming_.push_back(std::move(r));
    }
    for (const std::string& id : output.finished_sending) {
      auto it = saves_.find(id);
      if (it == saves_.end()) continue;
      if (it->second.engine_finished) {
        saves_.erase(it);
      } else {
        it->second.state = SaveState::kSent;
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<bool> RequestFinished(const std::string& request_id) override {
    bool delay = false;
    auto l = loads_.find(request_id);
    if (l != loads_.end()) {
      switch (l->second.state) {
        case LoadState::kAwaitingHandOff:
          loads_.erase(l);  // never handed over: nothing can land
          break;
        case LoadState::kLoading:
          // The worker stops the load; its blocks go once nothing can land any more.
          finished_.push_back(request_id);
          delay = true;
          break;
        case LoadState::kFailed:
          delay = true;  // the producer may still be writing until the worker says it stopped
          break;
      }
    }
    auto s = saves_.find(request_id);
    if (s != saves_.end()) {
      switch (s->second.state) {
        case SaveState::kQueued:
        case SaveState::kAllocated:
          // Finished without its KV sent: the worker tells the consumer.
          finished_.push_back(request_id);
          saves_.erase(s);
          break;
        case SaveState::kSaving:
          s->second.engine_finished = true;
          delay = true;
          break;
        case SaveState::kSent:
          saves_.erase(s);
          break;
      }
    }
    return delay;
  }

  std::vector<KvRequest> TakeIncomingRequests() override {
    std::vector<KvRequest> out = std::move(incoming_);
    incoming_.clear();
    return out;
  }

 private:
  bool is_consumer() const { return role_ != KvRole::kProducer; }

  absl::Status CheckBlocks(const std::string& id, absl::Span<const int32_t> blocks,
                           int32_t tokens, absl::string_view what) const {
    const int64_t need = CeilDiv(tokens, block_size_);
    if (static_cast<int64_t>(blocks.size()) < need) {
      return absl::InvalidArgumentError(absl::StrCat("request ", id, ": ", blocks.size(),
                                                     " blocks for ", tokens, " tokens ", what,
                                                     " of block size ", block_size_));
    }
    for (int32_t b : blocks) {
      if (b < 0) {
        return absl::InvalidArgumentError(absl::StrCat("request ", id, ": block id ", b));
      }
    }
    return absl::OkStatus();
  }

  const KvRole role_;
  const int32_t block_size_;
  const bool load_async_;  // KvstreamSettings::load_async
  std::map<std::string, LoadEntry> loads_;
  std::vector<std::string> awaiting_hand_off_;  // in allocation order
  std::map<std::string, SaveEntry> saves_;
  std::vector<std::string> finished_;  // for the next metadata
  std::vector<KvRequest> incoming_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvConnectorScheduler>> CreateLayerwiseScheduler(
    const KvTransferConfig& config, int32_t block_size) {
  if (block_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("LayerwiseConnector scheduler: block size ", block_size, " must be >= 1"));
  }
  RETURN_IF_ERROR(ValidateLayerwiseConfig(config));
  return std::unique_ptr<KvConnectorScheduler>(new LayerwiseScheduler(config.kv_role, block_size,
                                                                    config.kvstream.load_async));
}

}  // namespace kvstream
