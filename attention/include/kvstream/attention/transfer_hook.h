// TransferHook: the seam through which a KV connector wraps every attention layer.
//
// For each layer of a real forward step (not a profiling or dummy run), with a hook bound
// to the layer's LayerRegistry, the Attention layer does:
//
//   cache update (this step's new keys/values into their slots)
//   RETURN_IF_ERROR(hook->BeforeAttention(layer_name, stream));        // wait for remote KV
//   backend attention
//   RETURN_IF_ERROR(hook->AfterAttention(layer_name, cache, metadata, stream));  // send
//
// The cache update runs before the wait because new tokens go to other slots than the ones
// being loaded, so AfterAttention sees this step's keys and values. attention/ knows only
// this interface; connector/ implements it.
//
// `stream` is the layer's work queue: for a cache in device memory the cudaStream_t (as
// void*) on which the cache update and the attention were enqueued and may not have run
// yet; null for host caches, whose work is done when the call comes. A hook orders its
// device work after the stream's (an event recorded on it), never by synchronising the
// host with it; what BeforeAttention waited for is in place before it returns, so work
// enqueued on the stream afterwards sees it.
#ifndef KVSTREAM_ATTENTION_TRANSFER_HOOK_H_
#define KVSTREAM_ATTENTION_TRANSFER_HOOK_H_

#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "kvstream/attention/metadata.h"
#include "kvstream/cache/kv_cache.h"

namespace kvstream {

class TransferHook {
 public:
  virtual ~TransferHook() = default;

  // Blocks until `layer_name`'s KV has arrived for every request of the step that expects
  // remote KV, or until the hook's own deadline, when it returns an error (the layer then
  // fails this step). Called on the thread running the forward pass.
  virtual absl::Status BeforeAttention(absl::string_view layer_name, void* stream) = 0;

  // Starts sending `layer_name`'s blocks (the whole paged cache is passed; the hook picks
  // the blocks from its own per-step state), ordered after the work enqueued on `stream`
  // so far. Must not wait for the transfer, nor for the stream.
  virtual absl::Status AfterAttention(absl::string_view layer_name, const KvCache& kv_cache,
                                      const AttentionMetadata& metadata, void* stream) = 0;
};

}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_TRANSFER_HOOK_H_
