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
// ConnectStages joins the stages over TCP (kvstream/transfer/socket.h): stage s > 0 listens
// and publishes its address in the file "<rendezvous>.pp<s>"; stage s < last connects to
// stage s + 1, and the two check each other's stage number, stage count and group key (the
// worker's: group engine id, model, mpirun job) in a hello. Frames are length-prefixed,
// capped in size, little-endian (kvstream/common/byte_io.h; float values as IEEE-754
// binary32) and decoded strictly; every wait has a deadline.
//
// A link to a neighbour carries a byte stream, so a frame cut short leaves it out of step:
// once any byte of a frame has moved, a failure (deadline, socket error, malformed frame)
// breaks that link for good. Its socket is closed (the neighbour sees it gone) and every
// later call on it answers Unavailable naming the failure that broke it. Thread safety: one
// thread uses a channel.
#ifndef KVSTREAM_SERVING_PIPELINE_LINK_H_
#define KVSTREAM_SERVING_PIPELINE_LINK_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvstream {

// Limits of a StageError on the wire, and of a group key.
inline constexpr size_t kMaxStageGroupKeyBytes = 1024;
inline constexpr size_t kMaxStageRequestIdBytes = 256;
inline constexpr size_t kMaxStageErrorMessageBytes = 4096;

// A request that failed on some stage during the step.
struct StageError {
  std::string request_id;  // at most kMaxStageRequestIdBytes, or the message is not sent
  int32_t code = 0;        // an absl::StatusCode other than kOk (1..16)
  std::string message;     // truncated to kMaxStageErrorMessageBytes when sent
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
  // deadline (absl::InfiniteFuture() waits as long as it takes). On failure:
  //   DeadlineExceeded: retryable only when no byte of the frame had moved (the link is
  //     intact; the message says so), as always with a deadline that had passed before the
  //     call. When the deadline passed in the middle of a frame the link is broken (see
  //     above) and the message says how many bytes had moved.
  //   Unavailable: the neighbour is gone, a socket error, or the link was broken by an
  //     earlier failure (named in the message). The link is closed. (A socket error the
  //     kernel blames on this process keeps its own code and also closes the link:
  //     ResourceExhausted when out of buffers, Internal for a bad descriptor.)
  //   FailedPrecondition: there is no such neighbour.
  //   InvalidArgument from Send: the message cannot be sent (over the frame size limit, a
  //     request id too long, an error code that is not an error); nothing was written and
  //     the link is intact.
  //   InvalidArgument from Receive: a malformed frame (bad header, announced length over the
  //     limit, payload that does not decode). The link is broken.
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
  // What every stage of one group must share (at most kMaxStageGroupKeyBytes): stages whose
  // keys differ refuse each other at the hello, so that stages of another job or of another
  // model that find the same rendezvous files never exchange hidden states.
  std::string group_key;
  absl::Duration timeout = absl::Seconds(60);  // for the whole setup
  // Largest payload of one frame, either way. Send refuses bigger messages; Receive refuses a
  // bigger announced length before reading its payload, and grows its buffer only as bytes
  // arrive, so a peer announcing a large frame and stalling costs little memory. The default
  // holds float logits of 256 rows over a 152k vocabulary (about 150 MiB) with room to spare.
  uint64_t max_frame_bytes = uint64_t{256} << 20;
};

// Connects this stage to its neighbours (see above). InvalidArgument for bad options
// (including a max_frame_bytes too small for an empty message);
// DeadlineExceeded when a neighbour does not show up in time; Unavailable for socket errors
// (ResourceExhausted when out of descriptors);
// FailedPrecondition when the peer is not the expected stage of as many stages or has
// another group key.
absl::StatusOr<std::unique_ptr<StageChannel>> ConnectStages(const StageChannelOptions& options);

// The address peers should dial for a listening "host:port": a wildcard host is replaced by
// this host's first non-loopback IPv4 address.
std::string DialableAddress(const std::string& address);

// Frames, exposed for tests. Encoding fails with InvalidArgument for a request id over
// kMaxStageRequestIdBytes (truncating it could make stages disagree about which request
// failed) or a code outside 1..16; error messages are truncated to kMaxStageErrorMessageBytes.
// Decoding is strict: InvalidArgument saying what is wrong for a truncated frame, trailing
// bytes, a count running past the end, a field over its limit or an error code outside 1..16.
absl::StatusOr<std::string> EncodeStageMessage(const StageMessage& message);
absl::StatusOr<StageMessage> DecodeStageMessage(const std::string& payload);

}  // namespace kvstream

#endif  // KVSTREAM_SERVING_PIPELINE_LINK_H_
