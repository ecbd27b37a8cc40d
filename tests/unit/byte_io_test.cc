// Tests of ByteWriter / ByteReader (byte_io.h): round trips, bounds and hostile lengths.
#include "kvstream/common/byte_io.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvstream {
namespace {

using ::testing::HasSubstr;

TEST(ByteIoTest, RoundTripsEveryFieldLittleEndian) {
  std::string out;
  ByteWriter w(&out);
  w.U8(0xab);
  w.U16(0x1234);
  w.U32(0xdeadbeef);
  w.U64(0x0102030405060708ull);
  w.I32(-5);
  w.Raw("MAGC");
  ASSERT_TRUE(w.Bytes("name", "hello", 16).ok());
  EXPECT_EQ(out.substr(1, 2), std::string("\x34\x12", 2));
  ByteReader r(out);
  uint8_t a = 0;
  uint16_t b = 0;
  uint32_t c = 0;
  uint64_t d = 0;
  int32_t e = 0;
  std::string magic, name;
  ASSERT_TRUE(r.U8("a", &a).ok());
  ASSERT_TRUE(r.U16("b", &b).ok());
  ASSERT_TRUE(r.U32("c", &c).ok());
  ASSERT_TRUE(r.U64("d", &d).ok());
  ASSERT_TRUE(r.I32("e", &e).ok());
  EXPECT_EQ(r.position(), 19u);
  ASSERT_TRUE(r.Raw("magic", 4, &magic).ok());
  ASSERT_TRUE(r.Bytes("name", 16, &name).ok());
  EXPECT_TRUE(r.ExpectEnd("test").ok());
  EXPECT_EQ(a, 0xab);
  EXPECT_EQ(b, 0x1234);
  EXPECT_EQ(c, 0xdeadbeefu);
  EXPECT_EQ(d, 0x0102030405060708ull);
  EXPECT_EQ(e, -5);
  EXPECT_EQ(magic, "MAGC");
  EXPECT_EQ(name, "hello");
}

TEST(ByteIoTest, RefusesWhatRunsPastTheEndOrItsBound) {
  std::string out;
  ByteWriter w(&out);
  EXPECT_FALSE(w.Bytes("big", std::string(17, 'x'), 16).ok());
  EXPECT_TRUE(out.empty());  // nothing written
  w.U32(1000);               // a length with nothing behind it
  ByteReader r(out);
  std::string s;
  absl::Status st = r.Bytes("blob", 2000, &s);
  EXPECT_THAT(st.message(), HasSubstr("runs past the end"));
  ByteReader r2(out);
  EXPECT_THAT(r2.Bytes("blob", 10, &s).message(), HasSubstr("exceeds the limit"));
  ByteReader r3(out);
  uint32_t n = 0;
  // 1000 entries of at least 4 bytes cannot fit in 0 remaining bytes.
  EXPECT_THAT(r3.Count("list", 1u << 20, 4, &n).message(), HasSubstr("runs past the end"));
  ByteReader r4(absl::string_view("ab"));
  EXPECT_THAT(r4.U32("x", &n).message(), HasSubstr("truncated"));
  EXPECT_THAT(ByteReader("abc").Raw("magic", 4, &s).message(), HasSubstr("truncated"));
  ByteReader r5(absl::string_view("abcd"));
  uint8_t b = 0;
  ASSERT_TRUE(r5.U8("b", &b).ok());
  EXPECT_THAT(r5.ExpectEnd("thing").message(), HasSubstr("3 trailing bytes"));
}

}  // namespace
}  // namespace kvstream
