// Test helper: where scattered blocks come from and go to. ShuffledSlots(n_src, n_dst,
// seed) returns a random permutation of [0, n_src) and one of [0, n_dst), both drawn from
// one std::mt19937(seed) (source first), so a test's block i moves from slot src[i] to
// slot dst[i] in random order on both sides, the same for the same seed.
#ifndef KVSTREAM_TESTS_UNIT_SHUFFLED_SLOTS_H_
#define KVSTREAM_TESTS_UNIT_SHUFFLED_SLOTS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace kvstream {
namespace testing_util {

struct SlotPermutations {
  std::vector<size_t> src;
  std::vector<size_t> dst;
};

inline SlotPermutations ShuffledSlots(size_t n_src, size_t n_dst, uint32_t seed) {
  SlotPermutations p{std::vector<size_t>(n_src), std::vector<size_t>(n_dst)};
  std::iota(p.src.begin(), p.src.end(), 0);
  std::iota(p.dst.begin(), p.dst.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(p.src.begin(), p.src.end(), rng);
  std::shuffle(p.dst.begin(), p.dst.end(), rng);
  return p;
}

}  // namespace testing_util
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_UNIT_SHUFFLED_SLOTS_H_
