// Tests of the connector's byte formats: the step's metadata and the worker's output
// (connector_metadata.h), the control messages (control_messages.h) and the layer notice
// (layer_notice.h). Round trips at the edges, and hostile bytes: truncation at every byte,
// trailing bytes, bad magic/version/kind, counts and lengths past the end, out-of-range
// values, and random mutations, which must decode to a value or an error, never a crash.
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "connector/src/control_messages.h"
#include "connector/src/layer_notice.h"
#include "kvstream/common/byte_io.h"
#include "kvstream/connector/connector_metadata.h"
#include "kvstream/transfer/wire.h"

namespace kvstream {
namespace {

using internal::AbortMsg;
using internal::ChecksumKind;
using internal::ConnectorHello;
using internal::ConnectorMessage;
using internal::HandOffAckMsg;
using internal::HandOffMsg;
using internal::LayerNotice;
using ::testing::HasSubstr;

KvConnectorMetadata SampleMetadata() {
  KvConnectorMetadata m;
  m.loads.push_back({"req-\0x", {0, 7, 2147483647}, {3, 1, 4}, 2, {"10.0.0.7", 65535}});
  m.loads[0].request_id = std::string("req-\0x", 6);  // ids are bytes, NUL included
  m.loads.push_back({"r2", {}, {}, 0, {"", 0}});
  m.waits = {"req-a", ""};
  m.saves.push_back({"s1", {9, 8}, 17});
  m.finished = {"gone"};
  return m;
}

void ExpectSame(const KvConnectorMetadata& a, const KvConnectorMetadata& b) {
  ASSERT_EQ(a.loads.size(), b.loads.size());
  for (size_t i = 0; i < a.loads.size(); ++i) {
    EXPECT_EQ(a.loads[i].request_id, b.loads[i].request_id);
    EXPECT_EQ(a.loads[i].prompt_token_ids, b.loads[i].prompt_token_ids);
    EXPECT_EQ(a.loads[i].block_ids, b.loads[i].block_ids);
    EXPECT_EQ(a.loads[i].num_tokens, b.loads[i].num_tokens);
    EXPECT_EQ(a.loads[i].remote.host, b.loads[i].remote.host);
    EXPECT_EQ(a.loads[i].remote.port, b.loads[i].remote.port);
  }
  EXPECT_EQ(a.waits, b.waits);
  ASSERT_EQ(a.saves.size(), b.saves.size());
  for (size_t i = 0; i < a.saves.size(); ++i) {
    EXPECT_EQ(a.saves[i].request_id, b.saves[i].request_id);
    EXPECT_EQ(a.saves[i].block_ids, b.saves[i].block_ids);
    EXPECT_EQ(a.saves[i].num_tokens, b.saves[i].num_tokens);
  }
  EXPECT_EQ(a.finished, b.finished);
}

KvConnectorOutput SampleOutput() {
  KvConnectorOutput o;
  o.finished_sending = {"a", "b"};
  o.finished_recving = {"c"};
  o.load_errors.push_back({"c", {1, 2}, absl::DeadlineExceededError("layer 3 late")});
  o.incoming.push_back({"in", {5, 6, 7}, 2});
  return o;
}

// Every strict prefix of a valid encoding fails to decode, as does a trailing byte.
template <typename Decode>
void ExpectPrefixesAndTrailingRejected(const std::string& bytes, Decode decode) {
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(decode(bytes.substr(0, n)).ok()) << "prefix of " << n << " bytes";
  }
  EXPECT_FALSE(decode(bytes + "x").ok());
  EXPECT_TRUE(decode(bytes).ok());
}

// Random byte mutations decode to a value or an error; a decoded value re-encodes.
template <typename Decode, typename Encode>
void Mutate(const std::string& bytes, Decode decode, Encode encode, int rounds) {
  std::mt19937 rng(12345);
  int accepted = 0;
  for (int i = 0; i < rounds; ++i) {
    std::string m = bytes;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      const size_t at = rng() % m.size();
      m[at] = static_cast<char>(rng() % 4 == 0 ? 0xff : rng());
    }
    auto decoded = decode(m);
    if (decoded.ok()) {
      ++accepted;
      EXPECT_TRUE(encode(*decoded).ok());
    }
  }
  ::testing::Test::RecordProperty("accepted", accepted);
}

TEST(ConnectorMetadataCodecTest, RoundTripsEdgeValues) {
  const KvConnectorMetadata m = SampleMetadata();
  auto bytes = EncodeConnectorMetadata(m);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto back = DecodeConnectorMetadata(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(m, *back);
  auto again = EncodeConnectorMetadata(*back);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *bytes);  // accepted bytes re-encode to themselves
  auto empty = EncodeConnectorMetadata(KvConnectorMetadata());
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->size(), 4u + 2 + 4 * 4);  // magic, version, four empty lists
}

TEST(ConnectorMetadataCodecTest, HostileBytesAreRejected) {
  auto bytes = EncodeConnectorMetadata(SampleMetadata());
  ASSERT_TRUE(bytes.ok());
  ExpectPrefixesAndTrailingRejected(*bytes, [](absl::string_view b) { return DecodeConnectorMetadata(b); });
  std::string bad_magic = *bytes;
  bad_magic[0] ^= 1;
  EXPECT_THAT(DecodeConnectorMetadata(bad_magic).status().message(), HasSubstr("magic"));
  std::string bad_version = *bytes;
  bad_version[4] = 9;
  EXPECT_THAT(DecodeConnectorMetadata(bad_version).status().message(), HasSubstr("version"));
  // A list count far beyond the bytes present is refused before anything is allocated.
  std::string huge;
  ByteWriter w(&huge);
  w.U32(0x444D564B);
  w.U16(1);
  w.U32(4000000);
  EXPECT_THAT(DecodeConnectorMetadata(huge).status().message(), HasSubstr("runs past the end"));
  Mutate(*bytes, [](absl::string_view b) { return DecodeConnectorMetadata(b); },
         [](const KvConnectorMetadata& m) { return EncodeConnectorMetadata(m); }, 20000);
}

TEST(ConnectorMetadataCodecTest, OutOfRangeValuesAreRefusedBothWays) {
  KvConnectorMetadata m = SampleMetadata();
  m.loads[0].block_ids[1] = -1;
  EXPECT_THAT(EncodeConnectorMetadata(m).status().message(), HasSubstr("loads.block_ids"));
  m = SampleMetadata();
  m.loads[0].remote.port = 70000;
  EXPECT_THAT(EncodeConnectorMetadata(m).status().message(), HasSubstr("port"));
  m = SampleMetadata();
  m.saves[0].num_tokens = -3;
  EXPECT_THAT(EncodeConnectorMetadata(m).status().message(), HasSubstr("saves.num_tokens"));
  m = SampleMetadata();
  m.waits.push_back(std::string(kMaxIdBytes + 1, 'x'));
  EXPECT_FALSE(EncodeConnectorMetadata(m).ok());
  // The decoder refuses a negative block id written by hand.
  std::string b;
  ByteWriter w(&b);
  w.U32(0x444D564B);
  w.U16(1);
  w.U32(1);  // one load
  ASSERT_TRUE(w.Bytes("id", "r", kMaxIdBytes).ok());
  w.U32(0);  // no prompt
  w.U32(1);  // one block
  w.I32(-7);
  w.I32(1);  // num_tokens
  ASSERT_TRUE(w.Bytes("host", "h", 255).ok());
  w.I32(80);
  for (int list = 0; list < 3; ++list) w.U32(0);  // waits, saves, finished
  EXPECT_THAT(DecodeConnectorMetadata(b).status().message(), HasSubstr("-7 is negative"));
}

TEST(ConnectorOutputCodecTest, RoundTripsAndRefusesHostileBytes) {
  const KvConnectorOutput o = SampleOutput();
  auto bytes = EncodeConnectorOutput(o);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto back = DecodeConnectorOutput(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->finished_sending, o.finished_sending);
  EXPECT_EQ(back->finished_recving, o.finished_recving);
  ASSERT_EQ(back->load_errors.size(), 1u);
  EXPECT_EQ(back->load_errors[0].status, o.load_errors[0].status);
  EXPECT_EQ(back->load_errors[0].block_ids, o.load_errors[0].block_ids);
  ASSERT_EQ(back->incoming.size(), 1u);
  EXPECT_EQ(back->incoming[0].prompt_token_ids, o.incoming[0].prompt_token_ids);
  EXPECT_EQ(back->incoming[0].num_tokens, 2);
  ExpectPrefixesAndTrailingRejected(*bytes, [](absl::string_view b) { return DecodeConnectorOutput(b); });
  Mutate(*bytes, [](absl::string_view b) { return DecodeConnectorOutput(b); },
         [](const KvConnectorOutput& x) { return EncodeConnectorOutput(x); }, 20000);
  // A load error must be an error.
  KvConnectorOutput ok_error = o;
  ok_error.load_errors[0].status = absl::OkStatus();
  EXPECT_FALSE(EncodeConnectorOutput(ok_error).ok());
  // Status code 0 (OK) or 17 written by hand is refused; so is a request listed twice.
  for (int32_t code : {0, 17}) {
    std::string b;
    ByteWriter w(&b);
    w.U32(0x4F4D564B);
    w.U16(1);
    w.U32(0);
    w.U32(0);
    w.U32(1);
    ASSERT_TRUE(w.Bytes("id", "r", kMaxIdBytes).ok());
    w.U32(0);
    w.I32(code);
    ASSERT_TRUE(w.Bytes("msg", "m", kMaxMessageBytes).ok());
    w.U32(0);
    EXPECT_THAT(DecodeConnectorOutput(b).status().message(), HasSubstr("status_code"));
  }
  std::string twice;
  ByteWriter w(&twice);
  w.U32(0x4F4D564B);
  w.U16(1);
  w.U32(2);
  ASSERT_TRUE(w.Bytes("id", "same", kMaxIdBytes).ok());
  ASSERT_TRUE(w.Bytes("id", "same", kMaxIdBytes).ok());
  w.U32(0);
  w.U32(0);
  w.U32(0);
  EXPECT_THAT(DecodeConnectorOutput(twice).status().message(), HasSubstr("twice"));
}

TEST(ControlMessagesTest, EveryMessageRoundTrips) {
  HandOffMsg h{"req", {1, 2, 3}, {9, 0}, 3};
  HandOffAckMsg a{"req", 11, "out of range"};
  AbortMsg x{"req", "stop", 0x0123456789abcdefULL};
  for (const ConnectorMessage& m : {ConnectorMessage(h), ConnectorMessage(a), ConnectorMessage(x)}) {
    auto bytes = internal::EncodeConnectorMessage(m);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto back = internal::DecodeConnectorMessage(*bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->index(), m.index());
    EXPECT_EQ(*internal::EncodeConnectorMessage(*back), *bytes);
    ExpectPrefixesAndTrailingRejected(*bytes, [](absl::string_view b) {
      return internal::DecodeConnectorMessage(b);
    });
    Mutate(*bytes, [](absl::string_view b) { return internal::DecodeConnectorMessage(b); },
           [](const ConnectorMessage& c) { return internal::EncodeConnectorMessage(c); }, 5000);
  }
  EXPECT_EQ(std::get<HandOffMsg>(*internal::DecodeConnectorMessage(
                *internal::EncodeConnectorMessage(h)))
                .dest_block_ids,
            h.dest_block_ids);
}

TEST(ControlMessagesTest, ValueRulesHoldBothWays) {
  HandOffMsg too_many{"req", {1, 2}, {0}, 3};  // 3 tokens of a 2-token prompt
  EXPECT_THAT(internal::EncodeConnectorMessage(too_many).status().message(),
              HasSubstr("num_tokens"));
  HandOffMsg negative{"req", {1, -2}, {0}, 1};
  EXPECT_THAT(internal::EncodeConnectorMessage(negative).status().message(),
              HasSubstr("prompt_token_ids[1]"));
  HandOffAckMsg bad_code{"req", 17, ""};
  EXPECT_THAT(internal::EncodeConnectorMessage(bad_code).status().message(),
              HasSubstr("status code"));
  std::string unknown;
  ByteWriter(&unknown).U16(9);
  EXPECT_THAT(internal::DecodeConnectorMessage(unknown).status().message(),
              HasSubstr("unknown connector message kind 9"));
  // A hand-off whose token count exceeds its prompt, written by hand.
  std::string b;
  ByteWriter w(&b);
  w.U16(1);
  ASSERT_TRUE(w.Bytes("id", "r", kMaxIdBytes).ok());
  w.U32(1);
  w.I32(5);
  w.U32(0);
  w.U32(2);
  w.U64(1);  // attempt
  EXPECT_THAT(internal::DecodeConnectorMessage(b).status().message(), HasSubstr("num_tokens"));
}

TEST(ControlMessagesTest, HelloRoundTripsAndRefusesBadRegions) {
  ConnectorHello h;
  h.protocol_version = 1;
  h.compat_hash = 0x8000000000000001ull;
  h.compat_description = "bf16 NHD";
  h.transport = "ucx";
  h.transport_info = std::string("\0\1\2", 3);
  h.group = "decode-0";
  h.regions = {{0, 0, "k0"}, {0, 1, "v0"}, {31, 1, std::string(300, 'd')}};
  auto bytes = internal::EncodeConnectorHello(h);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto back = internal::DecodeConnectorHello(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->compat_hash, h.compat_hash);
  EXPECT_EQ(back->transport_info, h.transport_info);
  EXPECT_EQ(back->group, "decode-0");
  ASSERT_EQ(back->regions.size(), 3u);
  EXPECT_EQ(back->regions[2].layer, 31);
  EXPECT_EQ(back->regions[2].descriptor, h.regions[2].descriptor);
  ExpectPrefixesAndTrailingRejected(*bytes, [](absl::string_view b) { return internal::DecodeConnectorHello(b); });
  Mutate(*bytes, [](absl::string_view b) { return internal::DecodeConnectorHello(b); },
         [](const ConnectorHello& c) { return internal::EncodeConnectorHello(c); }, 10000);
  ConnectorHello bad = h;
  bad.regions[1].tensor = 2;
  EXPECT_THAT(internal::EncodeConnectorHello(bad).status().message(), HasSubstr("tensor"));
  bad = h;
  bad.regions[0].layer = -1;
  EXPECT_THAT(internal::EncodeConnectorHello(bad).status().message(), HasSubstr("negative"));
  EXPECT_THAT(internal::DecodeConnectorHello("not a hello").status().message(), HasSubstr("magic"));
}

TEST(LayerNoticeTest, RoundTripAndTheHeadPlusATailIsTheWholeNotice) {
  LayerNotice n;
  n.request_id = "req-7";
  n.layer = 31;
  n.bytes = 1ull << 40;
  n.checksum_kind = ChecksumKind::kKvsum64;
  n.post_ns = 123456789;
  n.checksum = 0xfedcba9876543210ull;
  auto whole = internal::EncodeLayerNotice(n);
  auto head = internal::EncodeLayerNoticeHead(n);
  ASSERT_TRUE(whole.ok() && head.ok());
  ASSERT_EQ(head->size() + internal::kLayerNoticeChecksumBytes, whole->size());
  std::string tail;
  ByteWriter(&tail).U64(n.checksum);  // what a kernel writes into the notification's tail
  EXPECT_EQ(*head + tail, *whole);
  auto back = internal::DecodeLayerNotice(*whole);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->request_id, n.request_id);
  EXPECT_EQ(back->layer, n.layer);
  EXPECT_EQ(back->bytes, n.bytes);
  EXPECT_EQ(back->checksum_kind, n.checksum_kind);
  EXPECT_EQ(back->post_ns, n.post_ns);
  EXPECT_EQ(back->checksum, n.checksum);
  ExpectPrefixesAndTrailingRejected(*whole, [](absl::string_view b) { return internal::DecodeLayerNotice(b); });
  std::string bad_kind = *whole;
  bad_kind[whole->size() - 17] = 3;  // the checksum kind byte
  EXPECT_THAT(internal::DecodeLayerNotice(bad_kind).status().message(),
              HasSubstr("unknown checksum kind 3"));
  Mutate(*whole, [](absl::string_view b) { return internal::DecodeLayerNotice(b); },
         [](const LayerNotice& x) { return internal::EncodeLayerNotice(x); }, 10000);
}

TEST(StopNoticeTest, RoundTripsDecodesStrictlyAndIsToldFromALayerNotice) {
  internal::StopNotice n{"req-9", 0x8000000000000001ull, "a reason"};
  auto bytes = internal::EncodeStopNotice(n);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_TRUE(internal::IsStopNotice(*bytes));
  auto back = internal::DecodeStopNotice(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->request_id, n.request_id);
  EXPECT_EQ(back->attempt, n.attempt);
  EXPECT_EQ(back->reason, n.reason);
  ExpectPrefixesAndTrailingRejected(*bytes, [](absl::string_view b) { return internal::DecodeStopNotice(b); });
  LayerNotice layer;
  layer.request_id = "req-9";
  auto layer_bytes = internal::EncodeLayerNotice(layer);
  ASSERT_TRUE(layer_bytes.ok());
  EXPECT_FALSE(internal::IsStopNotice(*layer_bytes));
  EXPECT_FALSE(internal::IsStopNotice("KVS"));
  EXPECT_THAT(internal::DecodeStopNotice(*layer_bytes).status().message(), HasSubstr("magic"));
  EXPECT_FALSE(internal::DecodeLayerNotice(*bytes).ok());
  EXPECT_FALSE(internal::EncodeStopNotice({std::string(kMaxIdBytes + 1, 'x'), 1, ""}).ok());
  EXPECT_FALSE(
      internal::EncodeStopNotice({"r", 1, std::string(internal::kMaxStopReasonBytes + 1, 'x')})
          .ok());
  Mutate(*bytes, [](absl::string_view b) { return internal::DecodeStopNotice(b); },
         [](const internal::StopNotice& x) { return internal::EncodeStopNotice(x); }, 10000);
}

}  // namespace
}  // namespace kvstream
