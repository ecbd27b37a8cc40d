// The two messages between a connector's scheduler side and its worker side, which vLLM runs
// in different processes: the step's metadata (scheduler -> worker, vLLM's
// KVConnectorMetadata) and the worker's output (worker -> scheduler, vLLM's
// KVConnectorOutput). Nothing else passes between the two sides, so both encode to bytes:
//
//   ASSIGN_OR_RETURN(KvConnectorMetadata meta, scheduler->BuildConnectorMeta(scheduled));
//   ASSIGN_OR_RETURN(std::string bytes, EncodeConnectorMetadata(meta));
//   ... in the worker's process ...
//   ASSIGN_OR_RETURN(KvConnectorMetadata same, DecodeConnectorMetadata(bytes));
//   RETURN_IF_ERROR(worker->BindConnectorMetadata(same));
//
// Encoding (little-endian; strings u32 length + bytes; lists u32 count + elements):
//   metadata: u32 magic "KVMD", u16 version, list loads {str id, list i32 prompt, list i32
//     blocks, i32 num_tokens, str host, i32 port}, list str waits, list saves {str id, list
//     i32 blocks, i32 num_tokens}, list str finished
//   output: u32 magic "KVMO", u16 version, list str finished_sending, list str
//     finished_recving, list load_errors {str id, list i32 blocks, i32 code, str message},
//     list incoming {str id, list i32 prompt, i32 num_tokens}
// Decoding is strict: truncation, trailing bytes, a wrong magic or version, a count past the
// bytes left, a string over its bound (ids kMaxIdBytes, messages kMaxMessageBytes, hosts 255),
// a negative token or block id or token count, a port outside 0..65535, a status code
// outside 1..16, a set (finished_sending, finished_recving) not in increasing order or with
// an id twice are InvalidArgument naming the field. Encoding checks the same rules, so an
// accepted encoding re-encodes to the same bytes.
#ifndef KVSTREAM_CONNECTOR_CONNECTOR_METADATA_H_
#define KVSTREAM_CONNECTOR_CONNECTOR_METADATA_H_

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvstream {

// Where a consumer's request is prefilled (vLLM's kv_transfer_params).
struct RemotePrefill {
  std::string host;
  int32_t port = 0;
};

// What the scheduler side hands the worker side for one step.
struct KvConnectorMetadata {
  struct Load {  // consumer: hand the request to its producer
    std::string request_id;
    std::vector<int32_t> prompt_token_ids;
    std::vector<int32_t> block_ids;  // destination blocks, token order
    int32_t num_tokens = 0;          // tokens expected from remote
    RemotePrefill remote;
  };
  struct Save {  // producer: push these blocks this step, layer by layer
    std::string request_id;
    std::vector<int32_t> block_ids;  // local blocks, token order
    int32_t num_tokens = 0;
  };
  std::vector<Load> loads;
  std::vector<std::string> waits;  // consumer: requests of this step that expect remote KV
  std::vector<Save> saves;
  // Consumer: requests the engine finished while their KV was still arriving: the worker
  // stops their loads (tells the producer) and reports them finished once nothing can land.
  std::vector<std::string> finished;
};

// A consumer's request whose KV failed to arrive (its blocks hold garbage).
struct LoadError {
  std::string request_id;
  std::vector<int32_t> block_ids;
  absl::Status status;  // DeadlineExceeded, Unavailable (peer lost), DataLoss (checksum), ...
};

// Producer: a request a consumer handed over, for the engine to prefill.
struct IncomingRequest {
  std::string request_id;
  std::vector<int32_t> prompt_token_ids;
  int32_t num_tokens = 0;  // prompt tokens whose KV the consumer wants
};

// What the worker side reports to the scheduler side (everything since its last report).
struct KvConnectorOutput {
  std::set<std::string> finished_sending;  // producer: sends done (or failed); free the blocks
  std::set<std::string> finished_recving;  // consumer: every layer arrived, or the load failed
                                           // and nothing can land any more
  std::vector<LoadError> load_errors;      // consumer: loads that failed since the last report
  std::vector<IncomingRequest> incoming;   // producer: hand-offs to prefill
  bool empty() const {
    return finished_sending.empty() && finished_recving.empty() && load_errors.empty() &&
           incoming.empty();
  }
};

absl::StatusOr<std::string> EncodeConnectorMetadata(const KvConnectorMetadata& metadata);
absl::StatusOr<KvConnectorMetadata> DecodeConnectorMetadata(absl::string_view bytes);

absl::StatusOr<std::string> EncodeConnectorOutput(const KvConnectorOutput& output);
absl::StatusOr<KvConnectorOutput> DecodeConnectorOutput(absl::string_view bytes);

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_CONNECTOR_METADATA_H_
