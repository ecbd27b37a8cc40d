// KV connectors: what moves KV caches between a prefill (producer) and a decode (consumer)
// worker, with the shape of vLLM's KVConnectorBase_V1. A connector is two objects that vLLM
// runs in different processes and that share nothing but two byte strings per step:
//
//   KvConnectorScheduler (kv_connector_scheduler.h), in the scheduler's process: decides per
//     request how many prompt tokens come from remote and what each step must load or save,
//     and builds the step's KvConnectorMetadata.
//   KvConnectorWorker (kv_connector_worker.h), in each worker process: owns the transport,
//     the control channel and the caches' registrations, does the step's loads and saves
//     around every attention layer (it is the layers' TransferHook), and reports what
//     happened as a KvConnectorOutput.
//
// One step (connector_metadata.h for the two messages):
//   scheduler: GetNumNewMatchedTokens, UpdateStateAfterAlloc (per admitted request)
//              meta = BuildConnectorMeta(scheduled)                    --- bytes --->
//   worker:    BindConnectorMetadata(meta); StartLoadKv()
//              per layer: BeforeAttention (waits for remote KV), AfterAttention (sends)
//              WaitForSave(); ClearConnectorMetadata()
//              out = TakeOutput()                                      <--- bytes ---
//   scheduler: UpdateConnectorOutput(out); RequestFinished(id) as requests end
//
// This header holds the request types both sides use.
#ifndef KVSTREAM_CONNECTOR_KV_CONNECTOR_H_
#define KVSTREAM_CONNECTOR_KV_CONNECTOR_H_

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kvstream/connector/connector_metadata.h"
#include "kvstream/connector/connector_stats.h"

namespace kvstream {

struct KvRequest {
  std::string request_id;
  std::vector<int32_t> prompt_token_ids;
  // Consumer: set when the prompt's KV should come from this producer.
  std::optional<RemotePrefill> remote_prefill;
};

struct MatchedTokens {
  int32_t num_tokens = 0;  // prompt tokens whose KV will come from remote
  bool load_async = false; // false: the request runs this step, waiting layer by layer
};

// One request scheduled in a step, as the scheduler side sees it.
struct ScheduledRequest {
  std::string request_id;
  int32_t num_computed_tokens = 0;   // tokens in the cache before this step
  int32_t num_scheduled_tokens = 0;  // tokens computed this step
};

// Request ids whose blocks the engine may free (see KvConnectorOutput).
struct FinishedRequests {
  std::set<std::string> finished_sending;
  std::set<std::string> finished_recving;
};

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_KV_CONNECTOR_H_
