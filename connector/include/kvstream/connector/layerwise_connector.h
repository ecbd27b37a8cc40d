// LayerwiseConnector: kvstream's connector in push mode. The producer posts each layer's
// blocks right after that layer's attention (one-sided writes into the consumer's cache,
// contiguous runs coalesced into one segment, a notification with a checksum after the
// data); the consumer waits per layer, with a deadline, just before that layer's attention.
//
// Control: the producer listens on kv_ip:kv_port (TCP); a consumer connects on first use,
// handshakes (engine ids, protocol version, compatibility hash over layout / dtype / block
// size / heads / head sizes / the model's vocabulary and fingerprint, its registered cache
// regions, optional shared secret) and then hands requests over (id, prompt tokens, destination blocks).
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
// The scheduler side (CreateLayerwiseScheduler) keeps each request's lifecycle as the
// scheduler sees it; the worker side (CreateLayerwiseWorker) is a producer side, a consumer
// side or both (kv_both) over one transport, with the registered layers and the stats
// between them (connector/src/: producer, consumer, layer_table, stats_book).
//
// Threads (worker side): one progress thread drives the transport and hands notifications
// to the consumer side; the producer side has an accept thread and a reader per control
// connection; the consumer side a reader per producer. A reader is joined once its
// connection is done, and at most max_connections are served at once on each side (the
// producer closes the connections beyond at once; a consumer fails the loads to producers
// beyond with ResourceExhausted). Each side has its own lock.
//
// Bounds against peers: every hand-off is checked against the producer's model and cache
// (KvModelInfo: token ids in the vocabulary, the prompt within max_model_len and within
// what its whole cache holds), and each consumer's requests and prompt tokens in flight are
// bounded; a hand-off that fails a check fails that request alone. Request ids are scoped
// by the consumer that sent them (producer.h).
#ifndef KVSTREAM_CONNECTOR_LAYERWISE_CONNECTOR_H_
#define KVSTREAM_CONNECTOR_LAYERWISE_CONNECTOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kvstream/connector/config.h"
#include "kvstream/connector/kv_connector_scheduler.h"
#include "kvstream/connector/kv_connector_worker.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {

// The protocol version spoken on the control channel and in notifications.
inline constexpr uint32_t kLayerwiseProtocolVersion = 1;

// Checks what both sides need of a config built in code (ParseKvTransferConfig checks the
// same): pipeline settings in range and consistent, pipeline parallelism only for
// consumers. InvalidArgument naming the setting.
absl::Status ValidateLayerwiseConfig(const KvTransferConfig& config);

// The scheduler side, for caches of `block_size` tokens per block. InvalidArgument for a bad
// config or block size.
absl::StatusOr<std::unique_ptr<KvConnectorScheduler>> CreateLayerwiseScheduler(
    const KvTransferConfig& config, int32_t block_size);

// The worker side over `transport`; the producer side (and kv_both) starts listening at
// once. InvalidArgument for a bad config; Unavailable when the control port cannot be bound.
absl::StatusOr<std::unique_ptr<KvConnectorWorker>> CreateLayerwiseWorker(
    const KvTransferConfig& config, std::unique_ptr<Transport> transport);

}  // namespace kvstream

#endif  // KVSTREAM_CONNECTOR_LAYERWISE_CONNECTOR_H_
