// The wgmma descriptors of wgmma_ptx.cuh, compiled by the host compiler (no GPU needed):
// the prefill kernel builds a K-major or MN-major descriptor once per tile and steps it by
// adding a byte offset to the start-address field (DescriptorPlus). That is only right while
// the sum stays inside the field, which holds for every shared address a CTA has (below
// 256 KiB); these tests check it against a descriptor built from the stepped address, for
// every 1024-byte aligned tile base of a 227 KiB CTA and every step the kernel takes.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include <gtest/gtest.h>

// wgmma_ptx.cuh's products trap where they cannot run; the host build here never calls them.
[[noreturn]] inline void __trap() { std::abort(); }

#include "cuda/wgmma_ptx.cuh"

namespace kvstream {
namespace {

namespace w = internal::wgmma;

constexpr uint32_t kSharedBytes = 227 * 1024;

TEST(WgmmaDescriptorTest, KMajorStepsByAddingToTheStartAddress) {
  for (const uint32_t panel_bytes : {8u * 1024, 16u * 1024}) {
    for (uint32_t base = 0; base + 4 * panel_bytes <= kSharedBytes; base += 1024) {
      const uint64_t desc = w::KMajorDescriptor(base);
      for (int k = 0; k < 16; ++k) {  // head size 256: 16 k16 steps over 4 panels
        if (base + w::KMajorStepBytes(panel_bytes, k) >= kSharedBytes) break;
        ASSERT_EQ(w::DescriptorPlus(desc, w::KMajorStepBytes(panel_bytes, k)),
                  w::KMajorStep(base, panel_bytes, k))
            << "base " << base << ", panel " << panel_bytes << ", step " << k;
      }
    }
  }
}

TEST(WgmmaDescriptorTest, MnMajorStepsByAddingToTheStartAddress) {
  for (const uint32_t panel_bytes : {8u * 1024, 16u * 1024}) {
    for (uint32_t base = 0; base + 8 * 2048 <= kSharedBytes; base += 1024) {
      const uint64_t desc = w::MnMajorDescriptor(base, panel_bytes);
      for (int k = 0; k < 8; ++k) {  // 128 keys: 8 k16 steps
        ASSERT_EQ(w::DescriptorPlus(desc, w::MnMajorStepBytes(k)),
                  w::MnMajorStep(base, panel_bytes, k))
            << "base " << base << ", panel " << panel_bytes << ", step " << k;
      }
    }
  }
}

// The fields DescriptorPlus must leave alone: leading and stride byte offsets and the
// swizzle mode, whatever the start address.
TEST(WgmmaDescriptorTest, SteppingKeepsTheOtherFields) {
  const uint64_t desc = w::MnMajorDescriptor(1024, 16 * 1024);
  const uint64_t stepped = w::DescriptorPlus(desc, 7 * 2048);
  EXPECT_EQ(stepped & ~uint64_t{0x3FFF}, desc & ~uint64_t{0x3FFF});
  EXPECT_EQ(stepped & 0x3FFF, (1024 + 7 * 2048) >> 4);
}

}  // namespace
}  // namespace kvstream
