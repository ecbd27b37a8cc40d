// ProducerSide (producer.h): what a consumer's introduction and its hand-offs must satisfy
// before the producer takes them (its regions against what the transport mapped, the
// request against the model and the cache), and how a consumer's request ids are scoped.
#include <algorithm>
#include <utility>

#include <xxhash.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "kvstream/common/int_math.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/connector/layer_routing.h"
#include "producer.h"

namespace kvstream {
namespace internal {

namespace {

// Text without '/' (so that the first '/' of a scoped id ends its scope) and escaped.
std::string ScopeText(absl::string_view name) {
  return absl::StrReplaceAll(absl::CHexEscape(name), {{"/", "\\x2f"}});
}

}  // namespace

std::string ProducerSide::ScopedRequestId(absl::string_view scope, absl::string_view request_id) {
  std::string id = absl::StrCat(scope, "/", absl::CHexEscape(request_id));
  if (id.size() <= kMaxIdBytes) return id;
  // Too long for the engine's ids: a prefix and a hash of the whole.
  const uint64_t h = XXH3_64bits(id.data(), id.size());
  id.resize(kMaxIdBytes - 17);
  absl::StrAppend(&id, "~", absl::Hex(h, absl::kZeroPad16));
  return id;
}

std::string ProducerSide::ScopeFor(const ConsumerLink& link) {
  if (!link.group.empty()) return ScopeText(link.group);
  // Two live consumers of one engine id still get their own namespaces.
  const std::string base = ScopeText(link.engine_id);
  std::string scope = base;
  auto taken = [&](const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& other : links_) {
      if (other->scope == name) return true;
    }
    return false;
  };
  while (taken(scope)) scope = absl::StrCat(base, "#", link_serial_++);
  return scope;
}

// The consumer's cache regions. It may have all of our layers or, as one stage of a
// pipeline-parallel decode group, some of them (which the consumer checks against its
// pipeline configuration); a layer we do not have is refused here.
absl::Status ProducerSide::ImportConsumer(const HelloMsg& hello, ConsumerLink& link) {
  std::shared_ptr<const LayerTable> table = shared_.layers();
  ASSIGN_OR_RETURN(ConnectorHello peer, DecodeConnectorHello(hello.payload));
  const std::string who = absl::StrCat("'", absl::CHexEscape(hello.engine_id), "'");
  std::set<std::pair<int32_t, int>> seen;
  for (const RegionDescriptor& r : peer.regions) {
    if (!seen.insert({r.layer, r.tensor}).second) {
      return absl::InvalidArgumentError(absl::StrCat("consumer ", who,
                                                     " sent two regions for layer ", r.layer,
                                                     " tensor ", int(r.tensor)));
    }
    if (table->ByIndex(r.layer) == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "KV cache compatibility mismatch with peer ", who, ": it registered layer ", r.layer,
          ", which this producer does not have (it has layers ",
          FormatLayerSet(table->indices()), ")"));
    }
    link.layers.insert(r.layer);
  }
  if (link.layers.empty() || seen.size() != 2 * link.layers.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("consumer ", who, " registered ", seen.size(), " regions for layers ",
                     FormatLayerSet(link.layers), "; expected a K and a V region for each"));
  }
  ASSIGN_OR_RETURN(link.peer, shared_.transport->Connect(peer.transport_info));
  for (const RegionDescriptor& r : peer.regions) {
    ASSIGN_OR_RETURN(auto remote, shared_.transport->ImportRemote(link.peer, r.descriptor));
    auto& slot = link.regions[r.layer];
    (r.tensor == 0 ? slot.first : slot.second) = std::move(remote);
  }
  // Same layout (the compatibility hash says so): the regions' sizes give its blocks (the
  // fewest any of its regions holds).
  const KvCacheView cv = table->view();
  const uint64_t es = DTypeSize(cv.spec.dtype);
  const uint64_t k_block = static_cast<uint64_t>(cv.k_strides.block) * es;
  const uint64_t v_block = static_cast<uint64_t>(cv.v_strides.block) * es;
  int64_t blocks = INT64_MAX;
  for (const auto& [layer, regions] : link.regions) {
    if (k_block == 0 || v_block == 0) {
      blocks = 0;
      break;
    }
    blocks = std::min({blocks, static_cast<int64_t>(regions.first->length() / k_block),
                       static_cast<int64_t>(regions.second->length() / v_block)});
  }
  link.remote_num_blocks = blocks;
  return absl::OkStatus();
}

absl::Status ProducerSide::AcceptHandOff(const HandOffMsg& m,
                                         const std::shared_ptr<ConsumerLink>& link) {
  if (m.request_id.empty()) return absl::InvalidArgumentError("empty request id");
  std::shared_ptr<const LayerTable> table = shared_.layers();
  const int64_t send_timeout_ms = shared_.config.kvstream.send_timeout_ms;
  const std::string rid = absl::CHexEscape(m.request_id);
  // The consumer's id is its own: the engine gets one scoped by the consumer (or by the
  // pipeline group whose stages hand the request over together).
  const std::string key = ScopedRequestId(link->scope, m.request_id);
  absl::MutexLock lock(&mu_);
  auto existing = send_.find(key);
  if (existing != send_.end()) {
    SendRequest& s = existing->second;
    if (HasDestination(s, link)) {
      return absl::AlreadyExistsError(absl::StrCat("request ", rid, " already handed over"));
    }
    if (s.state == SendState::kFailed || s.state == SendState::kStopped) {
      return absl::AbortedError(
          absl::StrCat("request ", rid, " was already stopped: ", s.stop_reason));
    }
    if (s.state != SendState::kGathering) {
      return absl::AlreadyExistsError(absl::StrCat("request ", rid,
                                                   " already handed over by ",
                                                   DestinationNames(s),
                                                   ", which receive all its layers"));
    }
  }
  const bool pipeline_stage = link->layers.size() < table->indices().size();
  auto rejected = rejected_stages_.find(key);
  if (rejected != rejected_stages_.end() && pipeline_stage) {
    return absl::AbortedError(absl::StrCat("request ", rid,
                                           ": the hand-off from another pipeline stage was "
                                           "rejected: ",
                                           rejected->second.why));
  }
  absl::Status verdict =
      CheckHandOff(m, *link, existing == send_.end() ? nullptr : &existing->second);
  if (!verdict.ok()) {
    // The other stages of a pipeline must not wait for the gather deadline: the request
    // fails for those already here, and is refused to those still to come.
    if (existing != send_.end()) {
      Fail(existing->second, absl::AbortedError(absl::StrCat(
                                 "the hand-off from ", link->name,
                                 " was rejected: ", verdict.message())));
    } else if (pipeline_stage) {
      rejected_stages_[key] =
          RejectedStage{absl::StrCat(link->name, ": ", verdict.message()),
                        absl::Now() + absl::Milliseconds(send_timeout_ms)};
    }
    return verdict;
  }
  if (existing == send_.end()) {
    SendRequest s;
    s.id = key;
    s.consumer_id = m.request_id;
    s.prompt = m.prompt_token_ids;
    s.num_tokens = static_cast<int32_t>(m.num_tokens);
    // The other stages of a pipeline hand the request over independently; wait for them
    // no longer than a send may take.
    s.gather_deadline = absl::Now() + absl::Milliseconds(send_timeout_ms);
    existing = send_.emplace(s.id, std::move(s)).first;
  }
  SendRequest& s = existing->second;
  s.dests.push_back({link, m.dest_block_ids, m.attempt});
  ++link->active_requests;
  link->active_tokens += static_cast<int64_t>(s.prompt.size());
  for (int32_t l : link->layers) s.route[l] = s.dests.size() - 1;
  if (s.route.size() == table->indices().size()) {
    s.state = SendState::kQueued;
    s.released = true;
    incoming_.push_back({s.id, s.prompt, s.num_tokens});
  }
  return absl::OkStatus();
}

// What a consumer's hand-off must satisfy: enough destination blocks, all inside what its
// regions really span, and, where another stage handed the request over already (`other`),
// the same prompt and layers that no other stage owns.
absl::Status ProducerSide::CheckHandOff(const HandOffMsg& m, const ConsumerLink& link,
                                        const SendRequest* other) const {
  std::shared_ptr<const LayerTable> table = shared_.layers();
  const std::string rid = absl::CHexEscape(m.request_id);
  const int32_t block_size = table->block_size();
  // What the model and this producer's cache can ever serve: a request beyond it would be
  // queued for good (or fail the engine), so it is refused here, alone.
  const KvModelInfo& model = table->model();
  const int64_t prompt = static_cast<int64_t>(m.prompt_token_ids.size());
  if (model.max_model_len > 0 && prompt > model.max_model_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request ", rid, ": a prompt of ", prompt,
        " tokens is longer than the maximum model length of the prefill worker, ",
        model.max_model_len));
  }
  if (prompt > table->num_blocks() * block_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request ", rid, ": a prompt of ", prompt, " tokens needs ",
        CeilDiv(prompt, block_size), " blocks, more than the whole cache of the prefill worker (",
        table->num_blocks(), " blocks of ", block_size, " tokens)"));
  }
  if (model.vocab_size > 0) {
    for (size_t i = 0; i < m.prompt_token_ids.size(); ++i) {
      if (m.prompt_token_ids[i] >= model.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "request ", rid, ": prompt token ", i, " is ", m.prompt_token_ids[i],
            ", outside the vocabulary of the prefill model, [0, ", model.vocab_size, ")"));
      }
    }
  }
  // What one consumer may have in flight.
  const KvstreamSettings& k = shared_.config.kvstream;
  if (link.active_requests >= k.max_requests_per_consumer) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request ", rid, ": consumer ", link.name, " already has ",
        link.active_requests, " requests in flight (max_requests_per_consumer ",
        k.max_requests_per_consumer, ")"));
  }
  if (link.active_tokens + prompt > k.max_tokens_per_consumer) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request ", rid, ": its ", prompt, " prompt tokens and the ", link.active_tokens,
        " of the requests in flight from consumer ", link.name,
        " exceed max_tokens_per_consumer ", k.max_tokens_per_consumer));
  }
  if (m.num_tokens == 0 || m.num_tokens > m.prompt_token_ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat("request ", rid, " asks for ",
                                                   m.num_tokens, " tokens of a ",
                                                   m.prompt_token_ids.size(), "-token prompt"));
  }
  const int64_t need = CeilDiv(m.num_tokens, block_size);
  if (static_cast<int64_t>(m.dest_block_ids.size()) < need) {
    return absl::InvalidArgumentError(absl::StrCat("request ", rid, ": ",
                                                   m.dest_block_ids.size(),
                                                   " destination blocks for ", m.num_tokens,
                                                   " tokens of block size ", block_size));
  }
  for (int64_t i = 0; i < need; ++i) {
    const int32_t b = m.dest_block_ids[i];
    if (b < 0 || b >= link.remote_num_blocks) {
      return absl::OutOfRangeError(absl::StrCat("request ", rid, ": destination block ",
                                                b, " outside [0, ", link.remote_num_blocks, ")"));
    }
  }
  if (other == nullptr) return absl::OkStatus();
  if (other->prompt != m.prompt_token_ids || other->num_tokens != static_cast<int32_t>(m.num_tokens)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request ", rid, " handed over by ", link.name,
        " has another prompt or token count than the same request handed over by ",
        DestinationNames(*other)));
  }
  for (int32_t l : link.layers) {
    auto owner = other->route.find(l);
    if (owner != other->route.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", rid, ": consumer ", link.name, " asks for layers ",
          FormatLayerSet(link.layers), " but layer ", l, " already goes to consumer ",
          other->dests[owner->second].link->name,
          " (the pipeline stages' layer ranges overlap)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace kvstream
