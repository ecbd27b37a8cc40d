// Pipeline-parallel decode inside kvstream's workers: the stages of one decode group, each
// owning a range of the model's layers (and receiving only those layers' KV), run every step
// together. Stage s runs its layers over the step's hidden states and passes them forward
// to stage s+1; the last stage computes the logits, which travel back stage by stage to
// stage 0 together with every stage's load errors of the step, so that all stages sample
// the same tokens and treat the same requests as failed.
//
//   ASSIGN_OR_RETURN(auto channel, ConnectStages(options));   // stage 1 of 2, say
//   ASSIGN_OR_RETURN(StageMessage in, channel->ReceiveForward(deadline));  // hidden states
//   ... run layers ...
//   RETURN_IF_ERROR(channel->SendBackward(logits_and_errors, deadline));
//
// ConnectStages joins the stages over TCP: stage s > 0 listens and publishes its address in
// the file "<rendezvous>.pp<s>"; stage s < last connects to stage s + 1. Frames are
// length-prefixed and decoded strictly; every wait has a deadline. Thread safety: one
// thread uses a channel.
#ifndef KVSTREAM_LAUNCH_PIPELINE_LINK_H_
#define KVSTREAM_LAUNCH_PIPELINE_LINK_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvstream {

// A request that failed on some stage during the step.
struct StageError {
  std::string request_id;
  int32_t code = 0;  // absl::StatusCode
  std::string message;
};

struct StageMessage {
  uint64_t step = 0;      // the sender's step number
  uint64_t schedule = 0;  // digest of the step's batch; stages must agree
  std::vector<float> values;  // forward: hidden states [rows, hidden]; backward: logits
  std::vector<StageError> errors;
};

// One stage's view of its neighbours.
class StageChannel {
 public:
  virtual ~StageChannel() = default;
  virtual int stage() const = 0;
  virtual int num_stages() const = 0;
  // To stage + 1 / from stage - 1 / to stage - 1 / from stage + 1. Block until done or the
  // deadline (DeadlineExceeded); Unavailable when the neighbour is gone; FailedPrecondition
  // when there is no such neighbour; InvalidArgument for a malformed frame.
  virtual absl::Status SendForward(const StageMessage& message, absl::Time deadline) = 0;
  virtual absl::StatusOr<StageMessage> ReceiveForward(absl::Time deadline) = 0;
  virtual absl::Status SendBackward(const StageMessage& message, absl::Time deadline) = 0;
  virtual absl::StatusOr<StageMessage> ReceiveBackward(absl::Time deadline) = 0;
};

struct StageChannelOptions {
  int stage = 0;
  int num_stages = 1;
  // Path prefix of the rendezvous files ("<rendezvous>.pp<s>"), on a file system every
  // stage sees.
  std::string rendezvous;
  // Where stages > 0 listen: "127.0.0.1" on one host, "0.0.0.0" across hosts (the file then
  // holds this host's first non-loopback address).
  std::string listen_host = "127.0.0.1";
  absl::Duration timeout = absl::Seconds(60);  // for the whole setup
};

// Connects this stage to its neighbours (see above). InvalidArgument for bad options;
// DeadlineExceeded when a neighbour does not show up in time; Unavailable for socket errors;
// FailedPrecondition when the peer is not the expected stage of as many stages.
absl::StatusOr<std::unique_ptr<StageChannel>> ConnectStages(const StageChannelOptions& options);

// The address peers should dial for a listening "host:port": a wildcard host is replaced by
// this host's first non-loopback IPv4 address.
std::string DialableAddress(const std::string& address);

// Frames, exposed for tests: encoding, and strict decoding (InvalidArgument saying what is
// wrong for a truncated frame, trailing bytes or a count running past the end).
std::string EncodeStageMessage(const StageMessage& message);
absl::StatusOr<StageMessage> DecodeStageMessage(const std::string& payload);

}  // namespace kvstream

#endif  // KVSTREAM_LAUNCH_PIPELINE_LINK_H_
