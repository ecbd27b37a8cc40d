// Tests of the control channel's wire format (version 3): the byte layout of every frame
// type, round trips of every message with edge values (opaque Hello and Data payloads at
// their bounds, binary bytes included), every class of decode error, encoder-side bounds,
// and a deterministic mutation test (the in-tree counterpart of the libFuzzer target in
// tests/fuzz/). What the opaque payloads hold is the connector's, and tested there.
#include "kvstream/transfer/wire.h"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
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
  EXPECT_EQ(absl::BytesToHexString(a.payload.substr(0, 64)),
            absl::BytesToHexString(b.payload.substr(0, 64)));
  EXPECT_EQ(a.payload.size(), b.payload.size());
  EXPECT_TRUE(a.payload == b.payload);  // the whole payload, without printing 16 MiB
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
  } else if (auto* data = std::get_if<DataMsg>(&a)) {
    const auto& other = std::get<DataMsg>(b);
    EXPECT_EQ(data->payload.size(), other.payload.size());
    EXPECT_TRUE(data->payload == other.payload);
  } else if (auto* intro = std::get_if<IntroMsg>(&a)) {
    const auto& other = std::get<IntroMsg>(b);
    EXPECT_EQ(intro->payload.size(), other.payload.size());
    EXPECT_TRUE(intro->payload == other.payload);
    EXPECT_EQ(intro->auth_tag, other.auth_tag);
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
  // Opaque to the channel: binary bytes, NULs included.
  h.payload = std::string("v3\0NHD\xff", 7) + Pattern(9);
  h.nonce = Pattern(32, 1);
  h.auth_tag = Pattern(32, 2);
  return h;
}

// Every field at its bound.
HelloMsg MaxHello() {
  HelloMsg h;
  h.engine_id = Pattern(kMaxIdBytes, 3);
  h.payload = Pattern(kMaxHelloPayloadBytes, 4);
  h.nonce = Pattern(32, 8);
  h.auth_tag = Pattern(32, 9);
  return h;
}

DataMsg Data(std::string payload) {
  DataMsg d;
  d.payload = std::move(payload);
  return d;
}

IntroMsg Intro(std::string payload) {
  IntroMsg m;
  m.payload = std::move(payload);
  m.auth_tag = Pattern(32, 6);
  return m;
}

// Small messages of every type (truncation and mutation loops are quadratic in size).
std::vector<ControlMessage> SmallSamples() {
  std::vector<ControlMessage> out;
  ChallengeMsg challenge;
  challenge.nonce = Pattern(32);
  out.push_back(challenge);
  out.push_back(SmallHello());
  out.push_back(HelloMsg());  // every field empty
  HelloAckMsg ack;
  ack.hello = SmallHello();
  ack.status_code = 16;
  ack.message = "no";
  out.push_back(ack);
  out.push_back(Data(std::string("\0req\0\x01\x80\xff", 8)));
  out.push_back(Data(""));
  ErrorMsg error;
  error.status_code = 0;
  out.push_back(error);
  out.push_back(Intro(std::string("v3\0NHD\xff", 7)));
  out.push_back(Intro(""));
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
  out.push_back(Data(Pattern(kMaxDataPayloadBytes, 5)));
  out.push_back(Data(std::string(1000, '\0')));  // nothing but NULs
  ErrorMsg error;
  error.status_code = 16;
  error.message = Pattern(kMaxMessageBytes);
  out.push_back(error);
  out.push_back(Intro(Pattern(kMaxHelloPayloadBytes, 7)));
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
      "KVSC\x03\x00\x05\x00\x09\x00\x00\x00"  // header: version 3, type 5, 9 payload bytes
      "\x03\x00\x00\x00"                      // status_code
      "\x01\x00\x00\x00x",                    // message
      21);
  EXPECT_EQ(absl::BytesToHexString(Encode(error)), absl::BytesToHexString(expected));
}

TEST(WireTest, DataFrameHasTheDocumentedLayout) {
  const std::string expected(
      "KVSC\x03\x00\x04\x00\x09\x00\x00\x00"  // header: version 3, type 4, 9 payload bytes
      "\x05\x00\x00\x00"                      // payload length
      "a\0\xff\0b",                           // payload, as it is
      21);
  EXPECT_EQ(absl::BytesToHexString(Encode(Data(std::string("a\0\xff\0b", 5)))),
            absl::BytesToHexString(expected));
  EXPECT_EQ(absl::BytesToHexString(Encode(Data(""))),
            absl::BytesToHexString(Frame(MessageType::kData, Bytes().U32(0).str())));
}

TEST(WireTest, ChallengeFrameHasTheDocumentedLayout) {
  ChallengeMsg challenge;
  challenge.nonce = Pattern(32, 7);
  EXPECT_EQ(
      absl::BytesToHexString(Encode(challenge)),
      absl::BytesToHexString(Frame(MessageType::kChallenge, Bytes().Str(Pattern(32, 7)).str())));
}

TEST(WireTest, HelloFrameHasTheDocumentedLayout) {
  const HelloMsg h = SmallHello();
  const std::string payload =
      Bytes().Str(h.engine_id).Str(h.payload).Str(h.nonce).Str(h.auth_tag).str();
  EXPECT_EQ(absl::BytesToHexString(Encode(h)),
            absl::BytesToHexString(Frame(MessageType::kHello, payload)));
  // Empty fields are a zero length each.
  EXPECT_EQ(absl::BytesToHexString(Encode(HelloMsg())),
            absl::BytesToHexString(
                Frame(MessageType::kHello, Bytes().U32(0).U32(0).U32(0).U32(0).str())));
}

TEST(WireTest, HelloAckFrameHasTheDocumentedLayout) {
  HelloAckMsg ack;
  ack.hello = SmallHello();
  ack.status_code = 9;
  ack.message = "busy";
  const HelloMsg& h = ack.hello;
  const std::string payload = Bytes()
                                  .Str(h.engine_id)
                                  .Str(h.payload)
                                  .Str(h.nonce)
                                  .Str(h.auth_tag)
                                  .I32(9)
                                  .Str("busy")
                                  .str();
  EXPECT_EQ(absl::BytesToHexString(Encode(ack)),
            absl::BytesToHexString(Frame(MessageType::kHelloAck, payload)));
}

TEST(WireTest, IntroFrameHasTheDocumentedLayout) {
  const IntroMsg m = Intro(std::string("desc\0", 5));
  EXPECT_EQ(absl::BytesToHexString(Encode(m)),
            absl::BytesToHexString(
                Frame(MessageType::kIntro, Bytes().Str(m.payload).Str(m.auth_tag).str())));
}

TEST(WireTest, TypeOfAndNames) {
  const std::vector<ControlMessage> samples = {ChallengeMsg(), HelloMsg(), HelloAckMsg(),
                                               DataMsg(),      ErrorMsg(), IntroMsg()};
  const std::vector<std::string> names = {"Challenge", "Hello", "HelloAck",
                                          "Data",      "Error", "Intro"};
  for (size_t i = 0; i < samples.size(); ++i) {
    EXPECT_EQ(static_cast<uint16_t>(TypeOf(samples[i])), i + 1);
    EXPECT_EQ(MessageTypeName(TypeOf(samples[i])), names[i]);
  }
  EXPECT_EQ(static_cast<uint16_t>(MessageType::kData), 4);
  EXPECT_EQ(static_cast<uint16_t>(MessageType::kError), 5);
  EXPECT_EQ(static_cast<uint16_t>(MessageType::kIntro), 6);
  EXPECT_EQ(kWireVersion, 3);
  EXPECT_EQ(MessageTypeName(static_cast<MessageType>(7)), "Unknown");
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

TEST(WireTest, OpaquePayloadsKeepEveryByteValue) {
  // Every byte value, NULs first and last, in both opaque fields.
  std::string all;
  for (int i = 0; i < 256; ++i) all.push_back(static_cast<char>(i));
  const std::string bytes = std::string(3, '\0') + all + all + std::string(2, '\0');
  HelloMsg h;
  h.engine_id = "e";
  h.payload = bytes;
  absl::StatusOr<ControlMessage> hello = DecodeFrame(Encode(h));
  ASSERT_TRUE(hello.ok()) << hello.status();
  EXPECT_EQ(absl::BytesToHexString(std::get<HelloMsg>(*hello).payload),
            absl::BytesToHexString(bytes));
  absl::StatusOr<ControlMessage> data = DecodeFrame(Encode(Data(bytes)));
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(absl::BytesToHexString(std::get<DataMsg>(*data).payload),
            absl::BytesToHexString(bytes));
}

TEST(WireTest, EveryFieldAtItsBoundStillFitsInOneFrame) {
  // The opaque bounds leave room for the other fields: the largest HelloAck and the largest
  // Data message encode, and the Data frame is exactly the payload limit.
  HelloAckMsg ack;
  ack.hello = MaxHello();
  ack.status_code = 16;
  ack.message = Pattern(kMaxMessageBytes);
  absl::StatusOr<std::string> ack_frame = EncodeFrame(ack);
  ASSERT_TRUE(ack_frame.ok()) << ack_frame.status();
  EXPECT_LE(ack_frame->size() - kFrameHeaderBytes, kMaxPayloadBytes);
  absl::StatusOr<std::string> data_frame =
      EncodeFrame(Data(std::string(kMaxDataPayloadBytes, 'd')));
  ASSERT_TRUE(data_frame.ok()) << data_frame.status();
  EXPECT_EQ(data_frame->size(), kFrameHeaderBytes + kMaxPayloadBytes);
  absl::StatusOr<FrameHeader> header =
      DecodeFrameHeader(absl::string_view(*data_frame).substr(0, kFrameHeaderBytes));
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->payload_len, kMaxPayloadBytes);
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
  // Versions 1 and 2 are earlier formats: a peer speaking one must be refused, not misread.
  for (uint16_t version : {uint16_t{0}, uint16_t{1}, uint16_t{2}, uint16_t{4}, uint16_t{0x0300},
                           uint16_t{0xffff}}) {
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
  for (uint16_t type : {uint16_t{0}, uint16_t{7}, uint16_t{8}, uint16_t{0x0100},
                        uint16_t{0xffff}}) {
    SCOPED_TRACE(type);
    const std::string payload = Bytes().I32(1).Str("").str();
    ExpectInvalid(DecodeFrame(Header(static_cast<MessageType>(type), 8) + payload),
                  "unknown message type");
    EXPECT_FALSE(DecodeFrameHeader(Header(static_cast<MessageType>(type), 8)).ok());
    EXPECT_FALSE(DecodePayload(static_cast<MessageType>(type), payload).ok());
  }
}

TEST(WireTest, OversizedPayloadLengthIsRejectedFromTheHeaderAlone) {
  for (uint32_t len : {kMaxPayloadBytes + 1, 1u << 30, std::numeric_limits<uint32_t>::max()}) {
    SCOPED_TRACE(len);
    absl::StatusOr<FrameHeader> header = DecodeFrameHeader(Header(MessageType::kData, len));
    ASSERT_FALSE(header.ok());
    EXPECT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(header.status().message()), HasSubstr("payload_len"));
    ExpectInvalid(DecodeFrame(Header(MessageType::kData, len)), "payload_len");
  }
  absl::StatusOr<FrameHeader> at_limit =
      DecodeFrameHeader(Header(MessageType::kHello, kMaxPayloadBytes));
  ASSERT_TRUE(at_limit.ok()) << at_limit.status();
  EXPECT_EQ(at_limit->payload_len, kMaxPayloadBytes);
  // The payload decoder applies the same limit to what it is handed.
  ExpectInvalid(DecodePayload(MessageType::kData, std::string(kMaxPayloadBytes + 1, '\0')),
                "exceeds the limit");
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
  for (const ControlMessage& message : {ControlMessage(SmallHello()),
                                        ControlMessage(Data(std::string("a\0b", 3)))}) {
    SCOPED_TRACE(std::string(MessageTypeName(TypeOf(message))));
    const std::string frame = Encode(message);
    const std::string payload = frame.substr(kFrameHeaderBytes);
    const MessageType type = TypeOf(message);
    ExpectInvalid(DecodeFrame(Header(type, static_cast<uint32_t>(payload.size() + 1)) + payload),
                  "truncated");
    ExpectInvalid(DecodeFrame(Header(type, static_cast<uint32_t>(payload.size() - 1)) + payload),
                  "trailing");
  }
  // A Data payload whose own length disagrees with the bytes the header covers.
  ExpectInvalid(DecodeFrame(Frame(MessageType::kData, Bytes().U32(4).Raw("abc").str())),
                "Data.payload");
  ExpectInvalid(DecodeFrame(Frame(MessageType::kData, Bytes().U32(2).Raw("abc").str())),
                "trailing");
  // A payload of another type's shape.
  EXPECT_FALSE(DecodeFrame(Frame(MessageType::kHello, Bytes().I32(1).Str("x").str())).ok());
}

TEST(WireTest, StringLengthPastTheEndIsRejected) {
  ExpectInvalid(DecodePayload(MessageType::kError, Bytes().I32(1).U32(10).Raw("abc").str()),
                "Error.message");
  ExpectInvalid(DecodePayload(MessageType::kData, Bytes().U32(10).Raw("abc").str()),
                "Data.payload length 10 runs past the end");
  ExpectInvalid(DecodePayload(MessageType::kHello, Bytes().Str("e").U32(10).Raw("abc").str()),
                "Hello.payload length 10 runs past the end");
  ExpectInvalid(DecodePayload(MessageType::kHello, Bytes().U32(0xffffffff).Raw("abc").str()),
                "Hello.engine_id");
  ExpectInvalid(DecodePayload(MessageType::kError, Bytes().I32(1).U32(kMaxMessageBytes).str()),
                "runs past the end");
  // A length within the opaque bounds with nothing behind it: refused without copying.
  ExpectInvalid(DecodePayload(MessageType::kData, Bytes().U32(kMaxDataPayloadBytes).str()),
                "runs past the end");
  ExpectInvalid(DecodePayload(MessageType::kHello,
                              Bytes().Str("e").U32(kMaxHelloPayloadBytes).Raw("x").str()),
                "runs past the end");
}

TEST(WireTest, StringOverItsBoundIsRejectedEvenWhenPresent) {
  const std::string too_long_id(kMaxIdBytes + 1, 'e');
  ExpectInvalid(DecodePayload(MessageType::kHello, Bytes().Str(too_long_id).str()),
                "Hello.engine_id");
  ExpectInvalid(DecodePayload(MessageType::kError,
                              Bytes().I32(1).Str(std::string(kMaxMessageBytes + 1, 'm')).str()),
                "exceeds the limit");
  const std::string hello = Encode(HelloMsg()).substr(kFrameHeaderBytes);
  ExpectInvalid(
      DecodePayload(MessageType::kHelloAck,
                    hello + Bytes().I32(1).Str(std::string(kMaxMessageBytes + 1, 'm')).str()),
      "HelloAck.message");
  // The opaque payloads one byte over their bounds, all of it present (the frames still fit
  // within kMaxPayloadBytes, so only the field's own bound refuses them).
  const std::string hello_payload = Bytes()
                                        .Str("e")
                                        .Str(std::string(kMaxHelloPayloadBytes + 1, 'p'))
                                        .Str("")
                                        .Str("")
                                        .str();
  ASSERT_LE(hello_payload.size(), kMaxPayloadBytes);
  ExpectInvalid(DecodePayload(MessageType::kHello, hello_payload), "Hello.payload length");
  ExpectInvalid(DecodeFrame(Frame(MessageType::kHello, hello_payload)), "exceeds the limit");
  // Data's bound is the frame's own room, so one byte more can only be announced.
  ExpectInvalid(DecodePayload(MessageType::kData,
                              Bytes().U32(kMaxDataPayloadBytes + 1).Raw("abc").str()),
                "Data.payload length");
  ExpectInvalid(DecodePayload(MessageType::kData,
                              Bytes().U32(kMaxDataPayloadBytes + 1).Raw("abc").str()),
                "exceeds the limit");
}

TEST(WireTest, OutOfRangeStatusCodesAreRejected) {
  for (int32_t code :
       {-1, 17, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()}) {
    SCOPED_TRACE(code);
    ExpectInvalid(DecodePayload(MessageType::kError, Bytes().I32(code).Str("").str()),
                  "Error.status_code");
    const std::string hello = Encode(HelloMsg()).substr(kFrameHeaderBytes);
    ExpectInvalid(DecodePayload(MessageType::kHelloAck, hello + Bytes().I32(code).Str("").str()),
                  "HelloAck.status_code");
  }
  // Both ends of the range are accepted.
  for (int32_t code : {0, 16}) {
    SCOPED_TRACE(code);
    EXPECT_TRUE(DecodePayload(MessageType::kError, Bytes().I32(code).Str("").str()).ok());
    const std::string hello = Encode(HelloMsg()).substr(kFrameHeaderBytes);
    EXPECT_TRUE(
        DecodePayload(MessageType::kHelloAck, hello + Bytes().I32(code).Str("").str()).ok());
  }
}

TEST(WireTest, NonceAndAuthTagMustBeEmptyOr32Bytes) {
  auto hello = [](absl::string_view nonce, absl::string_view tag) {
    return Bytes().Str("e").Str(std::string("p\0", 2)).Str(nonce).Str(tag).str();
  };
  EXPECT_TRUE(DecodePayload(MessageType::kHello, hello("", "")).ok());
  EXPECT_TRUE(DecodePayload(MessageType::kHello, hello(Pattern(32), Pattern(32))).ok());
  ExpectInvalid(DecodePayload(MessageType::kHello, hello(Pattern(31), "")), "Hello.nonce");
  ExpectInvalid(DecodePayload(MessageType::kHello, hello(Pattern(33), "")), "Hello.nonce");
  ExpectInvalid(DecodePayload(MessageType::kHello, hello(Pattern(1), "")), "Hello.nonce");
  ExpectInvalid(DecodePayload(MessageType::kHello, hello("", Pattern(1))), "Hello.auth_tag");
  ExpectInvalid(DecodePayload(MessageType::kHello, hello("", Pattern(31))), "Hello.auth_tag");
  ExpectInvalid(DecodePayload(MessageType::kHello, hello("", Pattern(64))), "Hello.auth_tag");
  // The same rules inside a HelloAck.
  ExpectInvalid(DecodePayload(MessageType::kHelloAck,
                              hello(Pattern(5), "") + Bytes().I32(0).Str("").str()),
                "Hello.nonce");
  // A challenge always carries a nonce.
  EXPECT_TRUE(DecodePayload(MessageType::kChallenge, Bytes().Str(Pattern(32)).str()).ok());
  ExpectInvalid(DecodePayload(MessageType::kChallenge, Bytes().Str("").str()), "Challenge.nonce");
  ExpectInvalid(DecodePayload(MessageType::kChallenge, Bytes().Str(Pattern(31)).str()),
                "Challenge.nonce");
  ExpectInvalid(DecodePayload(MessageType::kChallenge, Bytes().Str(Pattern(33)).str()),
                "Challenge.nonce");
  // An introduction is only ever sent under a tag.
  EXPECT_TRUE(DecodePayload(MessageType::kIntro, Bytes().Str("p").Str(Pattern(32)).str()).ok());
  for (size_t n : {0, 1, 31, 33}) {
    ExpectInvalid(DecodePayload(MessageType::kIntro, Bytes().Str("p").Str(Pattern(n)).str()),
                  "Intro.auth_tag");
  }
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
  h.payload.assign(kMaxHelloPayloadBytes + 1, 'p');
  ExpectEncodeInvalid(h, "Hello.payload");
  h = SmallHello();
  h.nonce = "short";
  ExpectEncodeInvalid(h, "Hello.nonce");
  h = SmallHello();
  h.nonce.assign(33, 'n');
  ExpectEncodeInvalid(h, "Hello.nonce");
  h = SmallHello();
  h.auth_tag.assign(33, 'a');
  ExpectEncodeInvalid(h, "Hello.auth_tag");
  h = SmallHello();
  h.auth_tag.assign(1, 'a');
  ExpectEncodeInvalid(h, "Hello.auth_tag");

  ChallengeMsg challenge;
  ExpectEncodeInvalid(challenge, "Challenge.nonce");
  challenge.nonce.assign(33, 'c');
  ExpectEncodeInvalid(challenge, "Challenge.nonce");
  ErrorMsg error;
  error.status_code = 17;
  ExpectEncodeInvalid(error, "Error.status_code");
  error.status_code = -1;
  ExpectEncodeInvalid(error, "Error.status_code");
  error.status_code = 1;
  error.message.assign(kMaxMessageBytes + 1, 'm');
  ExpectEncodeInvalid(error, "Error.message");
  HelloAckMsg ack;
  ack.status_code = 17;
  ExpectEncodeInvalid(ack, "HelloAck.status_code");
  ack.status_code = 0;
  ack.message.assign(kMaxMessageBytes + 1, 'm');
  ExpectEncodeInvalid(ack, "HelloAck.message");
  ack.message.clear();
  ack.hello.payload.assign(kMaxHelloPayloadBytes + 1, 'p');
  ExpectEncodeInvalid(ack, "Hello.payload");

  ExpectEncodeInvalid(Data(std::string(kMaxDataPayloadBytes + 1, 'd')), "Data.payload");
  IntroMsg intro = Intro("p");
  intro.auth_tag.clear();
  ExpectEncodeInvalid(intro, "Intro.auth_tag");
  intro.auth_tag.assign(33, 't');
  ExpectEncodeInvalid(intro, "Intro.auth_tag");
  intro = Intro(std::string(kMaxHelloPayloadBytes + 1, 'p'));
  ExpectEncodeInvalid(intro, "Intro.payload");
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
                                        kMaxHelloPayloadBytes,
                                        kMaxHelloPayloadBytes + 1,
                                        kMaxDataPayloadBytes,
                                        kMaxDataPayloadBytes + 1,
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
      const MessageType type = static_cast<MessageType>(1 + rng() % 6);
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
