// Where a peer's memory is mapped into this process, checked against what the kernel says
// (private to transfer/).
//
// Over shared memory a peer's remote key maps its segment into this process (ucp_rkey_ptr)
// and this process writes into it itself: the copy threads' memcpy, UCX's own shared-memory
// puts, the staged path's copies into a landing area. The region's address and length come
// from the peer's descriptor, and UCX's shared-memory key checks neither (ucp_rkey_ptr is an
// offset added to any address). So before a mapped region is used, every byte of it is
// checked against /proc/self/maps: it must lie in one writable shared mapping of one object
// (adjacent entries of the same device, inode and contiguous file offsets count as one), and
// must not overlap this transport's own shared memory. A region that passes cannot make this
// process write outside memory it has mapped for the peer, whatever the descriptor claims.
//
// What this does not cover: a peer's posix shared-memory file that it truncates after this
// process mapped it (an access past the end of a file is SIGBUS; UCX's default sysv segments
// cannot shrink), and a region placed wholly inside another peer's segment mapped here
// (which needs the address this process attached that segment at; it is never sent).
#ifndef KVSTREAM_TRANSFER_SRC_UCX_REMOTE_MAPPING_H_
#define KVSTREAM_TRANSFER_SRC_UCX_REMOTE_MAPPING_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvstream {
namespace internal {

// One line of /proc/<pid>/maps.
struct MappingEntry {
  uintptr_t start = 0;
  uintptr_t end = 0;  // one past the last byte
  bool writable = false;
  bool shared = false;
  uint64_t offset = 0;
  std::string device;  // "major:minor"
  uint64_t inode = 0;
};

// Parses the text of /proc/<pid>/maps. InvalidArgument naming the line for a malformed one
// (fewer than five fields, bad hexadecimal, end not after start).
absl::StatusOr<std::vector<MappingEntry>> ParseMappings(absl::string_view text);

// OK when bytes [first, last] (first <= last) lie in one writable shared mapping of one
// object in `maps` (sorted by address, as the kernel writes them); else InvalidArgument
// saying which byte is outside or where the mapping changes.
absl::Status CheckInOneSharedMapping(const std::vector<MappingEntry>& maps, uintptr_t first,
                                     uintptr_t last);

// A range of this process's own memory [first, first + length).
using OwnRange = std::pair<uintptr_t, size_t>;

// The peer's region [address, address + length) (length >= 1, no overflow: the decoder
// checked) as `rkey` maps it into this process:
//  - null when the key does not map the region's first byte here (no shared-memory key:
//    writes go through UCX, which reaches the peer's memory through the kernel or the
//    network, never by a store of this process);
//  - the mapped address of its first byte when every byte of it maps, consistently
//    (last - first == length - 1), into one writable shared mapping of this process that
//    overlaps none of `own`;
//  - InvalidArgument naming `what` ("ImportRemote: the host region"), `peer` and the sizes otherwise (the peer's descriptor
//    claims memory its key does not give), or Internal when /proc/self/maps cannot be read.
// Reads /proc/self/maps: call it when a region is imported, not per write.
absl::StatusOr<char*> MapRemoteRegion(ucp_rkey_h rkey, uint64_t address, uint64_t length,
                                      const std::vector<OwnRange>& own, absl::string_view what,
                                      absl::string_view peer);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_TRANSFER_SRC_UCX_REMOTE_MAPPING_H_
