// Tests of cache/slot_mapping.h: slots from a block table row, and the range check.
#include "kvstream/cache/slot_mapping.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvstream {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(SlotMappingTest, SlotsFollowTheBlockTableRow) {
  const std::vector<int32_t> row = {5, 0, 3};
  auto slots = ComputeSlotMapping(row, 4, 0, 10);
  ASSERT_TRUE(slots.ok()) << slots.status();
  EXPECT_THAT(*slots, ElementsAre(20, 21, 22, 23, 0, 1, 2, 3, 12, 13));
}

TEST(SlotMappingTest, StartsAtFirstPosition) {
  const std::vector<int32_t> row = {5, 0, 3};
  auto slots = ComputeSlotMapping(row, 4, 6, 3);
  ASSERT_TRUE(slots.ok());
  EXPECT_THAT(*slots, ElementsAre(2, 3, 12));
  // A decode step: one token at the end of the sequence.
  slots = ComputeSlotMapping(row, 4, 11, 1);
  ASSERT_TRUE(slots.ok());
  EXPECT_THAT(*slots, ElementsAre(15));
}

TEST(SlotMappingTest, BlockSizeOneAndOddBlockSizes) {
  const std::vector<int32_t> row = {9, 2, 7};
  auto one = ComputeSlotMapping(row, 1, 0, 3);
  ASSERT_TRUE(one.ok());
  EXPECT_THAT(*one, ElementsAre(9, 2, 7));
  auto seven = ComputeSlotMapping(row, 7, 5, 4);
  ASSERT_TRUE(seven.ok());
  EXPECT_THAT(*seven, ElementsAre(9 * 7 + 5, 9 * 7 + 6, 2 * 7 + 0, 2 * 7 + 1));
}

TEST(SlotMappingTest, LargeIdsDoNotOverflow) {
  const std::vector<int32_t> row = {2000000000};
  auto slots = ComputeSlotMapping(row, 16, 15, 1);
  ASSERT_TRUE(slots.ok());
  EXPECT_THAT(*slots, ElementsAre(int64_t{2000000000} * 16 + 15));
}

TEST(SlotMappingTest, ZeroTokens) {
  auto slots = ComputeSlotMapping({}, 16, 0, 0);
  ASSERT_TRUE(slots.ok());
  EXPECT_TRUE(slots->empty());
}

TEST(SlotMappingTest, PositionPastTheRowIsOutOfRange) {
  const std::vector<int32_t> row = {1, 2};
  auto slots = ComputeSlotMapping(row, 4, 6, 3);  // position 8 needs a third block
  ASSERT_FALSE(slots.ok());
  EXPECT_EQ(slots.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(slots.status().message(), HasSubstr("position 8"));
  EXPECT_TRUE(ComputeSlotMapping(row, 4, 6, 2).ok());  // position 7 is the last one
}

TEST(SlotMappingTest, BadArguments) {
  const std::vector<int32_t> row = {1, 2};
  EXPECT_EQ(ComputeSlotMapping(row, 0, 0, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeSlotMapping(row, -4, 0, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeSlotMapping(row, 4, -1, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeSlotMapping(row, 4, 0, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<int32_t> negative = {1, -1};
  auto bad = ComputeSlotMapping(negative, 4, 0, 6);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("-1"));
  // A negative id in a block the tokens do not reach is not looked at.
  EXPECT_TRUE(ComputeSlotMapping(negative, 4, 0, 4).ok());
}

TEST(ValidateSlotMappingTest, AcceptsPaddingAndInRangeSlots) {
  const std::vector<int64_t> slots = {0, -1, 63, 17, -1};
  EXPECT_TRUE(ValidateSlotMapping(slots, 4, 16).ok());
  EXPECT_TRUE(ValidateSlotMapping({}, 0, 16).ok());
}

TEST(ValidateSlotMappingTest, NamesTheFirstBadTokenAndSlot) {
  const std::vector<int64_t> too_big = {0, -1, 64, 70};
  absl::Status s = ValidateSlotMapping(too_big, 4, 16);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("token 2"));
  EXPECT_THAT(s.message(), HasSubstr("slot 64"));
  EXPECT_THAT(s.message(), HasSubstr("[0, 64)"));

  const std::vector<int64_t> below = {3, -2};
  s = ValidateSlotMapping(below, 4, 16);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("token 1"));
  EXPECT_THAT(s.message(), HasSubstr("slot -2"));
}

TEST(ValidateSlotMappingTest, BadCacheSize) {
  const std::vector<int64_t> slots = {0};
  EXPECT_EQ(ValidateSlotMapping(slots, 4, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSlotMapping(slots, -1, 16).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSlotMapping(slots, 0, 16).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstream
