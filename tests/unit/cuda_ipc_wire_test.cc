// Tests of the cuda_ipc transport's wire formats (transfer/src/cuda_ipc/cuda_ipc_wire.h):
// descriptor and peer info round trips; hostile decoding (every truncation, every single-
// byte corruption, wrong magic and version, lengths and offsets that do not fit, trailing
// bytes) is InvalidArgument and never a crash; frames cut from a stream delivered in
// arbitrary pieces; malformed frame headers.
#include "transfer/src/cuda_ipc/cuda_ipc_wire.h"

#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvstream/common/byte_io.h"

namespace kvstream {
namespace internal {
namespace {

using ::testing::HasSubstr;

CudaIpcMemoryDescriptor SampleDescriptor() {
  CudaIpcMemoryDescriptor d;
  d.owner_uid = 0x1234567890abcdefULL;
  d.device = 3;
  d.device_uuid = std::string(kCudaUuidBytes, '\x5a');
  d.ipc_handle.resize(kCudaIpcHandleBytes);
  for (size_t i = 0; i < d.ipc_handle.size(); ++i) d.ipc_handle[i] = static_cast<char>(i * 7);
  d.allocation_size = 1ull << 30;
  d.offset = 12345;
  d.length = 4096;
  return d;
}

TEST(CudaIpcWireTest, DescriptorRoundTrips) {
  const CudaIpcMemoryDescriptor d = SampleDescriptor();
  auto back = DecodeCudaIpcDescriptor(EncodeCudaIpcDescriptor(d));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->owner_uid, d.owner_uid);
  EXPECT_EQ(back->device, d.device);
  EXPECT_EQ(back->device_uuid, d.device_uuid);
  EXPECT_EQ(back->ipc_handle, d.ipc_handle);
  EXPECT_EQ(back->allocation_size, d.allocation_size);
  EXPECT_EQ(back->offset, d.offset);
  EXPECT_EQ(back->length, d.length);
}

TEST(CudaIpcWireTest, DescriptorTruncationsAndTrailingBytesAreRejected) {
  const std::string bytes = EncodeCudaIpcDescriptor(SampleDescriptor());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto d = DecodeCudaIpcDescriptor(bytes.substr(0, n));
    ASSERT_FALSE(d.ok()) << "a descriptor cut to " << n << " bytes decoded";
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(d.status().message(), HasSubstr("cuda_ipc"));
  }
  auto longer = DecodeCudaIpcDescriptor(bytes + "x");
  EXPECT_EQ(longer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(longer.status().message(), HasSubstr("trailing"));
}

TEST(CudaIpcWireTest, DescriptorFieldsThatDoNotFitAreRejected) {
  struct Case {
    const char* what;
    void (*mutate)(CudaIpcMemoryDescriptor&);
    const char* message;
  };
  const Case cases[] = {
      {"zero length", [](CudaIpcMemoryDescriptor& d) { d.length = 0; }, "length is 0"},
      {"past the allocation",
       [](CudaIpcMemoryDescriptor& d) { d.offset = d.allocation_size - d.length + 1; },
       "outside its allocation"},
      {"offset beyond", [](CudaIpcMemoryDescriptor& d) { d.offset = d.allocation_size + 1; },
       "outside its allocation"},
      {"wrapping sum",
       [](CudaIpcMemoryDescriptor& d) {
         d.offset = 16;
         d.length = ~uint64_t{0} - 8;
       },
       "outside its allocation"},
      {"negative device", [](CudaIpcMemoryDescriptor& d) { d.device = -1; }, "device -1"},
      {"no owner", [](CudaIpcMemoryDescriptor& d) { d.owner_uid = 0; }, "owner uid"},
  };
  for (const Case& c : cases) {
    CudaIpcMemoryDescriptor d = SampleDescriptor();
    c.mutate(d);
    auto back = DecodeCudaIpcDescriptor(EncodeCudaIpcDescriptor(d));
    ASSERT_FALSE(back.ok()) << c.what;
    EXPECT_EQ(back.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(back.status().message(), HasSubstr(c.message)) << c.what;
  }
}

TEST(CudaIpcWireTest, DescriptorMagicAndVersionAreChecked) {
  std::string bytes = EncodeCudaIpcDescriptor(SampleDescriptor());
  std::string bad_magic = bytes;
  bad_magic[0] ^= 1;
  EXPECT_THAT(DecodeCudaIpcDescriptor(bad_magic).status().message(), HasSubstr("magic"));
  std::string bad_version = bytes;
  bad_version[4] = 9;
  auto v = DecodeCudaIpcDescriptor(bad_version);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(v.status().message(), HasSubstr("version 9"));
  // Another transport's descriptor (loopback's text form) is not ours.
  EXPECT_EQ(DecodeCudaIpcDescriptor("kvstream-loopback-mem:1:1:1:64").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Every single-byte change of a valid descriptor either decodes (a field changed within its
// rules) or is InvalidArgument; and random garbage never decodes into a region that does not
// fit its allocation.
TEST(CudaIpcWireTest, DescriptorMutationsNeverCrashOrBreakTheRules) {
  const std::string bytes = EncodeCudaIpcDescriptor(SampleDescriptor());
  std::mt19937 rng(7);
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int k = 0; k < 8; ++k) {
      std::string m = bytes;
      m[i] = static_cast<char>(rng());
      auto d = DecodeCudaIpcDescriptor(m);
      if (d.ok()) {
        EXPECT_GT(d->length, 0u);
        EXPECT_LE(d->offset, d->allocation_size);
        EXPECT_LE(d->length, d->allocation_size - d->offset);
      } else {
        EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
      }
    }
  }
  for (int k = 0; k < 2000; ++k) {
    std::string garbage(rng() % 200, '\0');
    for (char& c : garbage) c = static_cast<char>(rng());
    auto d = DecodeCudaIpcDescriptor(garbage);
    if (!d.ok()) {
      EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

TEST(CudaIpcWireTest, PeerInfoRoundTripsAndRejectsHostileBytes) {
  CudaIpcPeerInfo info;
  info.uid = 42;
  info.pid = 777;
  info.socket_name = "kvstream-cuda-ipc-000000000000002a";
  const std::string bytes = EncodeCudaIpcPeerInfo(info);
  auto back = DecodeCudaIpcPeerInfo(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->uid, 42u);
  EXPECT_EQ(back->pid, 777u);
  EXPECT_EQ(back->socket_name, info.socket_name);
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_EQ(DecodeCudaIpcPeerInfo(bytes.substr(0, n)).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  // A name length beyond what a Unix socket name can be.
  std::string huge;
  ByteWriter w(&huge);
  w.Raw(bytes.substr(0, 4 + 2 + 8 + 4));
  w.U32(100000);
  EXPECT_THAT(DecodeCudaIpcPeerInfo(huge).status().message(), HasSubstr("socket name"));
  CudaIpcPeerInfo empty_name = info;
  empty_name.socket_name.clear();
  EXPECT_EQ(DecodeCudaIpcPeerInfo(EncodeCudaIpcPeerInfo(empty_name)).status().code(),
            absl::StatusCode::kInvalidArgument);
  CudaIpcPeerInfo nul_name = info;
  nul_name.socket_name = std::string("a\0b", 3);
  EXPECT_EQ(DecodeCudaIpcPeerInfo(EncodeCudaIpcPeerInfo(nul_name)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A descriptor is not peer info.
  EXPECT_EQ(DecodeCudaIpcPeerInfo(EncodeCudaIpcDescriptor(SampleDescriptor())).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CudaIpcWireTest, FramesAreCutFromAStreamInAnyPieces) {
  IpcHello hello;
  hello.uid = 99;
  hello.pid = 5;
  std::string stream = EncodeIpcFrame(IpcFrameType::kHello, EncodeIpcHello(hello));
  std::vector<std::string> payloads = {"layer 0", std::string(70000, 'k'), "", "last"};
  for (const std::string& p : payloads) stream += EncodeIpcFrame(IpcFrameType::kNotification, p);
  stream += EncodeIpcFrame(IpcFrameType::kBye, "");
  std::mt19937 rng(3);
  for (int round = 0; round < 20; ++round) {
    IpcFrameReader reader;
    std::vector<std::pair<IpcFrameType, std::string>> frames;
    size_t pos = 0;
    while (pos < stream.size()) {
      const size_t n = std::min<size_t>(stream.size() - pos, 1 + rng() % 5000);
      reader.Append(stream.data() + pos, n);
      pos += n;
      IpcFrameType type;
      std::string payload;
      for (;;) {
        auto got = reader.Next(&type, &payload);
        ASSERT_TRUE(got.ok()) << got.status();
        if (!*got) break;
        frames.emplace_back(type, payload);
      }
    }
    ASSERT_EQ(frames.size(), payloads.size() + 2);
    EXPECT_EQ(frames[0].first, IpcFrameType::kHello);
    auto decoded = DecodeIpcHello(frames[0].second);
    ASSERT_TRUE(decoded.ok());
    EXPECT_EQ(decoded->uid, 99u);
    EXPECT_EQ(decoded->pid, 5u);
    for (size_t i = 0; i < payloads.size(); ++i) {
      EXPECT_EQ(frames[i + 1].first, IpcFrameType::kNotification);
      EXPECT_EQ(frames[i + 1].second, payloads[i]);
    }
    EXPECT_EQ(frames.back().first, IpcFrameType::kBye);
    EXPECT_EQ(reader.buffered(), 0u);
  }
}

TEST(CudaIpcWireTest, MalformedFrameHeadersAreErrors) {
  const std::string good = EncodeIpcFrame(IpcFrameType::kNotification, "abc");
  struct Case {
    size_t index;
    char value;
    const char* message;
  };
  const Case cases[] = {
      {0, 'X', "magic"}, {4, 7, "version 7"}, {5, 0, "type 0"}, {5, 9, "type 9"},
      {6, 1, "reserved 1"},
  };
  for (const Case& c : cases) {
    std::string bad = good;
    bad[c.index] = c.value;
    IpcFrameReader reader;
    reader.Append(bad.data(), bad.size());
    IpcFrameType type;
    std::string payload;
    auto got = reader.Next(&type, &payload);
    ASSERT_FALSE(got.ok()) << c.message;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(got.status().message(), HasSubstr(c.message));
  }
  // A length over the limit is refused from the header alone, before the bytes arrive.
  std::string huge = good.substr(0, 8);
  ByteWriter w(&huge);
  w.U32(kMaxIpcFramePayloadBytes + 1);
  IpcFrameReader reader;
  reader.Append(huge.data(), huge.size());
  IpcFrameType type;
  std::string payload;
  auto got = reader.Next(&type, &payload);
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(got.status().message(), HasSubstr("exceeds the limit"));
  // A hello must be exactly uid and pid, and the uid not zero.
  EXPECT_EQ(DecodeIpcHello("short").status().code(), absl::StatusCode::kInvalidArgument);
  IpcHello zero;
  EXPECT_EQ(DecodeIpcHello(EncodeIpcHello(zero)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeIpcHello(EncodeIpcHello(IpcHello{1, 2}) + "x").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace internal
}  // namespace kvstream
