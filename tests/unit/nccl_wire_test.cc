// Tests of the nccl transport's wire formats (transfer/src/nccl/nccl_wire.h): round trips of
// the peer info (which carries the job id), the memory descriptor, the hello (which carries
// the ncclUniqueId, every byte value included), the welcome and the batch header; hostile
// decoding (every truncation, every single-byte corruption, random garbage, wrong magic and
// version, zero fields, counts past their bounds or past the bytes left, lengths that
// overflow, trailing bytes) is InvalidArgument naming what was wrong, never a crash; the
// side connection's frames are told from cuda_ipc's by their magic, and unknown frame types
// are refused.
#include "transfer/src/nccl/nccl_wire.h"

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstream/common/byte_io.h"

namespace kvstream {
namespace internal {
namespace {

using ::testing::HasSubstr;

std::string AllByteValues(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(255 - i % 256);
  return s;
}

NcclPeerInfo SampleInfo() {
  NcclPeerInfo info;
  info.uid = 0xfeedface12345678ULL;
  info.pid = 4242;
  info.job_id = "job-7";
  info.nccl_version = 22809;
  info.device = 1;
  info.device_uuid = AllByteValues(kNcclUuidBytes);
  info.host = "10.0.0.3";
  info.port = 40123;
  return info;
}

NcclHello SampleHello() {
  NcclHello h;
  h.uid = 77;
  h.pid = 99;
  h.job_id = "job-7";
  h.nccl_version = 22809;
  h.device_uuid = std::string(kNcclUuidBytes, '\x11');
  h.unique_id = AllByteValues(kNcclUniqueIdBytes);  // NULs and 0xff included
  return h;
}

NcclBatchHeader SampleBatch() {
  NcclBatchHeader h;
  h.serial = 5;
  h.region_id = 3;
  h.message_pieces = {1, 3};
  h.pieces = {{0, 1 << 20}, {4096, 100}, {9000, 7}, {20000, 33}};
  return h;
}

// Every prefix of `bytes` fails with InvalidArgument mentioning "nccl".
template <typename Decode>
void ExpectEveryTruncationRejected(const std::string& bytes, Decode decode) {
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto got = decode(bytes.substr(0, n));
    ASSERT_FALSE(got.ok()) << "cut to " << n << " of " << bytes.size() << " bytes decoded";
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(got.status().message(), HasSubstr("nccl"));
  }
  auto longer = decode(bytes + "x");
  EXPECT_EQ(longer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(longer.status().message(), HasSubstr("trailing"));
}

// Every single-byte change, and random garbage, decodes or fails cleanly (never crashes);
// failures are InvalidArgument.
template <typename Decode>
void ExpectCorruptionsHandled(const std::string& bytes, Decode decode) {
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int flip : {0x01, 0x80, 0xff}) {
      std::string bad = bytes;
      bad[i] = static_cast<char>(bad[i] ^ flip);
      auto got = decode(bad);
      if (!got.ok()) {
        EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
      }
    }
  }
  std::mt19937 rng(7);
  for (int round = 0; round < 2000; ++round) {
    std::string garbage(rng() % 200, '\0');
    for (char& c : garbage) c = static_cast<char>(rng());
    auto got = decode(garbage);
    if (!got.ok()) {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

TEST(NcclWireTest, PeerInfoRoundTrips) {
  const NcclPeerInfo info = SampleInfo();
  auto back = DecodeNcclPeerInfo(EncodeNcclPeerInfo(info));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->uid, info.uid);
  EXPECT_EQ(back->pid, info.pid);
  EXPECT_EQ(back->job_id, info.job_id);
  EXPECT_EQ(back->nccl_version, info.nccl_version);
  EXPECT_EQ(back->device, info.device);
  EXPECT_EQ(back->device_uuid, info.device_uuid);
  EXPECT_EQ(back->host, info.host);
  EXPECT_EQ(back->port, info.port);
}

TEST(NcclWireTest, PeerInfoHostileInputIsRejected) {
  const std::string bytes = EncodeNcclPeerInfo(SampleInfo());
  ExpectEveryTruncationRejected(bytes, DecodeNcclPeerInfo);
  ExpectCorruptionsHandled(bytes, DecodeNcclPeerInfo);
  NcclPeerInfo zero_uid = SampleInfo();
  zero_uid.uid = 0;
  EXPECT_THAT(DecodeNcclPeerInfo(EncodeNcclPeerInfo(zero_uid)).status().message(),
              HasSubstr("uid is 0"));
  NcclPeerInfo no_port = SampleInfo();
  no_port.port = 0;
  EXPECT_THAT(DecodeNcclPeerInfo(EncodeNcclPeerInfo(no_port)).status().message(),
              HasSubstr("port is 0"));
  NcclPeerInfo nul_host = SampleInfo();
  nul_host.host = std::string("10.0.0.1\0x", 10);
  EXPECT_FALSE(DecodeNcclPeerInfo(EncodeNcclPeerInfo(nul_host)).ok());
  NcclPeerInfo long_job = SampleInfo();
  long_job.job_id = std::string(kMaxNcclJobIdBytes + 1, 'j');
  EXPECT_THAT(DecodeNcclPeerInfo(EncodeNcclPeerInfo(long_job)).status().message(),
              HasSubstr("job id"));
  // Another transport's info (cuda_ipc's magic) is not taken for ours.
  std::string other = bytes;
  other[1] = 'I';
  EXPECT_THAT(DecodeNcclPeerInfo(other).status().message(), HasSubstr("magic"));
  std::string newer = bytes;
  newer[4] = 2;  // version
  EXPECT_THAT(DecodeNcclPeerInfo(newer).status().message(), HasSubstr("version 2"));
}

TEST(NcclWireTest, DescriptorRoundTripsAndRejectsHostileInput) {
  NcclMemoryDescriptor d;
  d.owner_uid = 12;
  d.region_id = 4;
  d.length = uint64_t{3} << 33;
  d.device = 2;
  const std::string bytes = EncodeNcclDescriptor(d);
  auto back = DecodeNcclDescriptor(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->owner_uid, 12u);
  EXPECT_EQ(back->region_id, 4u);
  EXPECT_EQ(back->length, d.length);
  EXPECT_EQ(back->device, 2);
  ExpectEveryTruncationRejected(bytes, DecodeNcclDescriptor);
  ExpectCorruptionsHandled(bytes, DecodeNcclDescriptor);
  for (int field = 0; field < 4; ++field) {
    NcclMemoryDescriptor bad = d;
    if (field == 0) bad.owner_uid = 0;
    if (field == 1) bad.region_id = 0;
    if (field == 2) bad.length = 0;
    if (field == 3) bad.device = -1;
    EXPECT_EQ(DecodeNcclDescriptor(EncodeNcclDescriptor(bad)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << field;
  }
}

TEST(NcclWireTest, HelloCarriesTheUniqueIdByteForByte) {
  const NcclHello h = SampleHello();
  const std::string bytes = EncodeNcclHello(h);
  auto back = DecodeNcclHello(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->unique_id, h.unique_id);
  EXPECT_EQ(back->unique_id.size(), kNcclUniqueIdBytes);
  EXPECT_EQ(back->job_id, "job-7");
  EXPECT_EQ(back->device_uuid, h.device_uuid);
  EXPECT_EQ(back->nccl_version, 22809u);
  ExpectEveryTruncationRejected(bytes, DecodeNcclHello);
  ExpectCorruptionsHandled(bytes, DecodeNcclHello);
  // A job id that claims more bytes than the hello holds.
  std::string lying = bytes;
  lying[12] = '\x7f';  // low byte of the job id's length
  EXPECT_EQ(DecodeNcclHello(lying).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NcclWireTest, WelcomeAndRefusalRoundTrip) {
  NcclWelcome yes;
  yes.ok = true;
  yes.max_staged_bytes = 64 << 20;
  yes.max_pieces = 1000;
  auto back = DecodeNcclWelcome(EncodeNcclWelcome(yes));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->ok);
  EXPECT_EQ(back->max_staged_bytes, yes.max_staged_bytes);
  EXPECT_EQ(back->max_pieces, 1000u);
  ExpectEveryTruncationRejected(EncodeNcclWelcome(yes), DecodeNcclWelcome);
  NcclWelcome no;
  no.reason = "belongs to job 'b'";
  back = DecodeNcclWelcome(EncodeNcclWelcome(no));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->ok);
  EXPECT_EQ(back->reason, no.reason);
  ExpectCorruptionsHandled(EncodeNcclWelcome(no), DecodeNcclWelcome);
  // A long refusal is cut to the limit the decoder takes.
  no.reason = std::string(3 * kMaxNcclReasonBytes, 'r');
  back = DecodeNcclWelcome(EncodeNcclWelcome(no));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->reason.size(), kMaxNcclReasonBytes);
  for (uint32_t pieces : {0u, kMaxNcclPiecesPerBatch + 1}) {
    NcclWelcome bad = yes;
    bad.max_pieces = pieces;
    EXPECT_THAT(DecodeNcclWelcome(EncodeNcclWelcome(bad)).status().message(),
                HasSubstr("max pieces"));
  }
  EXPECT_THAT(DecodeNcclWelcome(std::string(1, '\x02')).status().message(),
              HasSubstr("verdict"));
}

TEST(NcclWireTest, BatchRoundTripsAndRejectsHostileInput) {
  const NcclBatchHeader h = SampleBatch();
  const std::string bytes = EncodeNcclBatch(h);
  auto back = DecodeNcclBatch(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->serial, 5u);
  EXPECT_EQ(back->region_id, 3u);
  EXPECT_EQ(back->message_pieces, h.message_pieces);
  ASSERT_EQ(back->pieces.size(), h.pieces.size());
  for (size_t i = 0; i < h.pieces.size(); ++i) {
    EXPECT_EQ(back->pieces[i].offset, h.pieces[i].offset);
    EXPECT_EQ(back->pieces[i].length, h.pieces[i].length);
  }
  ExpectEveryTruncationRejected(bytes, DecodeNcclBatch);
  ExpectCorruptionsHandled(bytes, DecodeNcclBatch);
}

TEST(NcclWireTest, BatchCountsAndLengthsAreChecked) {
  auto reason = [](const NcclBatchHeader& h) {
    return std::string(DecodeNcclBatch(EncodeNcclBatch(h)).status().message());
  };
  NcclBatchHeader h = SampleBatch();
  h.region_id = 0;
  EXPECT_THAT(reason(h), HasSubstr("region id is 0"));
  h = SampleBatch();
  h.message_pieces = {1, 2};  // names 3 of its 4 pieces
  EXPECT_THAT(reason(h), HasSubstr("pieces"));
  h = SampleBatch();
  h.message_pieces = {0, 4};
  EXPECT_THAT(reason(h), HasSubstr("no piece"));
  h = SampleBatch();
  h.message_pieces.clear();
  h.pieces.clear();
  EXPECT_THAT(reason(h), HasSubstr("no message"));
  h = SampleBatch();
  h.pieces[2].length = 0;
  EXPECT_THAT(reason(h), HasSubstr("empty"));
  h = SampleBatch();
  h.pieces[1].length = std::numeric_limits<uint64_t>::max() - 50;
  h.pieces[2].length = 100;
  EXPECT_THAT(reason(h), HasSubstr("overflows"));
  h = SampleBatch();
  h.message_pieces.assign(kMaxNcclMessagesPerBatch + 1, 1);
  h.pieces.assign(kMaxNcclMessagesPerBatch + 1, NcclRemotePiece{0, 1});
  EXPECT_THAT(reason(h), HasSubstr("exceeds the limit"));
  // A piece count far beyond what the bytes hold is refused before anything is reserved.
  std::string bytes;
  ByteWriter w(&bytes);
  w.U64(0);
  w.U64(1);
  w.U32(1);
  w.U32(kMaxNcclPiecesPerBatch);
  w.U32(kMaxNcclPiecesPerBatch);
  EXPECT_THAT(DecodeNcclBatch(bytes).status().message(), HasSubstr("runs past the end"));
}

TEST(NcclWireTest, SideConnectionFramesAreTheirOwn) {
  std::string stream = EncodeFrame(kNcclFrames, static_cast<uint8_t>(NcclFrameType::kHello),
                                   EncodeNcclHello(SampleHello()));
  stream += EncodeFrame(kNcclFrames, static_cast<uint8_t>(NcclFrameType::kBatch),
                        EncodeNcclBatch(SampleBatch()));
  stream += EncodeFrame(kNcclFrames, static_cast<uint8_t>(NcclFrameType::kBye), "");
  IpcFrameReader reader(kNcclFrames);
  // Byte by byte: frames come out whole and in order.
  std::vector<uint8_t> types;
  for (char c : stream) {
    reader.Append(&c, 1);
    uint8_t type = 0;
    std::string payload;
    auto got = reader.NextFrame(&type, &payload);
    ASSERT_TRUE(got.ok()) << got.status();
    if (*got) types.push_back(type);
  }
  EXPECT_EQ(types, (std::vector<uint8_t>{1, 3, 5}));
  // A cuda_ipc frame is not ours, nor ours cuda_ipc's.
  IpcFrameReader nccl(kNcclFrames);
  const std::string ipc = EncodeIpcFrame(IpcFrameType::kNotification, "x");
  nccl.Append(ipc.data(), ipc.size());
  uint8_t type = 0;
  std::string payload;
  EXPECT_THAT(nccl.NextFrame(&type, &payload).status().message(), HasSubstr("nccl frame"));
  IpcFrameReader cuda_ipc;
  const std::string ours = EncodeFrame(kNcclFrames, 4, "x");
  cuda_ipc.Append(ours.data(), ours.size());
  EXPECT_FALSE(cuda_ipc.NextFrame(&type, &payload).ok());
  // A frame type past the last one is refused.
  IpcFrameReader unknown(kNcclFrames);
  const std::string six = EncodeFrame(kNcclFrames, 6, "");
  unknown.Append(six.data(), six.size());
  EXPECT_THAT(unknown.NextFrame(&type, &payload).status().message(), HasSubstr("type 6"));
}

TEST(NcclWireTest, TheLargestBatchFitsOneFrame) {
  NcclBatchHeader h;
  h.serial = ~uint64_t{0};
  h.region_id = 1;
  h.message_pieces.assign(kMaxNcclMessagesPerBatch, 1);
  h.message_pieces.back() = kMaxNcclPiecesPerBatch - (kMaxNcclMessagesPerBatch - 1);
  h.pieces.assign(kMaxNcclPiecesPerBatch, NcclRemotePiece{1, 1});
  const std::string bytes = EncodeNcclBatch(h);
  EXPECT_LE(bytes.size(), kMaxIpcFramePayloadBytes);
  EXPECT_TRUE(DecodeNcclBatch(bytes).ok());
}

}  // namespace
}  // namespace internal
}  // namespace kvstream
