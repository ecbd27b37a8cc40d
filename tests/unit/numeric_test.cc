// Tests of common/numeric.h: the float <-> fp16 / bf16 / fp8 (e4m3, e5m2) conversions that
// caches and kernels rely on bit for bit. Expected values come from the formats' definitions
// computed here in double precision, from exhaustive neighbour / midpoint checks, and from
// constants produced once with numpy and ml_dtypes (baked in below; no Python at run time).
#include "kvstream/common/numeric.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>

#include "gtest/gtest.h"

namespace kvstream {
namespace {

// ---- Constants generated with numpy 2.4 / ml_dtypes 0.6 (astype from float32). ----
// kHalfCases: (float32 bits, expected bits)
constexpr std::pair<uint32_t, uint16_t> kHalfCases[] = {
    {0x34926cf7u, 0x0005u},
    {0xc1fb7170u, 0xcfdcu},
    {0x3ba08f90u, 0x1d04u},
    {0xb9a611cbu, 0x8d31u},
    {0x42e2d5ccu, 0x5717u},
    {0x329fe6e1u, 0x0000u},
    {0x419c7a3cu, 0x4ce4u},
    {0xb5449780u, 0x800cu},
    {0x32dc657du, 0x0000u},
    {0x37384b17u, 0x00b8u},
    {0xb2354cdbu, 0x8000u},
    {0x322bc0cau, 0x0000u},
    {0x415bb878u, 0x4adeu},
    {0xbd714c8eu, 0xab8au},
    {0x404528a7u, 0x4229u},
    {0xbf8b1282u, 0xbc59u},
    {0xc1d101cdu, 0xce88u},
    {0xb46522cdu, 0x8004u},
    {0xb724bedfu, 0x80a5u},
    {0xb5228996u, 0x800au},
    {0xc558f8a5u, 0xeac8u},
    {0x4625a99fu, 0x712du},
    {0xbf6dd1a7u, 0xbb6fu},
    {0x40d7eeffu, 0x46bfu},
    {0x42430140u, 0x5218u},
    {0xb5d4ad9au, 0x801bu},
    {0x3ccc1cc6u, 0x2661u},
    {0xb7091bf0u, 0x8089u},
    {0xbef54eb2u, 0xb7aau},
    {0xb220f82du, 0x8000u},
    {0x38e6a9dbu, 0x0735u},
    {0xc48fe969u, 0xe47fu},
    {0xc71aae28u, 0xf8d5u},
    {0x3acc4458u, 0x1662u},
    {0xc2130421u, 0xd098u},
    {0x37376888u, 0x00b7u},
    {0xb2127a9au, 0x8000u},
    {0xc0ff1f4fu, 0xc7f9u},
    {0xb62b8547u, 0x802bu},
    {0x45cddd75u, 0x6e6fu},
};
// kHalfTieCases: (float32 bits, expected bits)
constexpr std::pair<uint32_t, uint16_t> kHalfTieCases[] = {
    {0x3f3bf000u, 0x39e0u},
    {0x3e5fb000u, 0x32feu},
    {0xc17af000u, 0xcbd8u},
    {0xc7165000u, 0xf8b2u},
    {0x433f9000u, 0x59fcu},
    {0xc557f000u, 0xeac0u},
    {0xb9417000u, 0x8a0cu},
    {0xc76f7000u, 0xfb7cu},
};
// kBFloat16Cases: (float32 bits, expected bits)
constexpr std::pair<uint32_t, uint16_t> kBFloat16Cases[] = {
    {0xd37d932bu, 0xd37eu},
    {0x7d724b97u, 0x7d72u},
    {0x78ca99f1u, 0x78cbu},
    {0xd0db685bu, 0xd0dbu},
    {0x6ef6c7aau, 0x6ef7u},
    {0xe3de4cacu, 0xe3deu},
    {0xe9ee485bu, 0xe9eeu},
    {0xedf35ca7u, 0xedf3u},
    {0x2982b283u, 0x2983u},
    {0xc50cf2b6u, 0xc50du},
    {0x34fc861au, 0x34fdu},
    {0xcf4ed89du, 0xcf4fu},
    {0xfd2d186eu, 0xfd2du},
    {0x143c3b01u, 0x143cu},
    {0x233ff076u, 0x2340u},
    {0x2b075c57u, 0x2b07u},
    {0xc2c502a1u, 0xc2c5u},
    {0x6cacb4cfu, 0x6cadu},
    {0x7e8151d3u, 0x7e81u},
    {0x5ba660c3u, 0x5ba6u},
    {0xc3c83d08u, 0xc3c8u},
    {0x3f0122feu, 0x3f01u},
    {0xa16e57eeu, 0xa16eu},
    {0x72bef289u, 0x72bfu},
    {0x58a891dbu, 0x58a9u},
    {0xd61c8358u, 0xd61du},
    {0x2ad6aba2u, 0x2ad7u},
    {0x20808bd2u, 0x2081u},
    {0x186e2cc4u, 0x186eu},
    {0xfed473d9u, 0xfed4u},
    {0x61520991u, 0x6152u},
    {0x5f58332cu, 0x5f58u},
    {0x90c0c274u, 0x90c1u},
    {0xc554ff4eu, 0xc555u},
    {0x733a35abu, 0x733au},
    {0xdd1eb01cu, 0xdd1fu},
    {0x01b17259u, 0x01b1u},
    {0xad4402c1u, 0xad44u},
    {0x32088c5cu, 0x3209u},
    {0xfe59be59u, 0xfe5au},
};
// kBFloat16TieCases: (float32 bits, expected bits)
constexpr std::pair<uint32_t, uint16_t> kBFloat16TieCases[] = {
    {0x878d8000u, 0x878eu},
    {0x6f928000u, 0x6f92u},
    {0x7c398000u, 0x7c3au},
    {0xb0348000u, 0xb034u},
    {0x3ac28000u, 0x3ac2u},
    {0xf2e38000u, 0xf2e4u},
    {0x9cbc8000u, 0x9cbcu},
    {0xce058000u, 0xce06u},
};
// kE4M3Cases: (float32 bits, expected bits)
constexpr std::pair<uint32_t, uint8_t> kE4M3Cases[] = {
    {0xbbeb190du, 0x84u},
    {0xbadeeaffu, 0x81u},
    {0xbd09f2afu, 0x91u},
    {0x40c643b1u, 0x4cu},
    {0xba094a68u, 0x80u},
    {0xc10ecd30u, 0xd1u},
    {0xbae6f350u, 0x81u},
    {0xba2c00c1u, 0x80u},
    {0xbbdf1cc4u, 0x83u},
    {0x3f65d1d5u, 0x36u},
    {0x3d0ada56u, 0x11u},
    {0xbc304a8fu, 0x86u},
    {0xbac582c1u, 0x81u},
    {0x416c8a31u, 0x57u},
    {0x413ab57fu, 0x54u},
    {0x41301f13u, 0x53u},
    {0x3bdcd519u, 0x03u},
    {0x3ab24d4eu, 0x01u},
    {0x3cd7671du, 0x0du},
    {0x3d40633au, 0x14u},
    {0xc210fddcu, 0xe1u},
    {0x3c90c31fu, 0x09u},
    {0x3d092845u, 0x11u},
    {0xc0960578u, 0xc9u},
    {0xbf999a92u, 0xbau},
    {0xbd36c10cu, 0x93u},
    {0xbbc377d3u, 0x83u},
    {0x42f66c01u, 0x6fu},
    {0xc2a8dcb1u, 0xebu},
    {0xc2526845u, 0xe5u},
    {0x3cec546au, 0x0fu},
    {0x3a3b7fa5u, 0x00u},
    {0xbfba96cbu, 0xbcu},
    {0x3dd49ad9u, 0x1du},
    {0x3c525ca3u, 0x07u},
    {0xc186e8b0u, 0xd8u},
    {0xbeedc8a2u, 0xafu},
    {0x3ed018d6u, 0x2du},
    {0xbca01b33u, 0x8au},
    {0x3c2d1b5bu, 0x05u},
};
// kE5M2Cases: (float32 bits, expected bits)
constexpr std::pair<uint32_t, uint8_t> kE5M2Cases[] = {
    {0x37b1dc7au, 0x01u},
    {0x45defb67u, 0x6fu},
    {0x3ca03bbfu, 0x25u},
    {0x3b4ccb76u, 0x1au},
    {0xbe0b0d46u, 0xb0u},
    {0xbd7c0d68u, 0xacu},
    {0x44f44b67u, 0x68u},
    {0x3e0b9528u, 0x30u},
    {0x3a337abcu, 0x12u},
    {0xc0417883u, 0xc2u},
    {0xbbd8151au, 0x9fu},
    {0x3c4b37d7u, 0x22u},
    {0x400de2e6u, 0x40u},
    {0x468267f4u, 0x74u},
    {0x3f4a5069u, 0x3au},
    {0xb6e947b3u, 0x80u},
    {0x44d8cf0du, 0x67u},
    {0xc606ecb1u, 0xf0u},
    {0x3f95a36eu, 0x3du},
    {0xbdf66f0eu, 0xb0u},
    {0xb9180799u, 0x89u},
    {0xbb1b72d1u, 0x99u},
    {0xbcccc0b8u, 0xa6u},
    {0x3bcf74d3u, 0x1eu},
    {0x37414c26u, 0x01u},
    {0x43de548bu, 0x5fu},
    {0xbf9dbd1au, 0xbdu},
    {0xb7e23e60u, 0x82u},
    {0x40fb7026u, 0x48u},
    {0xc3bbe6b9u, 0xdeu},
    {0xc6ba9a93u, 0xf6u},
    {0xc1ac3af3u, 0xcdu},
    {0x46f7f7a0u, 0x78u},
    {0x3daaac4bu, 0x2du},
    {0xbda839a2u, 0xadu},
    {0x4131be22u, 0x4au},
    {0x4421a62bu, 0x61u},
    {0xb6f00cafu, 0x80u},
};

// Value of an fp8 code from the OCP definition: sign, exponent field, mantissa field.
// Subnormals are mant * 2^(1 - bias - mbits). Uses double arithmetic and std::pow only, so
// it shares no code with numeric.h.
double Fp8Reference(uint8_t code, int ebits, int mbits, bool ieee_specials) {
  const int bias = (1 << (ebits - 1)) - 1;
  const int sign = code >> 7;
  const int e = (code >> mbits) & ((1 << ebits) - 1);
  const int m = code & ((1 << mbits) - 1);
  const double s = sign ? -1.0 : 1.0;
  const int emax_field = (1 << ebits) - 1;
  if (ieee_specials && e == emax_field) {
    return m == 0 ? s * std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  }
  if (!ieee_specials && e == emax_field && m == (1 << mbits) - 1) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (e == 0) return s * m * std::pow(2.0, 1 - bias - mbits);
  return s * (1.0 + m / std::pow(2.0, mbits)) * std::pow(2.0, e - bias);
}
double E4M3Ref(uint8_t c) { return Fp8Reference(c, 4, 3, /*ieee_specials=*/false); }
double E5M2Ref(uint8_t c) { return Fp8Reference(c, 5, 2, /*ieee_specials=*/true); }

// Nearest code to x among the non-negative finite codes [0, max_code], ties to the even
// code (an even mantissa is an even code in both formats), saturating above the range.
// Brute force over the table, independent of numeric.h's frexp arithmetic.
uint8_t NearestFp8Reference(float x, uint8_t max_code, double (*ref)(uint8_t)) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  uint8_t best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= max_code; ++c) {
    const double err = std::fabs(ref(static_cast<uint8_t>(c)) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = static_cast<uint8_t>(c);
      best_err = err;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

TEST(NumericFp8Test, E4M3DecodesAll256CodesPerDefinition) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const double want = E4M3Ref(code);
    const float got = Fp8E4M3ToFloat(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      ++nans;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
    EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;
  }
  EXPECT_EQ(nans, 2);  // 0x7f and 0xff only: e4m3fn has no infinities
}

TEST(NumericFp8Test, E5M2DecodesAll256CodesPerDefinition) {
  int nans = 0, infs = 0;
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const double want = E5M2Ref(code);
    const float got = Fp8E5M2ToFloat(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      ++nans;
      continue;
    }
    if (std::isinf(want)) ++infs;
    EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
  }
  EXPECT_EQ(nans, 6);
  EXPECT_EQ(infs, 2);
}

TEST(NumericFp8Test, KnownCodes) {
  EXPECT_EQ(Fp8E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xb8), -1.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), 0.001953125f);  // 2^-9, smallest subnormal
  EXPECT_EQ(Fp8E4M3ToFloat(0x07), 0.013671875f);  // 7 * 2^-9, largest subnormal
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), 0.015625f);     // 2^-6, smallest normal
  EXPECT_TRUE(std::signbit(Fp8E4M3ToFloat(0x80)));
  EXPECT_EQ(Fp8E5M2ToFloat(0x3c), 1.0f);
  EXPECT_EQ(Fp8E5M2ToFloat(0x7b), 57344.0f);
  EXPECT_EQ(Fp8E5M2ToFloat(0x01), 1.52587890625e-05f);  // 2^-16
  EXPECT_EQ(Fp8E5M2ToFloat(0x04), 6.103515625e-05f);    // 2^-14
  EXPECT_EQ(Fp8E5M2ToFloat(0x7c), std::numeric_limits<float>::infinity());
  EXPECT_EQ(Fp8E5M2ToFloat(0xfc), -std::numeric_limits<float>::infinity());
}

TEST(NumericFp8Test, EncodeDecodeRoundTripsEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    if (!std::isnan(Fp8E4M3ToFloat(code))) {
      EXPECT_EQ(FloatToFp8E4M3(Fp8E4M3ToFloat(code)), code) << "e4m3 code " << c;
    }
    const float v = Fp8E5M2ToFloat(code);
    if (std::isfinite(v)) {
      EXPECT_EQ(FloatToFp8E5M2(v), code) << "e5m2 code " << c;
    }
  }
  // Infinity has a code in e5m2 but the encoder saturates (caches never hold infinities).
  EXPECT_EQ(FloatToFp8E5M2(Fp8E5M2ToFloat(0x7c)), 0x7b);
  EXPECT_EQ(FloatToFp8E5M2(Fp8E5M2ToFloat(0xfc)), 0xfb);
}

TEST(NumericFp8Test, NaNStaysNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(FloatToFp8E4M3(nan))));
  EXPECT_TRUE(std::isnan(Fp8E5M2ToFloat(FloatToFp8E5M2(nan))));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(FloatToFp8E4M3(-nan))));
}

TEST(NumericFp8Test, Saturates) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(Fp8E4M3ToFloat(FloatToFp8E4M3(1e6f)), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(FloatToFp8E4M3(-1e6f)), -448.0f);
  EXPECT_EQ(FloatToFp8E4M3(inf), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-inf), 0xfe);
  EXPECT_EQ(Fp8E4M3ToFloat(FloatToFp8E4M3(-inf)), -448.0f);
  // Just past the top, and at the midpoint to the next (non-existent) value 480.
  EXPECT_EQ(FloatToFp8E4M3(449.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(464.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(479.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::max()), 0x7e);
  EXPECT_EQ(Fp8E5M2ToFloat(FloatToFp8E5M2(1e6f)), 57344.0f);
  EXPECT_EQ(Fp8E5M2ToFloat(FloatToFp8E5M2(-1e6f)), -57344.0f);
  EXPECT_EQ(FloatToFp8E5M2(inf), 0x7b);
  EXPECT_EQ(FloatToFp8E5M2(-inf), 0xfb);
  EXPECT_EQ(FloatToFp8E5M2(61440.0f), 0x7b);  // midpoint to 65536, which would be inf
  EXPECT_EQ(FloatToFp8E5M2(65535.0f), 0x7b);
}

TEST(NumericFp8Test, TiesToEvenSpotChecks) {
  // e4m3 in [1, 2): step 1/8.
  EXPECT_EQ(FloatToFp8E4M3(1.0625f), 0x38);  // 1 + 1/16: between 1.0 (even) and 1.125
  EXPECT_EQ(FloatToFp8E4M3(1.1875f), 0x3a);  // between 1.125 and 1.25 (even)
  EXPECT_EQ(FloatToFp8E4M3(1.9375f), 0x40);  // between 1.875 and 2.0 (even, next binade)
  EXPECT_EQ(FloatToFp8E4M3(std::nextafter(1.0625f, 2.0f)), 0x39);
  EXPECT_EQ(FloatToFp8E4M3(-1.0625f), 0xb8);
  // e4m3 subnormals: step 2^-9.
  EXPECT_EQ(FloatToFp8E4M3(0.0009765625f), 0x00);   // 2^-10: ties to zero
  EXPECT_EQ(FloatToFp8E4M3(0.0029296875f), 0x02);   // 3 * 2^-10: between 1 and 2 -> 2
  EXPECT_EQ(FloatToFp8E4M3(0.0146484375f), 0x08);   // 7.5 * 2^-9 -> smallest normal
  EXPECT_EQ(FloatToFp8E4M3(1e-30f), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(-1e-30f), 0x80);
  EXPECT_EQ(FloatToFp8E4M3(-0.0f), 0x80);
  // e5m2 in [1, 2): step 1/4.
  EXPECT_EQ(FloatToFp8E5M2(1.125f), 0x3c);
  EXPECT_EQ(FloatToFp8E5M2(1.375f), 0x3e);
  EXPECT_EQ(FloatToFp8E5M2(1.875f), 0x40);
  EXPECT_EQ(FloatToFp8E5M2(7.62939453125e-06f), 0x00);  // 2^-17: ties to zero
  EXPECT_EQ(FloatToFp8E5M2(2.288818359375e-05f), 0x02);  // 3 * 2^-17 -> 2
}

// Every midpoint between neighbouring codes goes to the even code; one float either side
// goes to the nearer code. Covers subnormals, the subnormal/normal boundary and each binade.
void CheckAllMidpoints(uint8_t max_code, float (*decode)(uint8_t), uint8_t (*encode)(float)) {
  for (int c = 0; c < max_code; ++c) {
    const float lo = decode(static_cast<uint8_t>(c));
    const float hi = decode(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;  // exact: fp8 values have few bits
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2);
    const uint8_t even = (c & 1) == 0 ? static_cast<uint8_t>(c) : static_cast<uint8_t>(c + 1);
    EXPECT_EQ(encode(mid), even) << "midpoint of codes " << c << " and " << c + 1;
    EXPECT_EQ(encode(-mid), 0x80 | even) << "negative midpoint of codes " << c;
    EXPECT_EQ(encode(std::nextafter(mid, 0.0f)), c) << "below midpoint " << c;
    EXPECT_EQ(encode(std::nextafter(mid, 1e9f)), c + 1) << "above midpoint " << c;
  }
}

TEST(NumericFp8Test, E4M3AllMidpointsTieToEven) {
  CheckAllMidpoints(0x7e, &Fp8E4M3ToFloat, &FloatToFp8E4M3);
}

TEST(NumericFp8Test, E5M2AllMidpointsTieToEven) {
  CheckAllMidpoints(0x7b, &Fp8E5M2ToFloat, &FloatToFp8E5M2);
}

TEST(NumericFp8Test, MatchesBruteForceNearestOnRandomFloats) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> exp_dist(-20, 17);
  std::uniform_int_distribution<uint32_t> mant_dist(0, (1u << 23) - 1);
  for (int i = 0; i < 20000; ++i) {
    const uint32_t sign = (i & 1) ? 0x80000000u : 0u;
    const uint32_t bits = sign | (static_cast<uint32_t>(exp_dist(rng) + 127) << 23) | mant_dist(rng);
    const float x = BitsToFloat(bits);
    ASSERT_EQ(FloatToFp8E4M3(x), NearestFp8Reference(x, 0x7e, &E4M3Ref)) << "x = " << x;
    ASSERT_EQ(FloatToFp8E5M2(x), NearestFp8Reference(x, 0x7b, &E5M2Ref)) << "x = " << x;
  }
}

TEST(NumericFp8Test, MatchesMlDtypesConstants) {
  for (const auto& [bits, code] : kE4M3Cases) {
    EXPECT_EQ(FloatToFp8E4M3(BitsToFloat(bits)), code) << std::hex << "0x" << bits;
  }
  for (const auto& [bits, code] : kE5M2Cases) {
    EXPECT_EQ(FloatToFp8E5M2(BitsToFloat(bits)), code) << std::hex << "0x" << bits;
  }
}

// ---- IEEE binary16 ----

TEST(NumericHalfTest, AllCodesRoundTrip) {
  for (uint32_t c = 0; c < 0x10000; ++c) {
    const uint16_t h = static_cast<uint16_t>(c);
    const float f = HalfToFloat(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f)))) << std::hex << c;
      continue;
    }
    ASSERT_EQ(FloatToHalf(f), h) << std::hex << "0x" << c;
  }
}

TEST(NumericHalfTest, DecodesPerDefinition) {
  for (uint32_t c = 0; c < 0x10000; ++c) {
    const int e = (c >> 10) & 0x1f;
    const int m = c & 0x3ff;
    const double s = (c & 0x8000) ? -1.0 : 1.0;
    if (e == 0x1f) continue;
    const double want = e == 0 ? s * m * std::pow(2.0, -24)
                               : s * (1.0 + m / 1024.0) * std::pow(2.0, e - 15);
    ASSERT_EQ(static_cast<double>(HalfToFloat(static_cast<uint16_t>(c))), want) << c;
  }
  EXPECT_EQ(HalfToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));
}

TEST(NumericHalfTest, AllMidpointsTieToEven) {
  for (uint32_t c = 0; c < 0x7bff; ++c) {
    const float lo = HalfToFloat(static_cast<uint16_t>(c));
    const float hi = HalfToFloat(static_cast<uint16_t>(c + 1));
    const float mid = (lo + hi) / 2;  // exact in float
    const uint16_t even = static_cast<uint16_t>((c & 1) == 0 ? c : c + 1);
    ASSERT_EQ(FloatToHalf(mid), even) << "midpoint of 0x" << std::hex << c;
    ASSERT_EQ(FloatToHalf(-mid), 0x8000 | even) << "negative midpoint of 0x" << std::hex << c;
    ASSERT_EQ(FloatToHalf(std::nextafter(mid, 0.0f)), c);
    ASSERT_EQ(FloatToHalf(std::nextafter(mid, 1e9f)), c + 1);
  }
}

TEST(NumericHalfTest, SpotChecks) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // midpoint to 65536: ties to even = inf
  EXPECT_EQ(FloatToHalf(1e6f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(FloatToHalf(5.9604644775390625e-08f), 0x0001);  // 2^-24
  EXPECT_EQ(FloatToHalf(2.98023223876953125e-08f), 0x0000);  // 2^-25: ties to zero
  EXPECT_EQ(FloatToHalf(8.94069671630859375e-08f), 0x0002);  // 3 * 2^-25 -> 2
  EXPECT_EQ(FloatToHalf(6.103515625e-05f), 0x0400);          // 2^-14, smallest normal
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(1.00048828125f), 0x3c00);  // 1 + 2^-11: ties to even
  EXPECT_EQ(FloatToHalf(1.00146484375f), 0x3c02);  // 1 + 3 * 2^-11
  EXPECT_EQ(FloatToHalf(1e-10f), 0x0000);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(NumericHalfTest, RandomBitPatternsRoundToNearest) {
  // Independent check: the result must be a neighbour of x and no farther than the other.
  std::mt19937 rng(11);
  for (int i = 0; i < 200000; ++i) {
    const float x = BitsToFloat(static_cast<uint32_t>(rng()));
    const uint16_t h = FloatToHalf(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(HalfToFloat(h)));
      continue;
    }
    const double xd = x;
    const double got = HalfToFloat(h);
    ASSERT_EQ(std::signbit(got), std::signbit(xd)) << x;
    if (std::fabs(xd) >= 65520.0) {
      ASSERT_TRUE(std::isinf(got)) << x;
      continue;
    }
    // The other candidate is the next half away from got, on x's side.
    const uint16_t mag = h & 0x7fff;
    const bool x_beyond = std::fabs(xd) > std::fabs(got);
    if (x_beyond) {
      const double other = HalfToFloat(static_cast<uint16_t>(mag + 1));
      ASSERT_LE(std::fabs(xd) - std::fabs(got), other - std::fabs(xd)) << x;
      if (std::fabs(xd) - std::fabs(got) == other - std::fabs(xd)) {
        ASSERT_EQ(mag & 1, 0) << x;
      }
    } else if (std::fabs(xd) < std::fabs(got)) {
      ASSERT_GT(mag, 0);
      const double other = HalfToFloat(static_cast<uint16_t>(mag - 1));
      ASSERT_LE(std::fabs(got) - std::fabs(xd), std::fabs(xd) - other) << x;
      if (std::fabs(got) - std::fabs(xd) == std::fabs(xd) - other) {
        ASSERT_EQ(mag & 1, 0) << x;
      }
    }
  }
}

TEST(NumericHalfTest, MatchesNumpyConstants) {
  for (const auto& [bits, code] : kHalfCases) {
    EXPECT_EQ(FloatToHalf(BitsToFloat(bits)), code) << std::hex << "0x" << bits;
  }
  for (const auto& [bits, code] : kHalfTieCases) {
    EXPECT_EQ(FloatToHalf(BitsToFloat(bits)), code) << std::hex << "0x" << bits;
  }
}

// ---- bfloat16 ----

TEST(NumericBFloat16Test, AllCodesRoundTrip) {
  for (uint32_t c = 0; c < 0x10000; ++c) {
    const uint16_t b = static_cast<uint16_t>(c);
    const float f = BFloat16ToFloat(b);
    EXPECT_EQ(FloatBits(f), c << 16);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(f)))) << std::hex << c;
      continue;
    }
    ASSERT_EQ(FloatToBFloat16(f), b) << std::hex << "0x" << c;
  }
}

TEST(NumericBFloat16Test, AllMidpointsTieToEven) {
  for (uint32_t c = 0; c < 0x7f7f; ++c) {
    const uint32_t mid_bits = (c << 16) | 0x8000u;  // exactly half-way to c + 1
    const uint16_t even = static_cast<uint16_t>((c & 1) == 0 ? c : c + 1);
    ASSERT_EQ(FloatToBFloat16(BitsToFloat(mid_bits)), even) << std::hex << c;
    ASSERT_EQ(FloatToBFloat16(BitsToFloat(mid_bits | 0x80000000u)), 0x8000 | even);
    ASSERT_EQ(FloatToBFloat16(BitsToFloat(mid_bits - 1)), c);
    ASSERT_EQ(FloatToBFloat16(BitsToFloat(mid_bits + 1)), c + 1);
  }
}

TEST(NumericBFloat16Test, SpotChecks) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to inf
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x00008000u)), 0x0000);  // subnormal tie -> even
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x00018000u)), 0x0002);
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x00008001u)), 0x0001);
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x3f808000u)), 0x3f80);  // 1 + 2^-8: even
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x3f818000u)), 0x3f82);
  // NaN stays NaN, also a NaN whose payload sits only in the dropped low bits.
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(BitsToFloat(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(BitsToFloat(0xff800001u)))));
}

TEST(NumericBFloat16Test, RandomBitPatternsRoundToNearest) {
  std::mt19937 rng(13);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng());
    const float x = BitsToFloat(bits);
    const uint16_t b = FloatToBFloat16(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(BFloat16ToFloat(b)));
      continue;
    }
    // Candidates are the truncation and the next code up in magnitude.
    const uint32_t low = bits & 0xffffu;
    const uint16_t trunc = static_cast<uint16_t>(bits >> 16);
    uint16_t want;
    if (low < 0x8000u) {
      want = trunc;
    } else if (low > 0x8000u) {
      want = static_cast<uint16_t>(trunc + 1);
    } else {
      want = (trunc & 1) ? static_cast<uint16_t>(trunc + 1) : trunc;
    }
    ASSERT_EQ(b, want) << std::hex << "0x" << bits;
  }
}

TEST(NumericBFloat16Test, MatchesMlDtypesConstants) {
  for (const auto& [bits, code] : kBFloat16Cases) {
    EXPECT_EQ(FloatToBFloat16(BitsToFloat(bits)), code) << std::hex << "0x" << bits;
  }
  for (const auto& [bits, code] : kBFloat16TieCases) {
    EXPECT_EQ(FloatToBFloat16(BitsToFloat(bits)), code) << std::hex << "0x" << bits;
  }
}

// ---- float loads and stores by dtype ----

TEST(NumericLoadStoreTest, RoundTripsThroughEveryDType) {
  float f32[1];
  uint16_t u16[1];
  uint8_t u8[1];
  StoreFromFloat(f32, DType::kFloat32, 0, 1.5f);
  EXPECT_EQ(LoadAsFloat(f32, DType::kFloat32, 0), 1.5f);
  StoreFromFloat(u16, DType::kFloat16, 0, 1.5f);
  EXPECT_EQ(u16[0], 0x3e00);
  EXPECT_EQ(LoadAsFloat(u16, DType::kFloat16, 0), 1.5f);
  StoreFromFloat(u16, DType::kBFloat16, 0, 1.5f);
  EXPECT_EQ(u16[0], 0x3fc0);
  EXPECT_EQ(LoadAsFloat(u16, DType::kBFloat16, 0), 1.5f);
  StoreFromFloat(u8, DType::kFloat8E4M3, 0, 1000.0f);
  EXPECT_EQ(u8[0], 0x7e);
  EXPECT_EQ(LoadAsFloat(u8, DType::kFloat8E4M3, 0), 448.0f);
  StoreFromFloat(u8, DType::kFloat8E5M2, 0, -1.5f);
  EXPECT_EQ(u8[0], 0xbe);
  EXPECT_EQ(LoadAsFloat(u8, DType::kFloat8E5M2, 0), -1.5f);
}

TEST(NumericLoadStoreTest, MaxFinite) {
  EXPECT_EQ(DTypeMaxFinite(DType::kFloat8E4M3), Fp8E4M3ToFloat(0x7e));
  EXPECT_EQ(DTypeMaxFinite(DType::kFloat8E5M2), Fp8E5M2ToFloat(0x7b));
  EXPECT_EQ(DTypeMaxFinite(DType::kFloat16), HalfToFloat(0x7bff));
  EXPECT_EQ(DTypeMaxFinite(DType::kBFloat16), BFloat16ToFloat(0x7f7f));
  EXPECT_EQ(DTypeMaxFinite(DType::kFloat32), std::numeric_limits<float>::max());
}

}  // namespace
}  // namespace kvstream
