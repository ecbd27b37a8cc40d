// The UCX transport: one UCP context and worker (error handling mode PEER), endpoints per
// peer, registered memory with packed remote keys, one-sided puts of segment batches, and
// notifications as active messages sent after an endpoint flush, so that a peer sees a
// notification only once the data before it is in place.
//
// Device memory (builds with CUDA): neither Debian's UCX nor the GPU machines' has CUDA
// transports, so a write from a device registration into a peer's device region is staged
// through pinned host memory: one gather kernel per chunk into a device staging buffer and
// a device-to-host copy into the receiver's landing slot (mapped into the writer over
// shared memory; put across over TCP), then, on the receiver, a host-to-device copy and
// one scatter kernel per chunk; the notification is delivered only after every chunk of
// the write (and of every earlier write from that sender) has landed on the receiver's
// GPU, which the receiver learns by polling events in Progress (never a blocking sync).
// WriteOrder::ready_event is waited for on the device (cudaStreamWaitEvent);
// notification_tail is appended when the notification is sent. Writes between host and
// device memory are refused (InvalidArgument). The protocol is written down in
// transfer/src/ucx/staged_engine.h. The receiver takes part: it scatters and credits only
// inside its Progress(), so a staged write advances only while both sides progress.
// One GPU per transport: the device of its first device registration.
//
// Two properties of UCX 1.13 that users of this transport must know:
// - Over shared memory ("shm") and TCP, UCX has no one-sided path for memory it did not
//   allocate itself (cma serves only rendezvous, never ucp_put), so puts into ordinary
//   (engine-owned) memory are emulated with active messages: the data lands only when the
//   *target* calls Progress(). A receiver waiting for a notification does so anyway.
//   AllocateMemory() is the way out over shared memory: it has UCX allocate the memory
//   (ucp_mem_map with UCP_MEM_MAP_ALLOCATE: a sysv or posix shared segment by UCX_ALLOC_PRIO),
//   whose remote key lets the writer attach the segment, and puts into it are then plain
//   copies by the writer over UCX's sysv/posix RMA lanes: the data lands without the
//   target's progress (notifications still need it). Over TCP the memory is ordinary
//   (anonymous mmap) and puts stay emulated, each fragment acknowledged by the target, and
//   UCX 1.13 aborts a target whose acknowledgement meets a connection reset after the
//   fragment arrived. So over TCP alone (UCX_TLS of tcp and self) writes are, by default,
//   kvstream's own active messages ("write pieces", UcxWriteProtocol below), which land
//   the same way, only while the target progresses, and are never answered. Observed with
//   UCX 1.13: a new endpoint's
//   first write completes only after the target progressed once (connection handshake).
// - A peer that dies before UCX's connection handshake with it completed is not detected by
//   UCX; transfers to it stay in progress until the caller's deadline (WaitForTransfer),
//   after which the caller should Disconnect(). Once connected, a dead peer is detected by
//   keepalive (keepalive_interval) or by its closed socket.
//
// A peer's memory descriptor is only its claim. Where the descriptor's remote key maps the
// peer's memory into this process (a shared-memory segment: this process then stores into
// it itself, by UCX's shared-memory puts or the copy threads), ImportRemote refuses
// (InvalidArgument, naming the peer and the sizes) a host region unless every byte it claims
// lies in what the key mapped here and in none of this transport's own shared memory; the
// staged path checks a receiver's landing area the same way. So no descriptor makes this
// process store outside memory it mapped for the peer. Where the key maps nothing here
// (emulated puts, TCP) the writer cannot check the claim. With emulated puts UCX 1.13
// places the bytes on the receiver's side at the address the writer names without checking
// the receiver's registrations (observed: a receiver whose descriptor claims more than it
// registered crashes itself when written past its registration), so a hostile *writer* can
// place bytes anywhere in a receiver that takes emulated puts. Write pieces are checked by
// the receiver instead: a piece lands only inside a host region it has registered at that
// moment, and is dropped otherwise.
//
// Thread safety: as Transport (every method from any thread); internally one mutex
// serialises every UCX call and the worker runs in UCS_THREAD_MODE_SERIALIZED. With
// copy_threads, those threads copy without the mutex and take it to hand a finished write
// on to its notification.
//
// Lifetimes with copy threads: a write reads its local registration and writes the peer's
// memory until the transfer leaves kInProgress; destroying either handle before that
// cancels the transfer (and waits for the piece being copied, at most 1 MiB).
#ifndef KVSTREAM_TRANSFER_UCX_TRANSPORT_H_
#define KVSTREAM_TRANSFER_UCX_TRANSPORT_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvstream/transfer/transport.h"

namespace kvstream {

// How host writes travel (UcxTransportOptions::write_protocol).
enum class UcxWriteProtocol {
  // Active messages where UCX would only emulate puts with acknowledged active messages
  // (UCX_TLS naming nothing but tcp and self), UCX puts elsewhere.
  kAuto,
  // UCX one-sided puts (ucp_put_nbx), emulated by UCX over TCP. The UCX this was built on
  // (1.13) then aborts a receiver that cannot acknowledge a put fragment because the
  // writer's connection was reset after the fragment arrived.
  kPut,
  // kvstream's own eager active messages, copied into the destination by the receiver
  // (which drops any whose destination is not inside memory it has registered) and never
  // answered. Both sides must be of a kvstream version that has them.
  kActiveMessage,
};

struct UcxTransportOptions {
  // UCX transports to use (UCX_TLS syntax): "shm" (shared memory, same host), "tcp"
  // (sockets, also across hosts), or any UCX_TLS value such as "all".
  std::string tls = "shm";
  // Network devices for tcp (UCX_NET_DEVICES syntax); empty = UCX's choice. "lo" keeps TCP
  // on loopback.
  std::string net_devices;
  // How often UCX probes each peer (UCX_KEEPALIVE_INTERVAL); a peer that died without a
  // trace the transport would notice otherwise (e.g. one reached over shared memory) is
  // detected within a few intervals. Zero keeps UCX's default (20 s in UCX 1.13).
  absl::Duration keepalive_interval = absl::Seconds(1);
  // Further UCX settings, as (name without the "UCX_" prefix, value), applied last, so they
  // override kvstream's own choices (which include MM_SEG_SIZE=64k for shared memory: with
  // UCX's 8 KiB default every block-sized put is cut into many more fragments).
  std::vector<std::pair<std::string, std::string>> ucx_config;
  // Threads that copy writes into peer memory this process can map, in place of UCX puts:
  // over shared memory, memory the peer has from AllocateMemory. A layer's scattered blocks
  // are then copied by this many cores at once, and PostWrite returns without copying
  // anything itself. 0 (the default): UCX puts, copied inside PostWrite by the calling
  // thread. Writes into memory that cannot be mapped (TCP; registered ordinary memory) are
  // puts either way. An idle copy thread polls for about 100 us before it sleeps. At most
  // kMaxCopyThreads; as many as this machine has CPUs or more logs a warning (they then
  // compete with the threads that post and progress). See docs/benchmarks.md for what they
  // gain where cores are free.
  int copy_threads = 0;
  // Staged device path: the size of a chunk (one landing slot), a multiple of 16 in
  // [64 KiB, 256 MiB], and how many slots each sender has in flight to each receiver
  // (2..64). The receiver's values apply to writes into it: it allocates, per sender,
  // staged_slots * staged_chunk_bytes of pinned host memory and as much device staging.
  uint64_t staged_chunk_bytes = uint64_t{4} << 20;
  int staged_slots = 4;
  // How writes from host memory travel (see UcxWriteProtocol). Device writes are staged.
  UcxWriteProtocol write_protocol = UcxWriteProtocol::kAuto;
};

inline constexpr int kMaxCopyThreads = 64;

// Disconnect(peer) also fences the peer off (transport.h): write pieces (UcxWriteProtocol::
// kActiveMessage) and notifications it sends afterwards, or that were still on their way,
// are dropped, until Accept or Connect of that peer again. A consumer that gives a producer
// up disconnects it before reusing the blocks the producer was writing, so that a partition
// that heals later cannot land the producer's queued writes in them. (UCX's emulated puts
// cannot be refused at the target.) Accept creates no endpoint: the peer's entry is the one
// its notifications arrive under.
//
// A transport with its own UCP context and worker. InvalidArgument for an empty tls or
// options out of their ranges; the UCX
// error (naming the UCX call) when UCX cannot start with these options, for example a
// transport name it does not know. UCX's own UCX_* environment variables still apply, under
// the options. Does not block on any peer.
absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const UcxTransportOptions& options);

// Whether writes into `remote` go through the copy threads (its transport has copy threads
// and the region is mapped into this process) rather than UCX puts. For diagnostics and
// tests; false for remote memory of any other transport.
bool UcxWritesAreCopied(const RemoteMemory& remote);

}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_UCX_TRANSPORT_H_
