// kvstream_bench_link: KV-layer throughput over one network link between two hosts, through
// kvstream's UCX transport (TCP), beside a plain TCP stream over the same link in the same
// run. It measures what a prefill host can push to a decode host, without the model: the
// link and the transport alone. bench/host_links.sh runs it between simulated hosts
// (launch/sim_hosts.sh) at several tbf rates and prints the table of docs/scale-out.md.
//
//   kvstream_bench_link receive --listen=IP:PORT [--tls=tcp] [--net-devices=eth0]
//   kvstream_bench_link send --connect=IP:PORT [--tls=tcp] [--net-devices=eth0]
//       [--seconds=3] [--layer-mib=16] [--block-kib=64] [--depth=4] [--tcp-seconds=3]
//       [--ucx=NAME=VALUE ...]   (UCX settings without the UCX_ prefix, both sides alike)
//       [--writes=auto|puts|pieces]   (UcxTransportOptions::write_protocol; auto: pieces)
//
// The receiver allocates a 256 MiB pool from the transport, listens on IP:PORT, and serves
// one sender: it sends its transport's address and the pool's descriptor over a control
// connection, then progresses its transport (puts over TCP land only while the target
// progresses) until the sender asks for the plain TCP stream (it then reads a second
// connection to its end and reports the bytes and the time from the first byte to the
// end) or says it is done (it reports the layer notices it received and exits). Both sides
// nap 20 us when a turn of their loop found nothing, as a worker's progress loop does.
// The sender writes layers: each one PostWrite of layer-mib MiB in blocks of block-kib KiB,
// every block its own segment at a random place on both sides (fixed per layer pattern, as
// a paged cache scatters them; nothing can be coalesced), with a notification, up to
// `depth` layers in flight, for `seconds` after one warm-up layer. It prints one line:
//
//   kv_gbps=9.412 kv_layers=140 kv_seconds=3.05 tcp_gbps=9.705 tcp_seconds=3.00 notices=141
//
// kv_gbps is the KV bytes of completed layers over the time from the first post to the last
// completion, in 10^9 bits per second (a UCX put over TCP completes once the target has it;
// write pieces once the notification has left, so what the sockets hold, a few MiB, may
// not have landed yet);
// tcp_gbps is the plain stream as the receiver counted it. Exit status 0, or 1 with the
// error on stderr.
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvstream/common/byte_io.h"
#include "kvstream/common/status_macros.h"
#include "kvstream/transfer/control_channel.h"
#include "kvstream/transfer/socket.h"
#include "kvstream/transfer/transport.h"
#include "kvstream/transfer/ucx_transport.h"

namespace kvstream {
namespace {

constexpr size_t kPoolBytes = size_t{256} << 20;  // receiver; the sender's: one layer x 4
constexpr int kPatterns = 8;                      // distinct block placements, reused
constexpr size_t kTcpChunk = size_t{4} << 20;
// The nap of a LayerwiseConnector's progress loop when nothing happened (layerwise_worker.cc).
constexpr absl::Duration kIdleNap = absl::Microseconds(20);

struct Flags {
  std::string role;
  std::string address;  // IP:PORT
  std::string tls = "tcp";
  std::string net_devices;
  double seconds = 3;
  double tcp_seconds = 3;
  int64_t layer_mib = 16;
  int64_t block_kib = 64;
  int depth = 4;
  std::vector<std::pair<std::string, std::string>> ucx_config;  // --ucx=NAME=VALUE
  UcxWriteProtocol write_protocol = UcxWriteProtocol::kAuto;  // --writes=auto|puts|pieces
};

absl::StatusOr<std::pair<std::string, uint16_t>> SplitAddress(const std::string& a) {
  const size_t colon = a.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(a.substr(colon + 1), &port) ||
      port == 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("'", a, "' is not IP:PORT"));
  }
  return std::make_pair(a.substr(0, colon), static_cast<uint16_t>(port));
}

absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(const Flags& f) {
  UcxTransportOptions o;
  o.tls = f.tls;
  o.net_devices = f.net_devices;
  o.ucx_config = f.ucx_config;
  o.write_protocol = f.write_protocol;
  return CreateUcxTransport(o);
}

absl::Status SendData(ControlConnection& c, std::string payload) {
  return c.Send(DataMsg{std::move(payload)}, absl::Now() + absl::Seconds(30));
}

absl::StatusOr<std::string> ReceiveData(ControlConnection& c, absl::Time deadline) {
  ASSIGN_OR_RETURN(ControlMessage m, c.Receive(deadline));
  auto* data = std::get_if<DataMsg>(&m);
  if (data == nullptr) return absl::InvalidArgumentError("expected a data frame");
  return std::move(data->payload);
}

// ---- receiver ----

// Reads the plain TCP stream of one connection to `listener` to its end: bytes and the
// seconds from the first byte to the end.
absl::StatusOr<std::pair<uint64_t, double>> ReadStream(int listener) {
  ASSIGN_OR_RETURN(AcceptedSocket s, AcceptSocket(listener, absl::Now() + absl::Seconds(30),
                                                  "the stream listener"));
  std::vector<char> buf(kTcpChunk);
  uint64_t bytes = 0;
  absl::Time first = absl::InfinitePast();
  while (true) {
    ASSIGN_OR_RETURN(bool ready, WaitFd(s.fd.get(), POLLIN, absl::Now() + absl::Seconds(30),
                                        "stream recv"));
    if (!ready) return absl::DeadlineExceededError("the stream stalled for 30 s");
    bool eof = false;
    ASSIGN_OR_RETURN(size_t n, RecvSome(s.fd.get(), buf.data(), buf.size(), s.peer, &eof));
    if (n > 0 && bytes == 0) first = absl::Now();
    bytes += n;
    if (eof) break;
  }
  return std::make_pair(bytes, absl::ToDoubleSeconds(absl::Now() - first));
}

absl::Status Receive(const Flags& f) {
  ASSIGN_OR_RETURN(auto addr, SplitAddress(f.address));
  ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, MakeTransport(f));
  ASSIGN_OR_RETURN(std::unique_ptr<MemoryRegistration> pool,
                   t->AllocateMemory(kPoolBytes, MemoryKind::kHost));
  ASSIGN_OR_RETURN(std::unique_ptr<ControlListener> listener,
                   ControlListener::Listen(addr.first, addr.second));
  // The plain stream's listener: the next port.
  ASSIGN_OR_RETURN(ScopedFd stream_listener,
                   ListenTcp(addr.first, static_cast<uint16_t>(addr.second + 1)));
  std::fprintf(stderr, "kvstream_bench_link: receiving on %s\n", f.address.c_str());
  ASSIGN_OR_RETURN(std::unique_ptr<ControlConnection> c,
                   listener->Accept(absl::Now() + absl::Seconds(60)));
  ASSIGN_OR_RETURN(std::string info, t->LocalInfo());
  std::string hello;
  ByteWriter w(&hello);
  RETURN_IF_ERROR(w.Bytes("transport info", info, 1 << 20));
  RETURN_IF_ERROR(w.Bytes("pool descriptor", pool->descriptor(), 1 << 20));
  w.U64(kPoolBytes);
  RETURN_IF_ERROR(SendData(*c, hello));
  uint64_t notices = 0;
  while (true) {
    RETURN_IF_ERROR(t->Progress());
    const size_t arrived = t->PollNotifications().size();
    notices += arrived;
    absl::StatusOr<std::string> cmd = ReceiveData(*c, absl::InfinitePast());
    if (!cmd.ok()) {
      if (!absl::IsDeadlineExceeded(cmd.status())) return cmd.status();
      // As a worker's progress loop does: a nap when nothing arrived, which leaves the CPU
      // to the kernel's network work (on a 2-core machine, to the tbf queue's timers).
      if (arrived == 0) absl::SleepFor(kIdleNap);
      continue;
    }
    if (*cmd == "stream") {
      ASSIGN_OR_RETURN(auto got, ReadStream(stream_listener.get()));
      RETURN_IF_ERROR(SendData(*c, absl::StrCat(got.first, " ", got.second)));
    } else if (*cmd == "done") {
      return SendData(*c, absl::StrCat(notices));
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown command '", *cmd, "'"));
    }
  }
}

// ---- sender ----

struct Layer {
  std::vector<Segment> segments;
};

// Layer patterns: `blocks` blocks each at a random block slot of the sender's and of the
// receiver's pool.
std::vector<Layer> MakePatterns(size_t block, size_t blocks, size_t local_bytes,
                                size_t remote_bytes) {
  std::mt19937_64 rng(12345);
  std::vector<Layer> out(kPatterns);
  for (Layer& l : out) {
    std::vector<uint64_t> local(local_bytes / block), remote(remote_bytes / block);
    for (size_t i = 0; i < local.size(); ++i) local[i] = i;
    for (size_t i = 0; i < remote.size(); ++i) remote[i] = i;
    std::shuffle(local.begin(), local.end(), rng);
    std::shuffle(remote.begin(), remote.end(), rng);
    for (size_t b = 0; b < blocks; ++b) l.segments.push_back({local[b] * block, remote[b] * block, block});
  }
  return out;
}

absl::Status Send(const Flags& f) {
  ASSIGN_OR_RETURN(auto addr, SplitAddress(f.address));
  const size_t block = static_cast<size_t>(f.block_kib) << 10;
  const size_t layer = static_cast<size_t>(f.layer_mib) << 20;
  if (block == 0 || layer % block != 0 || layer > kPoolBytes / 2 || f.depth < 1) {
    return absl::InvalidArgumentError(
        "--layer-mib must be a multiple of --block-kib and at most 128; --depth at least 1");
  }
  // The receiver may still be starting: try for 30 s.
  const absl::Time connect_deadline = absl::Now() + absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<ControlConnection>> connected;
  do {
    connected = ConnectControl(addr.first, addr.second, connect_deadline);
    if (!connected.ok()) absl::SleepFor(absl::Milliseconds(50));
  } while (!connected.ok() && absl::Now() < connect_deadline);
  if (!connected.ok()) return connected.status();
  std::unique_ptr<ControlConnection> c = std::move(*connected);
  ASSIGN_OR_RETURN(std::string hello, ReceiveData(*c, absl::Now() + absl::Seconds(30)));
  ByteReader r(hello);
  std::string info, descriptor;
  uint64_t remote_bytes = 0;
  RETURN_IF_ERROR(r.Bytes("transport info", 1 << 20, &info));
  RETURN_IF_ERROR(r.Bytes("pool descriptor", 1 << 20, &descriptor));
  RETURN_IF_ERROR(r.U64("pool bytes", &remote_bytes));

  ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, MakeTransport(f));
  const size_t local_bytes = 4 * layer;
  ASSIGN_OR_RETURN(std::unique_ptr<MemoryRegistration> local,
                   t->AllocateMemory(local_bytes, MemoryKind::kHost));
  std::memset(local->base(), 0x5a, local_bytes);
  ASSIGN_OR_RETURN(PeerId peer, t->Connect(info));
  ASSIGN_OR_RETURN(std::unique_ptr<RemoteMemory> remote, t->ImportRemote(peer, descriptor));
  const std::vector<Layer> patterns =
      MakePatterns(block, layer / block, local_bytes, std::min<uint64_t>(remote_bytes, kPoolBytes));

  // Warm-up: the connection's handshake and the first layer.
  ASSIGN_OR_RETURN(TransferId warm, t->PostWrite(peer, *local, *remote, patterns[0].segments, "w"));
  ASSIGN_OR_RETURN(TransferState ws, WaitForTransfer(*t, warm, absl::Now() + absl::Seconds(120)));
  (void)ws;
  t->Release(warm);

  std::deque<TransferId> in_flight;
  uint64_t posted = 0, done = 0;
  const absl::Time start = absl::Now();
  const absl::Time stop_posting = start + absl::Seconds(f.seconds);
  absl::Time last_done = start;
  while (!in_flight.empty() || absl::Now() < stop_posting) {
    while (in_flight.size() < static_cast<size_t>(f.depth) && absl::Now() < stop_posting) {
      ASSIGN_OR_RETURN(TransferId id,
                       t->PostWrite(peer, *local, *remote,
                                    patterns[posted % kPatterns].segments, "n"));
      in_flight.push_back(id);
      ++posted;
    }
    RETURN_IF_ERROR(t->Progress());
    // Layers complete in order on one endpoint; test the oldest.
    bool completed = false;
    while (!in_flight.empty()) {
      ASSIGN_OR_RETURN(TransferState s, t->Test(in_flight.front()));
      if (s == TransferState::kInProgress) break;
      t->Release(in_flight.front());
      in_flight.pop_front();
      ++done;
      completed = true;
      last_done = absl::Now();
    }
    if (!completed && in_flight.size() == static_cast<size_t>(f.depth)) {
      absl::SleepFor(kIdleNap);  // as the receiver
    }
    if (absl::Now() > stop_posting + absl::Seconds(120)) {
      return absl::DeadlineExceededError("layers still in flight 120 s after the last post");
    }
  }
  const double kv_seconds = absl::ToDoubleSeconds(last_done - start);
  const double kv_gbps = static_cast<double>(done * layer) * 8 / kv_seconds / 1e9;

  // The plain TCP stream over the same link.
  double tcp_gbps = 0, tcp_seconds = 0;
  if (f.tcp_seconds > 0) {
    RETURN_IF_ERROR(SendData(*c, "stream"));
    ASSIGN_OR_RETURN(ScopedFd s, ConnectTcp(addr.first, static_cast<uint16_t>(addr.second + 1),
                                            absl::Now() + absl::Seconds(30)));
    std::string chunk(kTcpChunk, 'x');
    const absl::Time end = absl::Now() + absl::Seconds(f.tcp_seconds);
    while (absl::Now() < end) {
      RETURN_IF_ERROR(SendAll(s.get(), chunk, absl::Now() + absl::Seconds(30), f.address));
    }
    s.Reset();  // end of stream
    ASSIGN_OR_RETURN(std::string got, ReceiveData(*c, absl::Now() + absl::Seconds(60)));
    uint64_t bytes = 0;
    const size_t space = got.find(' ');
    if (space == std::string::npos || !absl::SimpleAtoi(got.substr(0, space), &bytes) ||
        !absl::SimpleAtod(got.substr(space + 1), &tcp_seconds) || tcp_seconds <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad stream report '", got, "'"));
    }
    tcp_gbps = static_cast<double>(bytes) * 8 / tcp_seconds / 1e9;
  }
  RETURN_IF_ERROR(SendData(*c, "done"));
  ASSIGN_OR_RETURN(std::string notices, ReceiveData(*c, absl::Now() + absl::Seconds(30)));
  std::printf("kv_gbps=%.3f kv_layers=%llu kv_seconds=%.2f tcp_gbps=%.3f tcp_seconds=%.2f "
              "notices=%s layer_mib=%lld block_kib=%lld depth=%d\n",
              kv_gbps, static_cast<unsigned long long>(done), kv_seconds, tcp_gbps, tcp_seconds,
              notices.c_str(), static_cast<long long>(f.layer_mib),
              static_cast<long long>(f.block_kib), f.depth);
  return absl::OkStatus();
}

bool ParseFlag(const std::string& arg, Flags& f) {
  auto value = [&](absl::string_view name, std::string* out) {
    if (!absl::StartsWith(arg, name)) return false;
    *out = arg.substr(name.size());
    return true;
  };
  std::string v;
  if (value("--listen=", &f.address) || value("--connect=", &f.address) ||
      value("--tls=", &f.tls) || value("--net-devices=", &f.net_devices)) {
    return true;
  }
  if (value("--ucx=", &v)) {
    const size_t eq = v.find('=');
    if (eq == std::string::npos || eq == 0) return false;
    f.ucx_config.emplace_back(v.substr(0, eq), v.substr(eq + 1));
    return true;
  }
  if (value("--writes=", &v)) {
    if (v == "auto") {
      f.write_protocol = UcxWriteProtocol::kAuto;
    } else if (v == "puts") {
      f.write_protocol = UcxWriteProtocol::kPut;
    } else if (v == "pieces") {
      f.write_protocol = UcxWriteProtocol::kActiveMessage;
    } else {
      return false;
    }
    return true;
  }
  if (value("--seconds=", &v)) return absl::SimpleAtod(v, &f.seconds);
  if (value("--tcp-seconds=", &v)) return absl::SimpleAtod(v, &f.tcp_seconds);
  if (value("--layer-mib=", &v)) return absl::SimpleAtoi(v, &f.layer_mib);
  if (value("--block-kib=", &v)) return absl::SimpleAtoi(v, &f.block_kib);
  if (value("--depth=", &v)) return absl::SimpleAtoi(v, &f.depth);
  return false;
}

}  // namespace
}  // namespace kvstream

int main(int argc, char** argv) {
  kvstream::Flags f;
  if (argc >= 2) f.role = argv[1];
  bool ok = f.role == "receive" || f.role == "send";
  for (int i = 2; ok && i < argc; ++i) {
    ok = kvstream::ParseFlag(argv[i], f);
    if (!ok) std::fprintf(stderr, "kvstream_bench_link: bad flag %s\n", argv[i]);
  }
  if (!ok || f.address.empty()) {
    std::fprintf(stderr,
                 "usage: %s receive --listen=IP:PORT | send --connect=IP:PORT [--tls=tcp] "
                 "[--net-devices=DEV] [--seconds=S] [--tcp-seconds=S] [--layer-mib=M] "
                 "[--block-kib=K] [--depth=D] [--ucx=NAME=VALUE] [--writes=auto|puts|pieces]\n",
                 argv[0]);
    return 2;
  }
  const absl::Status s = f.role == "receive" ? kvstream::Receive(f) : kvstream::Send(f);
  if (!s.ok()) {
    std::fprintf(stderr, "kvstream_bench_link %s: %s\n", f.role.c_str(), s.ToString().c_str());
    return 1;
  }
  return 0;
}
