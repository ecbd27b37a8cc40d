// Kvsum64Host (kvstream/cache/layer_checksum.h), and DeviceChecksummer::StagingBytesFor,
// which every build has. Kvsum64Host: one pass over the spans, 8 bytes at a time
// wherever a span's bytes line up with B's words, with the few bytes around a span boundary
// that falls inside a word gathered into that word first. The arithmetic is the kernel's
// (cuda/layer_checksum.cuh), so both give the same bits by construction.
#include "cuda/layer_checksum.cuh"

#include <cstdint>
#include <cstring>

#include "absl/types/span.h"
#include "kvstream/cache/layer_checksum.h"

namespace kvstream {
namespace {

namespace ks = internal::kvsum64;

// The little-endian 64-bit word at `p` (any alignment).
inline uint64_t LoadLittleEndian64(const unsigned char* p) {
  uint64_t w;
  std::memcpy(&w, p, sizeof(w));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  w = __builtin_bswap64(w);
#endif
  return w;
}

// The sum of the terms of `count` whole words at `p`, the first being word `index` of B.
// Four independent sums so that the multiplies of neighbouring words overlap.
uint64_t SumWords(const unsigned char* p, uint64_t count, uint64_t index) {
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  uint64_t t = (index + 1) * ks::kWeyl;  // the position term of the next word
  uint64_t i = 0;
  for (; i + 4 <= count; i += 4, p += 32) {
    s0 += ks::Mix(LoadLittleEndian64(p) + t);
    s1 += ks::Mix(LoadLittleEndian64(p + 8) + t + ks::kWeyl);
    s2 += ks::Mix(LoadLittleEndian64(p + 16) + t + 2 * ks::kWeyl);
    s3 += ks::Mix(LoadLittleEndian64(p + 24) + t + 3 * ks::kWeyl);
    t += 4 * ks::kWeyl;
  }
  for (; i < count; ++i, p += 8) {
    s0 += ks::Mix(LoadLittleEndian64(p) + t);
    t += ks::kWeyl;
  }
  return s0 + s1 + s2 + s3;
}

}  // namespace

uint64_t Kvsum64Host(absl::Span<const ChecksumSpan> spans) {
  uint64_t sum = 0;
  uint64_t pos = 0;      // bytes of B so far
  uint64_t partial = 0;  // the bytes of word pos / 8 seen so far, in place
  for (const ChecksumSpan& span : spans) {
    const unsigned char* p = static_cast<const unsigned char*>(span.data);
    uint64_t left = span.length;
    // Finish a word an earlier span left open.
    for (; left > 0 && (pos & 7) != 0; ++p, --left, ++pos) {
      partial |= uint64_t{*p} << ((pos & 7) * 8);
      if ((pos & 7) == 7) {
        sum += ks::Term(partial, pos >> 3);
        partial = 0;
      }
    }
    const uint64_t words = left >> 3;
    if (words > 0) {
      sum += SumWords(p, words, pos >> 3);
      p += words * 8;
      pos += words * 8;
      left -= words * 8;
    }
    // Fewer than 8 bytes left at a word boundary: they open the next word.
    for (; left > 0; ++p, --left, ++pos) partial |= uint64_t{*p} << ((pos & 7) * 8);
  }
  if ((pos & 7) != 0) sum += ks::Term(partial, pos >> 3);  // zero-padded last word
  return ks::Finish(sum, pos);
}

size_t DeviceChecksummer::StagingBytesFor(size_t num_spans, uint64_t total_bytes) {
  return ks::LayoutFor(num_spans, ks::NumChunks(total_bytes)).bytes;
}

}  // namespace kvstream
