// Host writes sent as active messages (private to transfer/): how the UCX transport moves
// host bytes over TCP, where UCX has no one-sided put of its own.
//
// Why not ucp_put_nbx there: UCX 1.13 emulates a put over TCP with active-message
// fragments (rma_am), and the target's handler (ucp_put_handler, rma_sw.c) writes each
// fragment and then acknowledges it on the endpoint back to the writer. If that
// acknowledgement cannot be sent because the writer's connection was reset after its
// fragments arrived, UCX aborts the *receiving* process (ucp_request_try_send:
// "Fatal: unexpected error", with no setting that turns it off). That happens when a
// writer dies with puts in flight, and when a partition heals after the decode worker has
// given the prefill worker up (docs/scale-out.md, "Measured: fault timings"). A write sent
// as kvstream's own active message needs no answer. The receiver's handler copies the
// payload into its memory and returns, and a connection that fails later only fails that
// endpoint. The handler also checks what an emulated put never did: the destination must
// lie inside a host region the receiver has registered at that moment (a late write into
// memory deregistered meanwhile is dropped and counted), and the sender must not be one the
// receiver has disconnected from (Transport::Disconnect; until it connects to it again):
// that is how a consumer that gives a producer up fences that producer's late writes out
// of blocks it is about to reuse.
//
// Protocol: every segment is cut into pieces of at most kWriteMessageBytes, each one eager
// active message (id kWriteAmId, header ucx_wire.h's WriteHeader: the sender's uid and the
// destination address; payload: the bytes), sent straight from the registered local memory.
// A piece fits in one of kvstream's 256 KiB TCP segments (ucx_setup.cc), so the receiver
// handles each one in UCX's receive buffer and copies it once, as it did for a put fragment.
// Order: the transfer's flush (UcxCore::StartFlush) is posted after the pieces, as it was
// after puts. It completes once every piece has left through the endpoint, and only then is
// the notification sent on the same connection, which delivers in order. So a notification
// still follows the data of its own write and of every earlier one.
//
// Which writes: UcxCore::am_writes (ucx_setup.cc: UcxWriteProtocol, by default active
// messages when UCX_TLS names only tcp and self). Staged device writes over TCP still put
// their chunks (ucx/staged_engine.h).
#ifndef KVSTREAM_TRANSFER_SRC_UCX_AM_WRITES_H_
#define KVSTREAM_TRANSFER_SRC_UCX_AM_WRITES_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvstream/transfer/transport.h"
#include "ucx/ucx_core.h"

namespace kvstream {
namespace internal {

// Active-message id of write pieces.
inline constexpr unsigned kWriteAmId = 19;
// The largest piece of a segment one active message carries.
inline constexpr size_t kWriteMessageBytes = size_t{192} << 10;

// Posts transfer `t`'s segments from `local_base` (registered as `memh`) to the peer's
// `remote_base` as write pieces; the headers live in `t` until its flush completes. Never
// blocks. On error (the endpoint refused a piece) earlier pieces may still land, and `t`'s
// headers move to the core's `orphan_headers` (UCX may still read them).
// REQUIRES: core->mu; t->peer has an endpoint.
absl::Status PostWritePieces(UcxCore* core, UcxTransfer* t, const char* local_base,
                             ucp_mem_h memh, uint64_t remote_base,
                             absl::Span<const Segment> segments);

// Records [base, base + length) as a host region write pieces may land in, and forgets it.
// REQUIRES: core->mu.
void AddHostRegion(UcxCore* core, const void* base, size_t length);
void RemoveHostRegion(UcxCore* core, const void* base, size_t length);

// The receiver's handler of write pieces (installed by UcxCore::InstallHandlers).
ucs_status_t OnWritePiece(void* arg, const void* header, size_t header_length, void* data,
                          size_t length, const ucp_am_recv_param_t* param);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_AM_WRITES_H_
