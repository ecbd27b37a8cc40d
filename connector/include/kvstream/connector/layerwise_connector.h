// LayerwiseConnector: kvstream's KvConnector in push mode. The producer posts each layer's
// blocks right after that layer's attention (one-sided writes into the consumer's cache,
// contiguous runs coalesced into one segment, a notification with a checksum after the
// data); the consumer waits per layer, with a deadline, just before that layer's attention.
//
// Control: the producer listens on kv_ip:kv_port (TCP); a consumer connects on first use,
// handshakes (engine ids, protocol version, compatibility hash over layout / dtype / block
// size / heads / head sizes / layer count, its registered cache regions, optional shared
// secret) and then hands requests over (id, prompt tokens, destination blocks).
//
// Routing by layer (pipeline-parallel decode): a consumer registers the layers it owns, and
// its hello carries them. Each stage of a decode group hands every request over with its
// own destination blocks; the producer gives the request to its engine once every layer has
// a destination, then posts each layer to the stage that owns it. Stages whose ranges
// overlap are refused at the second hand-off; layers no stage asks for fail the request
// after send_timeout_ms (and each consumer checks at handshake that its pipeline
// configuration and the producer's layers agree, so a consistent configuration never gets
// there). Errors name the layers and the consumers.
//
// Failures: a layer that does not arrive by load_timeout_ms, a lost producer, a rejected
// hand-off or a checksum mismatch make the request a load error (TakeLoadErrors); the engine
// applies kv_load_failure_policy. A producer whose sends do not finish within
// send_timeout_ms, or whose consumer is lost, gives up and reports the request finished so
// its blocks are freed. A consumer keeps a failed request's blocks (GetFinished reports it
// only later) until the producer confirmed it stopped writing, the link is gone, or the
// send deadline passed and the link was closed.
//
// Threads: one progress thread drives the transport and handles notifications; the
// producer has an accept thread and a reader per consumer; the consumer a reader per
// producer. All state is behind one mutex.
#ifndef KVSTREAM_CONNECTOR_LAYERWISE_CONNECTOR_H_
#define KVSTREAM_CONNECTOR_LAYERWISE_CONNECTOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kvstream/connector/config.h"
#include "kvstream/connector/kv_connector.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {

// The protocol version spoken on the control channel and in notifications.
inline constexpr uint32_t kLayerwiseProtocolVersion = 1;

// Creates the connector; the producer (and kv_both) starts listening at once.
// InvalidArgument for a bad config (pipeline parallelism is for consumers only);
// Unavailable when the control port cannot be bound.
absl::StatusOr<std::unique_ptr<KvConnector>> CreateLayerwiseConnector(
    const KvTransferConfig& config, std::unique_ptr<Transport> transport);

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_LAYERWISE_CONNECTOR_H_
