// Checks of a peer's mapped memory against this process's mappings (remote_mapping.h).
#include "ucx/remote_mapping.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

// Far more than any process's maps (a line is under 200 bytes).
constexpr size_t kMaxMapsBytes = size_t{256} << 20;

absl::StatusOr<std::string> ReadSelfMaps() {
  const int fd = ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("cannot open /proc/self/maps: ", std::strerror(errno)));
  }
  std::string text;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      return absl::InternalError(
          absl::StrCat("cannot read /proc/self/maps: ", std::strerror(error)));
    }
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    if (text.size() > kMaxMapsBytes) {
      ::close(fd);
      return absl::InternalError(
          absl::StrCat("/proc/self/maps is over ", kMaxMapsBytes, " bytes"));
    }
  }
  ::close(fd);
  return text;
}

bool ParseHex(absl::string_view text, uint64_t* out) {
  return !text.empty() && text.size() <= 16 && absl::SimpleHexAtoi(text, out);
}

std::string Hex(uintptr_t value) { return absl::StrCat("0x", absl::Hex(value)); }

// Whether `next` continues the mapping of `previous`: adjacent, the same object, the file
// offsets contiguous. Anonymous private memory (inode 0) never continues a shared mapping.
bool Continues(const MappingEntry& previous, const MappingEntry& next) {
  return next.start == previous.end && next.inode != 0 && next.inode == previous.inode &&
         next.device == previous.device &&
         next.offset == previous.offset + (previous.end - previous.start);
}

}  // namespace

absl::StatusOr<std::vector<MappingEntry>> ParseMappings(absl::string_view text) {
  std::vector<MappingEntry> entries;
  size_t line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    if (line.empty()) continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    MappingEntry e;
    uint64_t start = 0, end = 0;
    bool ok = fields.size() >= 5 && fields[1].size() >= 4;
    if (ok) {
      const size_t dash = fields[0].find('-');
      ok = dash != absl::string_view::npos && ParseHex(fields[0].substr(0, dash), &start) &&
           ParseHex(fields[0].substr(dash + 1), &end) && end > start &&
           ParseHex(fields[2], &e.offset) && absl::SimpleAtoi(fields[4], &e.inode);
    }
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat("maps line ", line_number, " ('",
                                                     line.substr(0, 120), "') is malformed"));
    }
    e.start = static_cast<uintptr_t>(start);
    e.end = static_cast<uintptr_t>(end);
    e.writable = fields[1][1] == 'w';
    e.shared = fields[1][3] == 's';
    e.device = std::string(fields[3]);
    entries.push_back(std::move(e));
  }
  return entries;
}

absl::Status CheckInOneSharedMapping(const std::vector<MappingEntry>& maps, uintptr_t first,
                                     uintptr_t last) {
  auto it = std::upper_bound(maps.begin(), maps.end(), first,
                             [](uintptr_t a, const MappingEntry& e) { return a < e.end; });
  if (it == maps.end() || it->start > first) {
    return absl::InvalidArgumentError(
        absl::StrCat("its first byte (", Hex(first), ") is not mapped in this process"));
  }
  const MappingEntry* current = &*it;
  while (true) {
    if (!current->writable || !current->shared) {
      return absl::InvalidArgumentError(absl::StrCat(
          "it maps to ", Hex(current->start), "-", Hex(current->end),
          " in this process, which is not a writable shared mapping"));
    }
    if (last < current->end) return absl::OkStatus();
    ++it;
    if (it == maps.end() || !Continues(*current, *it)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "only ", current->end - first, " of its bytes (from ", Hex(first),
          ") lie in the mapping this process has for it, which ends at ", Hex(current->end)));
    }
    current = &*it;
  }
}

absl::StatusOr<char*> MapRemoteRegion(ucp_rkey_h rkey, uint64_t address, uint64_t length,
                                      const std::vector<OwnRange>& own, absl::string_view what,
                                      absl::string_view peer) {
  void* first = nullptr;
  if (ucp_rkey_ptr(rkey, address, &first) != UCS_OK || first == nullptr) return nullptr;
  const auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "UCX ", what, " from ", peer, " claims ", length, " bytes at ",
        Hex(address), ", but ", why, ": refused (the peer's descriptor claims memory its "
        "remote key does not give)"));
  };
  void* last = nullptr;
  const uint64_t last_address = address + (length - 1);
  if (ucp_rkey_ptr(rkey, last_address, &last) != UCS_OK) {
    return refuse(absl::StrCat("its remote key does not map its last byte (",
                               Hex(last_address), ")"));
  }
  const uintptr_t lo = reinterpret_cast<uintptr_t>(first);
  const uintptr_t hi = reinterpret_cast<uintptr_t>(last);
  if (hi < lo || hi - lo != length - 1) {
    return refuse(absl::StrCat("its remote key maps its first and last bytes ", hi - lo,
                               " bytes apart here"));
  }
  for (const OwnRange& range : own) {
    if (range.second != 0 && lo < range.first + range.second && range.first <= hi) {
      return refuse(absl::StrCat("it maps onto this process's own shared memory at ",
                                 Hex(range.first), " (", range.second, " bytes)"));
    }
  }
  ASSIGN_OR_RETURN(std::string text, ReadSelfMaps());
  absl::StatusOr<std::vector<MappingEntry>> maps = ParseMappings(text);
  if (!maps.ok()) {
    return absl::InternalError(absl::StrCat("/proc/self/maps: ", maps.status().message()));
  }
  absl::Status inside = CheckInOneSharedMapping(*maps, lo, hi);
  if (!inside.ok()) return refuse(inside.message());
  return static_cast<char*>(first);
}

}  // namespace internal
}  // namespace kvstream
