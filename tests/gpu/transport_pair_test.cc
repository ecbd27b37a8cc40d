// The writer's side of the device transports' two-process GPU tests (transport_pair_test.h).
#include "transport_pair_test.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kvstream/common/cuda_status.h"

namespace kvstream {
namespace test {

absl::Time Deadline() { return absl::Now() + absl::Seconds(60); }

absl::Status CudaOk(cudaError_t e, absl::string_view what) {
  return CudaErrorToStatus(static_cast<int>(e), what);
}

size_t Mismatches(const std::vector<char>& got, const std::vector<char>& want, size_t begin,
                  size_t end) {
  size_t n = 0;
  for (size_t i = begin; i < end; ++i) n += got[i] != want[i];
  return n;
}

void Apply(const std::vector<Segment>& segments, const std::vector<char>& src,
           std::vector<char>& dst) {
  for (const Segment& s : segments) {
    std::memcpy(dst.data() + s.remote_offset, src.data() + s.local_offset, s.length);
  }
}

std::vector<Segment> OddSegments(size_t count, uint64_t area, uint64_t area_bytes,
                                 uint64_t source_begin, uint64_t source_bytes, uint32_t seed) {
  std::mt19937_64 rng(seed);
  const uint64_t slot = area_bytes / count;
  std::vector<Segment> segments;
  for (size_t i = 0; i < count; ++i) {
    Segment s;
    const uint64_t skew = rng() % 17;  // 0..16: misaligned starts, some 16-byte aligned
    s.remote_offset = area + i * slot + skew;
    s.length = i % 50 == 7 ? 0 : 1 + rng() % (slot - skew - 1);
    s.local_offset = source_begin + rng() % (source_bytes - s.length);
    segments.push_back(s);
  }
  std::shuffle(segments.begin(), segments.end(), rng);
  return segments;
}

void TransportPairTest::TearDown() {
  remote_.reset();
  src_.reset();
  child_.reset();
  transport_.reset();
}

void TransportPairTest::Spawn(const std::vector<std::string>& args) {
  auto child = ChildProcess::Spawn(args);
  ASSERT_TRUE(child.ok()) << child.status();
  child_ = std::move(child).value();
}

std::string TransportPairTest::ReadHex(absl::string_view tag) {
  auto line = child_->reader().ReadLine(Deadline());
  EXPECT_TRUE(line.ok()) << line.status();
  if (!line.ok()) return "";
  absl::string_view rest = *line;
  EXPECT_TRUE(absl::ConsumePrefix(&rest, tag) && absl::ConsumePrefix(&rest, " ")) << *line;
  return absl::HexStringToBytes(rest);
}

void TransportPairTest::ReadReceiver(std::string* info) {
  *info = ReadHex("INFO");
  descriptor_ = ReadHex("DESC");
  auto ready = child_->reader().ReadLine(Deadline());
  ASSERT_TRUE(ready.ok()) << ready.status();
  ASSERT_EQ(*ready, "READY");
}

void TransportPairTest::ConnectTo(const std::string& info) {
  auto peer = transport_->Connect(info);
  ASSERT_TRUE(peer.ok()) << peer.status();
  peer_ = *peer;
  auto remote = transport_->ImportRemote(peer_, descriptor_);
  ASSERT_TRUE(remote.ok()) << remote.status();
  remote_ = std::move(remote).value();
}

void TransportPairTest::ConnectToReceiver() {
  std::string info;
  ASSERT_NO_FATAL_FAILURE(ReadReceiver(&info));
  ASSERT_NO_FATAL_FAILURE(ConnectTo(info));
}

absl::StatusOr<std::string> TransportPairTest::ReadLineProgressing() {
  return test::ReadLineProgressing(child_->reader(), *transport_, Deadline());
}

absl::StatusOr<Note> TransportPairTest::ReadNote() {
  auto line = ReadLineProgressing();
  if (!line.ok()) return line.status();
  std::vector<std::string> parts = absl::StrSplit(*line, ' ');
  size_t bytes = 0;
  if (parts.size() != 3 || parts[0] != "NOTE" || !absl::SimpleAtoi(parts[2], &bytes)) {
    return absl::InternalError(absl::StrCat("expected NOTE, got '", *line, "'"));
  }
  Note note;
  note.payload = absl::HexStringToBytes(parts[1]);
  note.snapshot.resize(bytes);
  absl::Status read = child_->reader().ReadExactly(note.snapshot.data(), bytes, Deadline());
  if (!read.ok()) return read;
  return note;
}

void TransportPairTest::MakeSource(const std::vector<char>& host) {
  auto src = transport_->AllocateMemory(host.size(), MemoryKind::kDevice);
  ASSERT_TRUE(src.ok()) << src.status();
  src_ = std::move(src).value();
  ASSERT_TRUE(
      CudaOk(cudaMemcpy(src_->base(), host.data(), host.size(), cudaMemcpyHostToDevice), "upload")
          .ok());
}

void TransportPairTest::SayExitAndReap() {
  auto bye = transport_->PostNotification(peer_, "exit");
  ASSERT_TRUE(bye.ok()) << bye.status();
  auto note = ReadNote();
  ASSERT_TRUE(note.ok()) << note.status();
  EXPECT_EQ(note->payload, "exit");
  auto line = ReadLineProgressing();
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(*line, "BYE");
  auto code = child_->Wait(Deadline());
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

}  // namespace test
}  // namespace kvstream
