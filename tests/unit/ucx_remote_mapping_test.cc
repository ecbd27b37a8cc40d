// Tests of the check that a peer's mapped memory lies in what this process mapped for it
// (transfer/src/ucx/remote_mapping.h): the /proc/<pid>/maps parser, the one-mapping rule on
// hand-written tables, and, through two UCX transports in this process, descriptors forged
// by re-encoding a real one (a longer length, a shifted address, both ends overflowing the
// segment) refused at import where the key maps the segment here, while the real descriptor
// still imports and takes writes; and writes into a region its owner freed after the import.
#include "transfer/src/ucx/remote_mapping.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstream/transfer/transport.h"
#include "kvstream/transfer/ucx_transport.h"
#include "transfer/src/ucx/ucx_wire.h"

namespace kvstream {
namespace internal {
namespace {

using ::testing::HasSubstr;

constexpr uintptr_t kPage = 4096;

MappingEntry Entry(uintptr_t start, uintptr_t end, const char* perms, uint64_t offset,
                   uint64_t inode, const char* device = "00:01") {
  MappingEntry e;
  e.start = start;
  e.end = end;
  e.writable = perms[1] == 'w';
  e.shared = perms[3] == 's';
  e.offset = offset;
  e.inode = inode;
  e.device = device;
  return e;
}

TEST(ParseMappingsTest, ReadsTheKernelsFormat) {
  const std::string text =
      "55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]\n"
      "7f1c2a000000-7f1c2a100000 rw-s 00000000 00:01 98310                      /SYSV00000000 "
      "(deleted)\n"
      "7f1c2a100000-7f1c2a101000 r--s 00010000 fd:01 1234 /dev/shm/x\n";
  auto maps = ParseMappings(text);
  ASSERT_TRUE(maps.ok()) << maps.status();
  ASSERT_EQ(maps->size(), 3u);
  EXPECT_EQ((*maps)[0].start, 0x55d0c0a00000u);
  EXPECT_EQ((*maps)[0].end, 0x55d0c0a21000u);
  EXPECT_TRUE((*maps)[0].writable);
  EXPECT_FALSE((*maps)[0].shared);
  EXPECT_EQ((*maps)[0].inode, 0u);
  EXPECT_TRUE((*maps)[1].writable && (*maps)[1].shared);
  EXPECT_EQ((*maps)[1].inode, 98310u);
  EXPECT_EQ((*maps)[1].device, "00:01");
  EXPECT_FALSE((*maps)[2].writable);
  EXPECT_EQ((*maps)[2].offset, 0x10000u);
}

TEST(ParseMappingsTest, RejectsMalformedLines) {
  for (const char* line : {"7f00-7f10 rw-s 0 00:01", "7f00 rw-s 0 00:01 1",
                           "7f10-7f00 rw-s 0 00:01 1", "7fzz-7f10 rw-s 0 00:01 1",
                           "7f00-7f10 rw 0 00:01 1", "7f00-7f10 rw-s 0 00:01 x",
                           "11111111111111111-7f10 rw-s 0 00:01 1"}) {
    auto maps = ParseMappings(line);
    EXPECT_EQ(maps.status().code(), absl::StatusCode::kInvalidArgument) << line;
  }
}

TEST(CheckInOneSharedMappingTest, AcceptsOnlyRangesInsideOneSharedWritableMapping) {
  const uintptr_t a = 0x7f0000000000;
  const std::vector<MappingEntry> maps = {
      Entry(a, a + 4 * kPage, "rw-s", 0, 7),
      // The same object continued (a VMA split, e.g. by locking part of it).
      Entry(a + 4 * kPage, a + 8 * kPage, "rw-s", 4 * kPage, 7),
      // Another object right after it.
      Entry(a + 8 * kPage, a + 12 * kPage, "rw-s", 0, 8),
      Entry(a + 12 * kPage, a + 13 * kPage, "rw-p", 0, 0),
      Entry(a + 13 * kPage, a + 14 * kPage, "r--s", 0, 9),
      // A gap, then the same object as before (not adjacent: not a continuation).
      Entry(a + 20 * kPage, a + 24 * kPage, "rw-s", 0, 10),
      Entry(a + 25 * kPage, a + 26 * kPage, "rw-s", 4 * kPage, 10),
  };
  EXPECT_TRUE(CheckInOneSharedMapping(maps, a, a).ok());
  EXPECT_TRUE(CheckInOneSharedMapping(maps, a + 1, a + 4 * kPage - 1).ok());
  EXPECT_TRUE(CheckInOneSharedMapping(maps, a, a + 8 * kPage - 1).ok());
  EXPECT_TRUE(CheckInOneSharedMapping(maps, a + 8 * kPage, a + 12 * kPage - 1).ok());
  // Running into another object, private memory, read-only memory, a gap, or from nothing.
  const std::vector<std::pair<uintptr_t, uintptr_t>> refused = {
      {a, a + 8 * kPage},
      {a + 8 * kPage, a + 12 * kPage},
      {a + 12 * kPage, a + 12 * kPage},
      {a + 13 * kPage, a + 13 * kPage + 1},
      {a + 20 * kPage, a + 25 * kPage},
      {a - 1, a},
      {a + 14 * kPage, a + 15 * kPage},
      {a + 30 * kPage, a + 30 * kPage},
  };
  for (const auto& [first, last] : refused) {
    absl::Status status = CheckInOneSharedMapping(maps, first, last);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
        << absl::StrCat(absl::Hex(first), "-", absl::Hex(last)) << ": " << status;
  }
  EXPECT_EQ(CheckInOneSharedMapping({}, a, a).code(), absl::StatusCode::kInvalidArgument);
}

// Two transports in this process: "p" imports regions of "d" (memory d allocated, which over
// shared memory p maps and writes into itself).
class UcxForgedDescriptorTest : public ::testing::TestWithParam<std::string> {
 protected:
  static constexpr size_t kBytes = 64 * kPage;

  static bool Mapped() { return GetParam() != "tcp"; }

  void SetUp() override {
    UcxTransportOptions options;
    options.tls = GetParam() == "shm_copy" ? "shm" : GetParam();
    if (options.tls == "tcp") options.net_devices = "lo";
    if (GetParam() == "shm_copy") options.copy_threads = 1;
    auto p = CreateUcxTransport(options);
    auto d = CreateUcxTransport(options);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(d.ok()) << d.status();
    p_ = std::move(p).value();
    d_ = std::move(d).value();
    auto region = d_->AllocateMemory(kBytes, MemoryKind::kHost);
    ASSERT_TRUE(region.ok()) << region.status();
    region_ = std::move(region).value();
    src_.assign(kBytes, 'x');
    auto src = p_->RegisterMemory(src_.data(), src_.size(), MemoryKind::kHost);
    ASSERT_TRUE(src.ok()) << src.status();
    src_reg_ = std::move(src).value();
    auto info = d_->LocalInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    auto peer = p_->Connect(*info);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
    auto real = DecodeMemoryDescriptor(region_->descriptor());
    ASSERT_TRUE(real.ok()) << real.status();
    real_ = *real;
  }

  void TearDown() override {
    src_reg_.reset();
    region_.reset();
  }

  std::string Forged(uint64_t address, uint64_t length) const {
    UcxMemoryDescriptor d = real_;
    d.address = address;
    d.length = length;
    return EncodeMemoryDescriptor(d);
  }

  // Writes `length` bytes at `offset` through `remote` and waits for the transfer.
  void WriteThrough(const RemoteMemory& remote, uint64_t offset, uint64_t length) {
    const Segment segment{0, offset, length};
    auto id = p_->PostWrite(peer_, *src_reg_, remote, {segment}, "written");
    ASSERT_TRUE(id.ok()) << id.status();
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    absl::StatusOr<TransferState> state = TransferState::kInProgress;
    while (state.ok() && *state == TransferState::kInProgress) {
      ASSERT_LT(absl::Now(), deadline);
      ASSERT_TRUE(p_->Progress().ok());
      ASSERT_TRUE(d_->Progress().ok());
      state = p_->Test(*id);
    }
    ASSERT_TRUE(state.ok()) << state.status();
    p_->Release(*id);
  }

  std::unique_ptr<Transport> p_, d_;
  std::unique_ptr<MemoryRegistration> region_, src_reg_;
  std::vector<char> src_;
  UcxMemoryDescriptor real_;
  PeerId peer_ = 0;
};

TEST_P(UcxForgedDescriptorTest, ClaimsBeyondTheSegmentAreRefusedWhereItIsMapped) {
  struct Case {
    const char* what;
    uint64_t address, length;
  };
  const Case cases[] = {
      {"four times the length", real_.address, 4 * kBytes},
      {"one byte more", real_.address, kBytes + kPage},
      {"shifted past the end", real_.address + kBytes / 2, kBytes},
      {"starting before it", real_.address - kPage, kBytes},
      {"far away", real_.address + (uint64_t{1} << 40), kPage},
      {"to the top of the address space", real_.address, UINT64_MAX - real_.address},
  };
  for (const Case& c : cases) {
    auto imported = p_->ImportRemote(peer_, Forged(c.address, c.length));
    if (!Mapped()) {
      // Nothing of it is mapped here: writes go through UCX, and this process's own memory
      // is never written on the descriptor's word.
      EXPECT_TRUE(imported.ok()) << c.what << ": " << imported.status();
      if (imported.ok()) {
        EXPECT_FALSE(UcxWritesAreCopied(**imported));
      }
      continue;
    }
    ASSERT_FALSE(imported.ok()) << c.what << ": imported";
    EXPECT_EQ(imported.status().code(), absl::StatusCode::kInvalidArgument) << imported.status();
    EXPECT_THAT(imported.status().message(), HasSubstr(absl::StrCat("peer ", peer_)));
    EXPECT_THAT(imported.status().message(), HasSubstr(absl::StrCat("claims ", c.length)));
  }
  // The real descriptor, and a true sub-range of it, still import and take writes to their
  // last byte.
  auto real = p_->ImportRemote(peer_, region_->descriptor());
  ASSERT_TRUE(real.ok()) << real.status();
  EXPECT_EQ(UcxWritesAreCopied(**real), GetParam() == "shm_copy");
  ASSERT_NO_FATAL_FAILURE(WriteThrough(**real, kBytes - kPage, kPage));
  auto inner = p_->ImportRemote(peer_, Forged(real_.address + kPage, kBytes - 2 * kPage));
  ASSERT_TRUE(inner.ok()) << inner.status();
  ASSERT_NO_FATAL_FAILURE(WriteThrough(**inner, kBytes - 3 * kPage, kPage));
  // Both notifications seen: the bytes before them are in place (over TCP too).
  size_t notes = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (notes < 2) {
    ASSERT_LT(absl::Now(), deadline) << "the notifications never came";
    ASSERT_TRUE(p_->Progress().ok());
    ASSERT_TRUE(d_->Progress().ok());
    notes += d_->PollNotifications().size();
  }
  const char* landed = static_cast<const char*>(region_->base());
  EXPECT_EQ(landed[kBytes - 1], 'x');
  EXPECT_EQ(landed[kBytes - kPage - 1], 'x');
  EXPECT_EQ(landed[kBytes - 3 * kPage - 1], 0);
}

// The peer frees its region after this process imported it (the peer's mistake). Over
// shared memory this process's attachment keeps the segment alive (sysv: the segment is
// destroyed only with its last attachment), so writes still land in memory mapped here and
// end before their deadline, with no harm to this process or the peer. Over TCP the writes
// are write pieces (ucx/am_writes.h), which the receiver drops: the memory is no longer
// registered there (an emulated put would have been placed in the freed memory, and the
// receiver, here this very process, would have taken the fault).
TEST_P(UcxForgedDescriptorTest, WritesIntoARegionThePeerFreedEndWithoutHarmHere) {
  auto imported = p_->ImportRemote(peer_, region_->descriptor());
  ASSERT_TRUE(imported.ok()) << imported.status();
  region_.reset();
  for (uint64_t offset = 0; offset < kBytes; offset += kBytes / 4) {
    const Segment segment{0, offset, kPage};
    auto id = p_->PostWrite(peer_, *src_reg_, **imported, {segment}, "after free");
    ASSERT_TRUE(id.ok()) << id.status();
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    absl::StatusOr<TransferState> state = TransferState::kInProgress;
    while (state.ok() && *state == TransferState::kInProgress) {
      ASSERT_LT(absl::Now(), deadline) << "a write into a freed region never ended";
      ASSERT_TRUE(p_->Progress().ok());
      ASSERT_TRUE(d_->Progress().ok());
      state = p_->Test(*id);
    }
    if (!state.ok()) {
      EXPECT_THAT(state.status().message(), HasSubstr(absl::StrCat("peer ", peer_)));
    }
    p_->Release(*id);
  }
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxForgedDescriptorTest,
                         ::testing::Values("shm", "shm_copy", "tcp"),
                         [](const ::testing::TestParamInfo<std::string>& param) {
                           return param.param;
                         });

}  // namespace
}  // namespace internal
}  // namespace kvstream
