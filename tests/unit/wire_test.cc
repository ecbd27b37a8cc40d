// Tests of the control channel's wire format: the byte layout, round trips of every message
// with edge values, every class of decode error, encoder-side bounds, and a deterministic
// mutation test (the in-tree counterpart of the libFuzzer target in tests/fuzz/).
#include "kvstream/transfer/wire.h"

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;

// Builds payloads byte by byte, independently of the encoder under test.
class Bytes {
 public:
  Bytes& U8(uint8_t v) { return Le(v, 1); }
  Bytes& U16(uint16_t v) { return Le(v, 2); }
  Bytes& U32(uint32_t v) { return Le(v, 4); }
  Bytes& U64(uint64_t v) { return Le(v, 8); }
  Bytes& I32(int32_t v) { return Le(static_cast<uint32_t>(v), 4); }
  Bytes& Str(absl::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    data_.append(s.data(), s.size());
    return *this;
  }
  Bytes& Raw(absl::string_view s) {
    data_.append(s.data(), s.size());
    return *this;
  }
  const std::string& str() const { return data_; }

 private:
  Bytes& Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) data_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
  std::string data_;
};

std::string Header(MessageType type, uint32_t payload_len, uint32_t magic = kWireMagic,
                   uint16_t version = kWireVersion) {
  return Bytes().U32(magic).U16(version).U16(static_cast<uint16_t>(type)).U32(payload_len).str();
}

std::string Frame(MessageType type, absl::string_view payload) {
  return Header(type, static_cast<uint32_t>(payload.size())) + std::string(payload);
}

// Every byte value, so that strings are shown to be carried as raw bytes.
std::string Pattern(size_t n, uint8_t seed = 0) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed) & 0xff);
  return s;
}

std::string Encode(const ControlMessage& m) {
  absl::StatusOr<std::string> frame = EncodeFrame(m);
  EXPECT_TRUE(frame.ok()) << frame.status();
  return frame.ok() ? *frame : std::string();
}

// ---- Field-by-field comparison (not via the encoder, which is under test too) ----

void ExpectSameHello(const HelloMsg& a, const HelloMsg& b) {
  EXPECT_EQ(a.engine_id, b.engine_id);
  EXPECT_EQ(a.protocol_version, b.protocol_version);
  EXPECT_EQ(a.compat_hash, b.compat_hash);
  EXPECT_EQ(a.compat_description, b.compat_description);
  EXPECT_EQ(a.transport, b.transport);
  EXPECT_EQ(a.transport_info, b.transport_info);
  ASSERT_EQ(a.regions.size(), b.regions.size());
  for (size_t i = 0; i < a.regions.size(); ++i) {
    EXPECT_EQ(a.regions[i].layer, b.regions[i].layer) << i;
    EXPECT_EQ(a.regions[i].tensor, b.regions[i].tensor) << i;
    EXPECT_EQ(a.regions[i].descriptor, b.regions[i].descriptor) << i;
  }
  EXPECT_EQ(a.nonce, b.nonce);
  EXPECT_EQ(a.auth_tag, b.auth_tag);
}

void ExpectSame(const ControlMessage& a, const ControlMessage& b) {
  ASSERT_EQ(a.index(), b.index());
  if (auto* x = std::get_if<ChallengeMsg>(&a)) {
    EXPECT_EQ(x->nonce, std::get<ChallengeMsg>(b).nonce);
  } else if (auto* h = std::get_if<HelloMsg>(&a)) {
    ExpectSameHello(*h, std::get<HelloMsg>(b));
  } else if (auto* ack = std::get_if<HelloAckMsg>(&a)) {
    const auto& other = std::get<HelloAckMsg>(b);
    ExpectSameHello(ack->hello, other.hello);
    EXPECT_EQ(ack->status_code, other.status_code);
    EXPECT_EQ(ack->message, other.message);
  } else if (auto* req = std::get_if<RequestMsg>(&a)) {
    const auto& other = std::get<RequestMsg>(b);
    EXPECT_EQ(req->request_id, other.request_id);
    EXPECT_EQ(req->prompt_token_ids, other.prompt_token_ids);
    EXPECT_EQ(req->dest_block_ids, other.dest_block_ids);
    EXPECT_EQ(req->num_tokens, other.num_tokens);
  } else if (auto* rack = std::get_if<RequestAckMsg>(&a)) {
    const auto& other = std::get<RequestAckMsg>(b);
    EXPECT_EQ(rack->request_id, other.request_id);
    EXPECT_EQ(rack->status_code, other.status_code);
    EXPECT_EQ(rack->message, other.message);
  } else if (auto* abort = std::get_if<AbortMsg>(&a)) {
    const auto& other = std::get<AbortMsg>(b);
    EXPECT_EQ(abort->request_id, other.request_id);
    EXPECT_EQ(abort->reason, other.reason);
  } else {
    const auto& x_err = std::get<ErrorMsg>(a);
    const auto& y_err = std::get<ErrorMsg>(b);
    EXPECT_EQ(x_err.status_code, y_err.status_code);
    EXPECT_EQ(x_err.message, y_err.message);
  }
}

// ---- Sample messages ----

HelloMsg SmallHello() {
  HelloMsg h;
  h.engine_id = "decode-0";
  h.protocol_version = 3;
  h.compat_hash = 0x0123456789abcdefULL;
  h.compat_description = "NHD bf16 bs16 kv8 h128";
  h.transport = "ucx";
  h.transport_info = Pattern(9);
  RegionDescriptor k;
  k.layer = 0;
  k.tensor = 0;
  k.descriptor = "rk";
  RegionDescriptor v;
  v.layer = 31;
  v.tensor = 1;
  v.descriptor = "";
  h.regions = {k, v};
  h.nonce = Pattern(32, 1);
  h.auth_tag = Pattern(32, 2);
  return h;
}

HelloMsg MaxHello() {
  HelloMsg h;
  h.engine_id = Pattern(kMaxIdBytes, 3);
  h.protocol_version = std::numeric_limits<uint32_t>::max();
  h.compat_hash = std::numeric_limits<uint64_t>::max();
  h.compat_description = Pattern(kMaxMessageBytes, 4);
  h.transport = Pattern(kMaxIdBytes, 5);
  h.transport_info = Pattern(kMaxBlobBytes, 6);
  RegionDescriptor big;
  big.layer = std::numeric_limits<int32_t>::max();
  big.tensor = 1;
  big.descriptor = Pattern(kMaxBlobBytes, 7);
  h.regions = {big, RegionDescriptor()};
  h.nonce = Pattern(32, 8);
  h.auth_tag = Pattern(32, 9);
  return h;
}

// Small messages of every type (truncation and mutation loops are quadratic in size).
std::vector<ControlMessage> SmallSamples() {
  std::vector<ControlMessage> out;
  ChallengeMsg challenge;
  challenge.nonce = Pattern(32);
  out.push_back(challenge);
  out.push_back(SmallHello());
  out.push_back(HelloMsg());  // every field empty or zero
  HelloAckMsg ack;
  ack.hello = SmallHello();
  ack.status_code = 16;
  ack.message = "no";
  out.push_back(ack);
  RequestMsg request;
  request.request_id = "req-7";
  request.prompt_token_ids = {0, 1, std::numeric_limits<int32_t>::max()};
  request.dest_block_ids = {5, 0};
  request.num_tokens = 3;
  out.push_back(request);
  out.push_back(RequestMsg());
  RequestAckMsg request_ack;
  request_ack.request_id = "req-7";
  request_ack.status_code = 9;
  request_ack.message = "later";
  out.push_back(request_ack);
  AbortMsg abort;
  abort.request_id = "req-7";
  abort.reason = std::string("bye\0!", 5);
  out.push_back(abort);
  ErrorMsg error;
  error.status_code = 0;
  out.push_back(error);
  return out;
}

std::vector<ControlMessage> EdgeSamples() {
  std::vector<ControlMessage> out = SmallSamples();
  out.push_back(MaxHello());
  HelloAckMsg ack;
  ack.hello = MaxHello();
  ack.status_code = 0;
  ack.message = Pattern(kMaxMessageBytes);
  out.push_back(ack);
  RequestMsg request;
  request.request_id = Pattern(kMaxIdBytes);
  request.prompt_token_ids.assign(100000, std::numeric_limits<int32_t>::max());
  request.dest_block_ids.assign(6250, 0);
  request.num_tokens = 100000;
  out.push_back(request);
  RequestAckMsg request_ack;
  request_ack.request_id = Pattern(kMaxIdBytes);
  request_ack.status_code = 16;
  request_ack.message = Pattern(kMaxMessageBytes);
  out.push_back(request_ack);
  AbortMsg abort;
  abort.request_id = Pattern(kMaxIdBytes);
  abort.reason = Pattern(kMaxMessageBytes);
  out.push_back(abort);
  ErrorMsg error;
  error.status_code = 16;
  error.message = Pattern(kMaxMessageBytes);
  out.push_back(error);
  return out;
}

void ExpectInvalid(const absl::StatusOr<ControlMessage>& result, absl::string_view needle) {
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_THAT(std::string(result.status().message()), HasSubstr(std::string(needle)));
}

// ---- Layout ----

TEST(WireTest, ErrorFrameHasTheDocumentedLayout) {
  ErrorMsg error;
  error.status_code = 3;
  error.message = "x";
  const std::string expected(
      "KVSC\x01\x00\x07\x00\x09\x00\x00\x00"  // header
      "\x03\x00\x00\x00"                      // status_code
      "\x01\x00\x00\x00x",                    // message
      21);
  EXPECT_EQ(absl::BytesToHexString(Encode(error)), absl::BytesToHexString(expected));
}

TEST(WireTest, RequestFrameHasTheDocumentedLayout) {
  RequestMsg request;
  request.request_id = "r";
  request.prompt_token_ids = {1, 0x01020304};
  request.dest_block_ids = {7};
  request.num_tokens = 2;
  const std::string payload =
      Bytes().Str("r").U32(2).I32(1).I32(0x01020304).U32(1).I32(7).U32(2).str();
  EXPECT_EQ(absl::BytesToHexString(Encode(request)),
            absl::BytesToHexString(Frame(MessageType::kRequest, payload)));
}

TEST(WireTest, HelloFrameHasTheDocumentedLayout) {
  const HelloMsg h = SmallHello();
  const std::string payload = Bytes()
                                  .Str(h.engine_id)
                                  .U32(h.protocol_version)
                                  .U64(h.compat_hash)
                                  .Str(h.compat_description)
                                  .Str(h.transport)
                                  .Str(h.transport_info)
                                  .U32(2)
                                  .I32(0)
                                  .U8(0)
                                  .Str("rk")
                                  .I32(31)
                                  .U8(1)
                                  .Str("")
                                  .Str(h.nonce)
                                  .Str(h.auth_tag)
                                  .str();
  EXPECT_EQ(absl::BytesToHexString(Encode(h)),
            absl::BytesToHexString(Frame(MessageType::kHello, payload)));
}

TEST(WireTest, TypeOfAndNames) {
  const std::vector<ControlMessage> samples = {ChallengeMsg(), HelloMsg(),      HelloAckMsg(),
                                               RequestMsg(),   RequestAckMsg(), AbortMsg(),
                                               ErrorMsg()};
  const std::vector<std::string> names = {"Challenge",  "Hello", "HelloAck", "Request",
                                          "RequestAck", "Abort", "Error"};
  for (size_t i = 0; i < samples.size(); ++i) {
    EXPECT_EQ(static_cast<uint16_t>(TypeOf(samples[i])), i + 1);
    EXPECT_EQ(MessageTypeName(TypeOf(samples[i])), names[i]);
  }
  EXPECT_EQ(MessageTypeName(static_cast<MessageType>(99)), "Unknown");
}

// ---- Round trips ----

TEST(WireTest, EveryMessageTypeRoundTripsWithEdgeValues) {
  for (const ControlMessage& message : EdgeSamples()) {
    SCOPED_TRACE(std::string(MessageTypeName(TypeOf(message))));
    const std::string frame = Encode(message);
    absl::StatusOr<ControlMessage> decoded = DecodeFrame(frame);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ExpectSame(message, *decoded);

    absl::StatusOr<FrameHeader> header =
        DecodeFrameHeader(absl::string_view(frame).substr(0, kFrameHeaderBytes));
    ASSERT_TRUE(header.ok()) << header.status();
    EXPECT_EQ(header->type, TypeOf(message));
    EXPECT_EQ(header->payload_len, frame.size() - kFrameHeaderBytes);
    absl::StatusOr<ControlMessage> from_payload =
        DecodePayload(header->type, absl::string_view(frame).substr(kFrameHeaderBytes));
    ASSERT_TRUE(from_payload.ok()) << from_payload.status();
    ExpectSame(message, *from_payload);
  }
}

TEST(WireTest, UnsignedFieldsKeepTheirHighBit) {
  // The fields that may legitimately hold any value of their type.
  HelloMsg h;
  h.protocol_version = 0x80000000u;
  h.compat_hash = 0x8000000000000000ULL;
  absl::StatusOr<ControlMessage> decoded = DecodeFrame(Encode(h));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(std::get<HelloMsg>(*decoded).protocol_version, 0x80000000u);
  EXPECT_EQ(std::get<HelloMsg>(*decoded).compat_hash, 0x8000000000000000ULL);
}

// ---- Header errors ----

TEST(WireTest, TruncatedHeaderIsRejected) {
  const std::string frame = Encode(ErrorMsg());
  for (size_t n = 0; n < kFrameHeaderBytes; ++n) {
    SCOPED_TRACE(n);
    ExpectInvalid(DecodeFrame(absl::string_view(frame).substr(0, n)), "truncated frame header");
    EXPECT_FALSE(DecodeFrameHeader(absl::string_view(frame).substr(0, n)).ok());
  }
  // The header decoder takes exactly one header.
  EXPECT_FALSE(DecodeFrameHeader(frame).ok());
}

TEST(WireTest, BadMagicIsRejected) {
  std::string frame = Encode(ErrorMsg());
  frame[0] ^= 0x20;
  ExpectInvalid(DecodeFrame(frame), "magic");
  ExpectInvalid(DecodeFrame(Header(MessageType::kError, 0, 0) + ""), "magic");
  EXPECT_FALSE(DecodeFrameHeader(Header(MessageType::kError, 8, 0x4b565343)).ok());  // byte-swapped
}

TEST(WireTest, UnknownVersionIsRejected) {
  for (uint16_t version : {uint16_t{0}, uint16_t{2}, uint16_t{0xffff}}) {
    SCOPED_TRACE(version);
    absl::StatusOr<FrameHeader> header =
        DecodeFrameHeader(Header(MessageType::kError, 8, kWireMagic, version));
    ASSERT_FALSE(header.ok());
    EXPECT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(header.status().message()), HasSubstr("version"));
    const std::string payload = Bytes().I32(1).Str("").str();
    ExpectInvalid(DecodeFrame(Header(MessageType::kError, 8, kWireMagic, version) + payload),
                  "version");
  }
}

TEST(WireTest, UnknownTypeIsRejected) {
  for (uint16_t type : {uint16_t{0}, uint16_t{8}, uint16_t{0x0100}, uint16_t{0xffff}}) {
    SCOPED_TRACE(type);
    const std::string payload = Bytes().I32(1).Str("").str();
    ExpectInvalid(DecodeFrame(Header(static_cast<MessageType>(type), 8) + payload),
                  "unknown message type");
    EXPECT_FALSE(DecodePayload(static_cast<MessageType>(type), payload).ok());
  }
}

TEST(WireTest, OversizedPayloadLengthIsRejectedFromTheHeaderAlone) {
  for (uint32_t len : {kMaxPayloadBytes + 1, 1u << 30, std::numeric_limits<uint32_t>::max()}) {
    SCOPED_TRACE(len);
    absl::StatusOr<FrameHeader> header = DecodeFrameHeader(Header(MessageType::kHello, len));
    ASSERT_FALSE(header.ok());
    EXPECT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(header.status().message()), HasSubstr("payload_len"));
    ExpectInvalid(DecodeFrame(Header(MessageType::kHello, len)), "payload_len");
  }
  absl::StatusOr<FrameHeader> at_limit =
      DecodeFrameHeader(Header(MessageType::kHello, kMaxPayloadBytes));
  ASSERT_TRUE(at_limit.ok()) << at_limit.status();
  EXPECT_EQ(at_limit->payload_len, kMaxPayloadBytes);
}

// ---- Payload errors ----

TEST(WireTest, TruncationAtEveryByteOfEveryMessageIsRejected) {
  for (const ControlMessage& message : SmallSamples()) {
    SCOPED_TRACE(std::string(MessageTypeName(TypeOf(message))));
    const std::string frame = Encode(message);
    for (size_t n = 0; n < frame.size(); ++n) {
      EXPECT_FALSE(DecodeFrame(absl::string_view(frame).substr(0, n)).ok()) << n;
    }
    // And the payload decoder on its own, for which the length is no help.
    const absl::string_view payload = absl::string_view(frame).substr(kFrameHeaderBytes);
    for (size_t n = 0; n < payload.size(); ++n) {
      absl::StatusOr<ControlMessage> result = DecodePayload(TypeOf(message), payload.substr(0, n));
      ASSERT_FALSE(result.ok()) << n;
      EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << n;
    }
  }
}

TEST(WireTest, TrailingBytesAreRejected) {
  for (const ControlMessage& message : SmallSamples()) {
    SCOPED_TRACE(std::string(MessageTypeName(TypeOf(message))));
    const std::string frame = Encode(message);
    ExpectInvalid(DecodeFrame(frame + "x"), "trailing");
    // Inside the payload: the header covers the extra byte, the message does not.
    const std::string payload = frame.substr(kFrameHeaderBytes) + "x";
    ExpectInvalid(DecodeFrame(Frame(TypeOf(message), payload)), "trailing");
    ExpectInvalid(DecodePayload(TypeOf(message), payload), "trailing");
  }
}

TEST(WireTest, PayloadLengthMismatchIsRejected) {
  const std::string frame = Encode(SmallHello());
  const std::string payload = frame.substr(kFrameHeaderBytes);
  ExpectInvalid(DecodeFrame(Header(MessageType::kHello, payload.size() + 1) + payload),
                "truncated");
  ExpectInvalid(DecodeFrame(Header(MessageType::kHello, payload.size() - 1) + payload), "trailing");
  // A payload of another type's shape.
  EXPECT_FALSE(DecodeFrame(Frame(MessageType::kHello, Bytes().I32(1).Str("x").str())).ok());
}

TEST(WireTest, StringLengthPastTheEndIsRejected) {
  ExpectInvalid(DecodePayload(MessageType::kError, Bytes().I32(1).U32(10).Raw("abc").str()),
                "Error.message");
  ExpectInvalid(DecodePayload(MessageType::kAbort, Bytes().U32(0xffffffff).Raw("abc").str()),
                "Abort.request_id");
  ExpectInvalid(DecodePayload(MessageType::kError, Bytes().I32(1).U32(kMaxMessageBytes).str()),
                "runs past the end");
}

TEST(WireTest, StringOverItsBoundIsRejectedEvenWhenPresent) {
  const std::string too_long_id(kMaxIdBytes + 1, 'e');
  ExpectInvalid(DecodePayload(MessageType::kAbort, Bytes().Str(too_long_id).Str("").str()),
                "Abort.request_id");
  ExpectInvalid(DecodePayload(MessageType::kError,
                              Bytes().I32(1).Str(std::string(kMaxMessageBytes + 1, 'm')).str()),
                "exceeds the limit");
  const std::string hello_prefix = Bytes().Str(std::string(kMaxIdBytes + 1, 'e')).str();
  ExpectInvalid(DecodePayload(MessageType::kHello, hello_prefix), "Hello.engine_id");
  // A blob one byte over its bound.
  const std::string blob(kMaxBlobBytes + 1, 'b');
  const std::string hello =
      Bytes().Str("e").U32(1).U64(2).Str("").Str("ucx").Str(blob).U32(0).Str("").Str("").str();
  ExpectInvalid(DecodePayload(MessageType::kHello, hello), "Hello.transport_info");
}

TEST(WireTest, ListCountPastTheEndIsRejectedBeforeAllocating) {
  // A count the bound allows but the bytes cannot back: must fail without reserving
  // kMaxListEntries elements (under ASan a reserve of that size would still pass, so the
  // test also covers counts near the bound with nothing behind them).
  for (uint32_t count : {uint32_t{3}, uint32_t{1000}, kMaxListEntries}) {
    SCOPED_TRACE(count);
    ExpectInvalid(
        DecodePayload(MessageType::kRequest, Bytes().Str("r").U32(count).I32(1).I32(2).str()),
        "Request.prompt_token_ids count");
    ExpectInvalid(DecodePayload(MessageType::kRequest,
                                Bytes().Str("r").U32(0).U32(count).I32(1).U32(0).str()),
                  "Request.dest_block_ids count");
    ExpectInvalid(DecodePayload(MessageType::kHello, Bytes()
                                                         .Str("e")
                                                         .U32(1)
                                                         .U64(2)
                                                         .Str("")
                                                         .Str("")
                                                         .Str("")
                                                         .U32(count)
                                                         .Raw(std::string(17, '\0'))
                                                         .str()),
                  "Hello.regions count");
  }
}

TEST(WireTest, ListCountOverTheLimitIsRejected) {
  for (uint32_t count : {kMaxListEntries + 1, std::numeric_limits<uint32_t>::max()}) {
    SCOPED_TRACE(count);
    ExpectInvalid(DecodePayload(MessageType::kRequest, Bytes().Str("r").U32(count).str()),
                  "exceeds the limit");
    ExpectInvalid(
        DecodePayload(MessageType::kHello,
                      Bytes().Str("").U32(0).U64(0).Str("").Str("").Str("").U32(count).str()),
        "Hello.regions count");
  }
}

std::string HelloWithRegion(int32_t layer, uint8_t tensor) {
  return Bytes()
      .Str("e")
      .U32(1)
      .U64(2)
      .Str("")
      .Str("ucx")
      .Str("")
      .U32(1)
      .I32(layer)
      .U8(tensor)
      .Str("d")
      .Str("")
      .Str("")
      .str();
}

TEST(WireTest, OutOfRangeValuesAreRejected) {
  ASSERT_TRUE(DecodePayload(MessageType::kHello, HelloWithRegion(3, 1)).ok());
  ExpectInvalid(DecodePayload(MessageType::kHello, HelloWithRegion(3, 2)), "tensor");
  ExpectInvalid(DecodePayload(MessageType::kHello, HelloWithRegion(3, 255)), "tensor");
  ExpectInvalid(DecodePayload(MessageType::kHello, HelloWithRegion(-1, 0)), "layer");

  for (int32_t code :
       {-1, 17, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()}) {
    SCOPED_TRACE(code);
    ExpectInvalid(DecodePayload(MessageType::kError, Bytes().I32(code).Str("").str()),
                  "Error.status_code");
    ExpectInvalid(DecodePayload(MessageType::kRequestAck, Bytes().Str("r").I32(code).Str("").str()),
                  "RequestAck.status_code");
    const std::string hello = Encode(HelloMsg()).substr(kFrameHeaderBytes);
    ExpectInvalid(DecodePayload(MessageType::kHelloAck, hello + Bytes().I32(code).Str("").str()),
                  "HelloAck.status_code");
  }
  // Negative indices and a prefix longer than the prompt.
  ExpectInvalid(
      DecodePayload(MessageType::kRequest, Bytes().Str("r").U32(1).I32(-5).U32(0).U32(0).str()),
      "prompt_token_ids[0]");
  ExpectInvalid(DecodePayload(MessageType::kRequest,
                              Bytes().Str("r").U32(1).I32(5).U32(2).I32(0).I32(-1).U32(1).str()),
                "dest_block_ids[1]");
  ExpectInvalid(
      DecodePayload(MessageType::kRequest, Bytes().Str("r").U32(1).I32(5).U32(0).U32(2).str()),
      "num_tokens");
}

TEST(WireTest, NonceAndAuthTagMustBeEmptyOr32Bytes) {
  auto hello = [](absl::string_view nonce, absl::string_view tag) {
    return Bytes().Str("e").U32(1).U64(2).Str("").Str("").Str("").U32(0).Str(nonce).Str(tag).str();
  };
  EXPECT_TRUE(DecodePayload(MessageType::kHello, hello("", "")).ok());
  EXPECT_TRUE(DecodePayload(MessageType::kHello, hello(Pattern(32), Pattern(32))).ok());
  ExpectInvalid(DecodePayload(MessageType::kHello, hello(Pattern(31), "")), "Hello.nonce");
  ExpectInvalid(DecodePayload(MessageType::kHello, hello(Pattern(33), "")), "Hello.nonce");
  ExpectInvalid(DecodePayload(MessageType::kHello, hello(Pattern(1), "")), "Hello.nonce");
  ExpectInvalid(DecodePayload(MessageType::kHello, hello("", Pattern(1))), "Hello.auth_tag");
  ExpectInvalid(DecodePayload(MessageType::kHello, hello("", Pattern(31))), "Hello.auth_tag");
  ExpectInvalid(DecodePayload(MessageType::kHello, hello("", Pattern(64))), "Hello.auth_tag");
  // A challenge always carries a nonce.
  EXPECT_TRUE(DecodePayload(MessageType::kChallenge, Bytes().Str(Pattern(32)).str()).ok());
  ExpectInvalid(DecodePayload(MessageType::kChallenge, Bytes().Str("").str()), "Challenge.nonce");
  ExpectInvalid(DecodePayload(MessageType::kChallenge, Bytes().Str(Pattern(31)).str()),
                "Challenge.nonce");
}

// ---- Encoder bounds: whatever we send, the peer accepts ----

void ExpectEncodeInvalid(const ControlMessage& message, absl::string_view needle) {
  absl::StatusOr<std::string> frame = EncodeFrame(message);
  ASSERT_FALSE(frame.ok());
  EXPECT_EQ(frame.status().code(), absl::StatusCode::kInvalidArgument) << frame.status();
  EXPECT_THAT(std::string(frame.status().message()), HasSubstr(std::string(needle)));
}

TEST(WireTest, EncoderEnforcesTheSameBounds) {
  HelloMsg h = SmallHello();
  h.engine_id.assign(kMaxIdBytes + 1, 'e');
  ExpectEncodeInvalid(h, "Hello.engine_id");
  h = SmallHello();
  h.compat_description.assign(kMaxMessageBytes + 1, 'c');
  ExpectEncodeInvalid(h, "Hello.compat_description");
  h = SmallHello();
  h.transport_info.assign(kMaxBlobBytes + 1, 't');
  ExpectEncodeInvalid(h, "Hello.transport_info");
  h = SmallHello();
  h.regions[1].tensor = 2;
  ExpectEncodeInvalid(h, "tensor");
  h = SmallHello();
  h.regions[0].layer = -3;
  ExpectEncodeInvalid(h, "layer");
  h = SmallHello();
  h.nonce = "short";
  ExpectEncodeInvalid(h, "Hello.nonce");
  h = SmallHello();
  h.auth_tag.assign(33, 'a');
  ExpectEncodeInvalid(h, "Hello.auth_tag");

  ChallengeMsg challenge;
  ExpectEncodeInvalid(challenge, "Challenge.nonce");
  ErrorMsg error;
  error.status_code = 17;
  ExpectEncodeInvalid(error, "Error.status_code");
  error.status_code = -1;
  ExpectEncodeInvalid(error, "Error.status_code");
  RequestAckMsg request_ack;
  request_ack.status_code = 99;
  ExpectEncodeInvalid(request_ack, "RequestAck.status_code");
  HelloAckMsg ack;
  ack.status_code = 17;
  ExpectEncodeInvalid(ack, "HelloAck.status_code");
  AbortMsg abort;
  abort.reason.assign(kMaxMessageBytes + 1, 'r');
  ExpectEncodeInvalid(abort, "Abort.reason");

  RequestMsg request;
  request.num_tokens = 1;
  ExpectEncodeInvalid(request, "num_tokens");
  request.num_tokens = 0;
  request.dest_block_ids = {-1};
  ExpectEncodeInvalid(request, "dest_block_ids");
}

TEST(WireTest, EncoderRejectsTooManyEntriesAndTooLargePayloads) {
  RequestMsg request;
  request.prompt_token_ids.assign(kMaxListEntries + 1, 0);
  ExpectEncodeInvalid(request, "Request.prompt_token_ids");

  // Each field within its bound, the whole over kMaxPayloadBytes.
  HelloMsg h;
  RegionDescriptor region;
  region.descriptor.assign(kMaxBlobBytes, 'd');
  h.regions.assign(kMaxPayloadBytes / kMaxBlobBytes + 1, region);
  ExpectEncodeInvalid(h, "payload");
}

// ---- Deterministic mutation test ----

// Values that sit on the boundaries the decoder checks.
constexpr uint32_t kInterestingU32[] = {0,
                                        1,
                                        16,
                                        17,
                                        31,
                                        32,
                                        33,
                                        0x7fffffff,
                                        0x80000000,
                                        0xffffffff,
                                        kMaxIdBytes + 1,
                                        kMaxMessageBytes + 1,
                                        kMaxBlobBytes,
                                        kMaxListEntries,
                                        kMaxListEntries + 1,
                                        kMaxPayloadBytes,
                                        kMaxPayloadBytes + 1};

std::string Mutate(std::string frame, std::mt19937& rng) {
  const int mutations = 1 + static_cast<int>(rng() % 4);
  for (int m = 0; m < mutations; ++m) {
    const size_t size = frame.size();
    switch (rng() % 6) {
      case 0:  // flip one bit
        if (size > 0) frame[rng() % size] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1:  // overwrite one byte
        if (size > 0) frame[rng() % size] = static_cast<char>(rng() & 0xff);
        break;
      case 2:  // insert one byte
        frame.insert(frame.begin() + static_cast<std::ptrdiff_t>(rng() % (size + 1)),
                     static_cast<char>(rng() & 0xff));
        break;
      case 3:  // delete one byte
        if (size > 0) frame.erase(rng() % size, 1);
        break;
      case 4: {  // overwrite a (possibly unaligned) u32 with a boundary value
        if (size >= 4) {
          const uint32_t v = kInterestingU32[rng() % (sizeof(kInterestingU32) / sizeof(uint32_t))];
          const size_t at = rng() % (size - 3);
          for (int i = 0; i < 4; ++i) frame[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
        }
        break;
      }
      default:  // truncate
        frame.resize(rng() % (size + 1));
        break;
    }
  }
  // Half the time, make the header's length agree, so that the payload decoder (not just
  // the length check) sees the damage.
  if (frame.size() >= kFrameHeaderBytes && rng() % 2 == 0) {
    const uint32_t len = static_cast<uint32_t>(frame.size() - kFrameHeaderBytes);
    for (int i = 0; i < 4; ++i) frame[8 + i] = static_cast<char>((len >> (8 * i)) & 0xff);
  }
  return frame;
}

TEST(WireMutationTest, MutatedFramesDecodeToAValueOrAnErrorNeverACrash) {
  std::vector<std::string> corpus;
  for (const ControlMessage& m : SmallSamples()) corpus.push_back(Encode(m));
  std::mt19937 rng(0x6b767363);  // fixed seed: every run checks the same inputs
  int accepted = 0;
  int rejected = 0;
  constexpr int kIterations = 30000;
  for (int iter = 0; iter < kIterations; ++iter) {
    const std::string input = Mutate(corpus[rng() % corpus.size()], rng);
    absl::StatusOr<ControlMessage> decoded = DecodeFrame(input);
    if (decoded.ok()) {
      ++accepted;
      // Strict decoding accepts exactly the encoder's image: re-encoding gives the input.
      absl::StatusOr<std::string> again = EncodeFrame(*decoded);
      ASSERT_TRUE(again.ok()) << again.status() << " input " << absl::BytesToHexString(input);
      ASSERT_EQ(absl::BytesToHexString(*again), absl::BytesToHexString(input));
    } else {
      ++rejected;
      ASSERT_TRUE(decoded.status().code() == absl::StatusCode::kInvalidArgument ||
                  decoded.status().code() == absl::StatusCode::kOutOfRange)
          << decoded.status() << " input " << absl::BytesToHexString(input);
    }
    // The payload decoder under every type, so one type's bytes are tried as another's.
    if (input.size() >= kFrameHeaderBytes) {
      const absl::string_view payload = absl::string_view(input).substr(kFrameHeaderBytes);
      const MessageType type = static_cast<MessageType>(1 + rng() % 7);
      absl::StatusOr<ControlMessage> as_type = DecodePayload(type, payload);
      if (as_type.ok()) {
        absl::StatusOr<std::string> again = EncodeFrame(*as_type);
        ASSERT_TRUE(again.ok()) << again.status();
        ASSERT_EQ(absl::BytesToHexString(again->substr(kFrameHeaderBytes)),
                  absl::BytesToHexString(payload));
      }
    }
  }
  RecordProperty("accepted", accepted);
  RecordProperty("rejected", rejected);
  // Both paths must have been exercised, or the mutations are not doing their job.
  EXPECT_GT(accepted, kIterations / 100);
  EXPECT_GT(rejected, kIterations / 2);
}

}  // namespace
}  // namespace kvstream
