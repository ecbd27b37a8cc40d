// The peer process of the multi-process UCX transport test (ucx_transport_multiprocess_test).
//
//   kvstream_ucx_transport_peer --role=receiver --tls=shm --bytes=N
//                               [--memory=heap|transport|guarded] [--claim-bytes=M]
//     Registers N zeroed bytes (a heap buffer; with --memory=transport memory from
//     Transport::AllocateMemory; with --memory=guarded an mmap'd buffer followed by 3N bytes
//     of inaccessible pages) and writes "INFO <hex worker info>", "DESC <hex descriptor>",
//     "READY" to fd 3. Then progresses and, for each notification: "dump..." -> writes
//     "DUMP <payload> <N>" and the N bytes of its buffer as they are at that moment; "exit"
//     -> writes "BYE" and exits 0; "stall" -> writes "STALLED" and never progresses again
//     (a peer that stops reading, for the test to kill); anything else -> "NOTE <payload>".
//     With --claim-bytes=M the descriptor handed out is forged: the real one re-encoded
//     (ucx/ucx_wire.h) with length M, a hostile peer claiming memory it did not register;
//     the real one follows as "REAL <hex descriptor>" before "READY".
//     "drain" on stdin: progresses until no byte of the buffer has changed for a second
//     (writes that were still on their way, say from a writer that died), then writes
//     "LANDED <number of non-zero bytes in the buffer>" to fd 3.
//
//   kvstream_ucx_transport_peer --role=writer --tls=shm --bytes=N --block=B --count=C --seed=S
//     Reads "INFO <hex>" and "DESC <hex>" lines from stdin, fills N bytes with the seed's
//     pattern, writes C scattered blocks of B bytes into the described region with the
//     notification "written", writes "DONE <status>" to fd 3, then progresses until stdin
//     says "exit" or closes.
//
// Both roles take --copy-threads=N (UcxTransportOptions::copy_threads).
//
// Exits non-zero with a message on stderr on any error. Lives only as long as its parent.
#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvstream/transfer/transport.h"
#include "kvstream/transfer/ucx_transport.h"
#include "tests/integration/ucx_transport_peer.h"
#include "transfer/src/ucx/ucx_wire.h"

namespace kvstream {
namespace test {
namespace {

int Fail(const std::string& message) {
  std::fprintf(stderr, "ucx_transport_peer: %s\n", message.c_str());
  return 1;
}

std::map<std::string, std::string> ParseFlags(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (!absl::ConsumePrefix(&arg, "--")) continue;
    size_t eq = arg.find('=');
    if (eq == absl::string_view::npos) {
      flags[std::string(arg)] = "true";
    } else {
      flags[std::string(arg.substr(0, eq))] = std::string(arg.substr(eq + 1));
    }
  }
  return flags;
}

uint64_t Number(const std::map<std::string, std::string>& flags, const std::string& name) {
  auto it = flags.find(name);
  uint64_t value = 0;
  if (it == flags.end() || !absl::SimpleAtoi(it->second, &value)) {
    std::fprintf(stderr, "ucx_transport_peer: missing or bad --%s\n", name.c_str());
    std::exit(2);
  }
  return value;
}

// True when stdin was closed: the parent is gone or done.
bool StdinClosedOrSays(const std::string& word) {
  pollfd p{0, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  char buffer[256];
  ssize_t n = ::read(0, buffer, sizeof(buffer));
  if (n <= 0) return true;
  return absl::StrContains(absl::string_view(buffer, static_cast<size_t>(n)), word);
}

enum class Command { kNone, kExit, kDrain };

// The receiver's commands on stdin ("exit" or closed stdin, "drain").
Command ReadCommand() {
  pollfd p{0, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return Command::kNone;
  char buffer[256];
  ssize_t n = ::read(0, buffer, sizeof(buffer));
  if (n <= 0) return Command::kExit;
  absl::string_view text(buffer, static_cast<size_t>(n));
  if (absl::StrContains(text, "exit")) return Command::kExit;
  if (absl::StrContains(text, "drain")) return Command::kDrain;
  return Command::kNone;
}

size_t NonZeroBytes(const char* data, size_t bytes) {
  size_t n = 0;
  for (size_t i = 0; i < bytes; ++i) n += data[i] != 0;
  return n;
}

// "drain": progress until the buffer stays the same for a second (at most 30 s).
int Drain(Transport& transport, const char* data, size_t bytes) {
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  size_t landed = NonZeroBytes(data, bytes);
  absl::Time changed = absl::Now();
  while (absl::Now() - changed < absl::Seconds(1) && absl::Now() < give_up) {
    for (int i = 0; i < 100; ++i) {
      absl::Status progress = transport.Progress();
      if (!progress.ok()) return Fail(progress.ToString());
    }
    const size_t now = NonZeroBytes(data, bytes);
    if (now != landed) {
      landed = now;
      changed = absl::Now();
    }
  }
  if (!WriteLine(kPeerOutFd, absl::StrCat("LANDED ", landed)).ok()) {
    return Fail("cannot write to the parent");
  }
  return 0;
}

// `bytes` of zeroed read-write memory followed by 3 * `bytes` of inaccessible pages (never
// unmapped: the process exits).
absl::StatusOr<char*> GuardedBuffer(size_t bytes) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  if (bytes % page != 0) return absl::InvalidArgumentError("--bytes must be whole pages");
  void* p = ::mmap(nullptr, 4 * bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return absl::InternalError("mmap failed");
  if (::mprotect(p, bytes, PROT_READ | PROT_WRITE) != 0) {
    return absl::InternalError("mprotect failed");
  }
  return static_cast<char*>(p);
}

// The registration's descriptor with its length replaced by `claim` (0: unchanged).
absl::StatusOr<std::string> HandedOutDescriptor(const MemoryRegistration& reg, uint64_t claim) {
  if (claim == 0) return reg.descriptor();
  auto decoded = internal::DecodeMemoryDescriptor(reg.descriptor());
  if (!decoded.ok()) return decoded.status();
  decoded->length = claim;
  return internal::EncodeMemoryDescriptor(*decoded);
}

int RunReceiver(Transport& transport, size_t bytes, const std::string& memory, uint64_t claim) {
  std::vector<char> buffer(memory == "heap" ? bytes : 0, 0);
  absl::StatusOr<std::unique_ptr<MemoryRegistration>> reg;
  if (memory == "transport") {
    reg = transport.AllocateMemory(bytes, MemoryKind::kHost);
  } else if (memory == "guarded") {
    auto guarded = GuardedBuffer(bytes);
    if (!guarded.ok()) return Fail(guarded.status().ToString());
    reg = transport.RegisterMemory(*guarded, bytes, MemoryKind::kHost);
  } else {
    reg = transport.RegisterMemory(buffer.data(), buffer.size(), MemoryKind::kHost);
  }
  if (!reg.ok()) return Fail(reg.status().ToString());
  const char* data = static_cast<const char*>((*reg)->base());
  auto info = transport.LocalInfo();
  if (!info.ok()) return Fail(info.status().ToString());
  auto descriptor = HandedOutDescriptor(**reg, claim);
  if (!descriptor.ok()) return Fail(descriptor.status().ToString());
  if (!WriteLine(kPeerOutFd, "INFO " + absl::BytesToHexString(*info)).ok() ||
      !WriteLine(kPeerOutFd, "DESC " + absl::BytesToHexString(*descriptor)).ok() ||
      (claim != 0 &&
       !WriteLine(kPeerOutFd, "REAL " + absl::BytesToHexString((*reg)->descriptor())).ok()) ||
      !WriteLine(kPeerOutFd, "READY").ok()) {
    return Fail("cannot write to the parent");
  }
  while (true) {
    absl::Status progress = transport.Progress();
    if (!progress.ok()) return Fail(progress.ToString());
    for (const Notification& n : transport.PollNotifications()) {
      if (n.payload == "exit") {
        (void)WriteLine(kPeerOutFd, "BYE");
        return 0;
      }
      if (n.payload == "stall") {
        (void)WriteLine(kPeerOutFd, "STALLED");
        while (true) ::pause();  // until the test kills this process
      }
      if (absl::StartsWith(n.payload, "dump")) {
        absl::Status s = WriteLine(kPeerOutFd, absl::StrCat("DUMP ", n.payload, " ", bytes));
        if (s.ok()) s = WriteAll(kPeerOutFd, data, bytes);
        if (!s.ok()) return Fail(s.ToString());
      } else if (!WriteLine(kPeerOutFd, "NOTE " + n.payload).ok()) {
        return Fail("cannot write to the parent");
      }
    }
    switch (ReadCommand()) {
      case Command::kExit:
        return 0;
      case Command::kDrain:
        if (Drain(transport, data, bytes) != 0) return 1;
        break;
      case Command::kNone:
        break;
    }
  }
}

absl::StatusOr<std::string> ReadHexLine(PipeReader& in, absl::string_view tag) {
  auto line = in.ReadLine(absl::Now() + absl::Seconds(60));
  if (!line.ok()) return line.status();
  absl::string_view rest = *line;
  if (!absl::ConsumePrefix(&rest, tag) || !absl::ConsumePrefix(&rest, " ")) {
    return absl::InvalidArgumentError(absl::StrCat("expected ", tag, ", got '", *line, "'"));
  }
  return absl::HexStringToBytes(rest);
}

int RunWriter(Transport& transport, size_t bytes, size_t block, size_t count, uint32_t seed) {
  PipeReader in(0);
  auto info = ReadHexLine(in, "INFO");
  if (!info.ok()) return Fail(info.status().ToString());
  auto descriptor = ReadHexLine(in, "DESC");
  if (!descriptor.ok()) return Fail(descriptor.status().ToString());
  std::vector<char> buffer(bytes);
  FillPattern(buffer.data(), buffer.size(), seed);
  auto reg = transport.RegisterMemory(buffer.data(), buffer.size(), MemoryKind::kHost);
  if (!reg.ok()) return Fail(reg.status().ToString());
  auto peer = transport.Connect(*info);
  if (!peer.ok()) return Fail(peer.status().ToString());
  auto remote = transport.ImportRemote(*peer, *descriptor);
  if (!remote.ok()) return Fail(remote.status().ToString());
  std::vector<Segment> segments = ScatteredSegments(count, block, bytes / block, seed);
  auto id = transport.PostWrite(*peer, **reg, **remote, segments, "written");
  absl::Status result = id.status();
  if (id.ok()) result = WaitForTransfer(transport, *id, absl::Now() + absl::Seconds(60)).status();
  if (!WriteLine(kPeerOutFd, "DONE " + result.ToString()).ok()) {
    return Fail("cannot write to the parent");
  }
  // Keep progressing: the parent may still need this side (e.g. to finish closing).
  while (!StdinClosedOrSays("exit")) {
    absl::Status progress = transport.Progress();
    if (!progress.ok()) return Fail(progress.ToString());
  }
  return result.ok() ? 0 : 1;
}

int Main(int argc, char** argv) {
  std::map<std::string, std::string> flags = ParseFlags(argc, argv);
  UcxTransportOptions options;
  options.tls = flags.count("tls") ? flags["tls"] : "shm";
  if (options.tls == "tcp") options.net_devices = "lo";
  if (flags.count("copy-threads")) {
    options.copy_threads = static_cast<int>(Number(flags, "copy-threads"));
  }
  auto transport = CreateUcxTransport(options);
  if (!transport.ok()) return Fail(transport.status().ToString());
  const size_t bytes = Number(flags, "bytes");
  const std::string memory = flags.count("memory") ? flags["memory"] : "heap";
  if (memory != "heap" && memory != "transport" && memory != "guarded") {
    return Fail("--memory must be heap, transport or guarded");
  }
  const uint64_t claim = flags.count("claim-bytes") ? Number(flags, "claim-bytes") : 0;
  if (flags["role"] == "receiver") return RunReceiver(**transport, bytes, memory, claim);
  if (flags["role"] == "writer") {
    return RunWriter(**transport, bytes, Number(flags, "block"), Number(flags, "count"),
                     static_cast<uint32_t>(Number(flags, "seed")));
  }
  return Fail("--role must be receiver or writer");
}

}  // namespace
}  // namespace test
}  // namespace kvstream

int main(int argc, char** argv) { return kvstream::test::Main(argc, argv); }
