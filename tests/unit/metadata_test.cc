// Tests of AttentionMetadata: building mixed batches and rejecting inconsistent ones.
#include "kvstream/attention/metadata.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvstream {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(BuildAttentionMetadataTest, MixedBatchOfPrefillChunkedPrefillAndDecode) {
  // block size 4: prefill of 6 tokens, chunked prefill of 3 after 5 cached, decode at 9.
  auto md = BuildAttentionMetadata({{0, 6, {7, 2}},
                                    {5, 3, {1, 4}},
                                    {9, 1, {0, 3, 5}}},
                                   /*block_size=*/4, /*num_padding_tokens=*/2);
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_THAT(md->query_start_loc, ElementsAre(0, 6, 9, 10));
  EXPECT_THAT(md->seq_lens, ElementsAre(6, 8, 10));
  EXPECT_EQ(md->max_blocks_per_seq, 3);
  EXPECT_THAT(md->block_table, ElementsAre(7, 2, 0, 1, 4, 0, 0, 3, 5));
  // seq 0: positions 0..5 -> blocks 7,7,7,7,2,2; seq 1: positions 5..7 -> block 4 offsets 1..3;
  // seq 2: position 9 -> block 5 offset 1; then two padding slots.
  EXPECT_THAT(md->slot_mapping,
              ElementsAre(28, 29, 30, 31, 8, 9, 17, 18, 19, 21, -1, -1));
  EXPECT_EQ(md->num_actual_tokens, 10);
  EXPECT_EQ(md->max_query_len, 6);
  EXPECT_EQ(md->max_seq_len, 10);
  EXPECT_EQ(md->query_len(1), 3);
  EXPECT_THAT(md->block_row(2), ElementsAre(0, 3, 5));
  EXPECT_TRUE(md->Validate(4, 8).ok());
}

TEST(BuildAttentionMetadataTest, RejectsBadSchedules) {
  EXPECT_EQ(BuildAttentionMetadata({}, 16).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildAttentionMetadata({{0, 0, {0}}}, 16)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // 17 tokens do not fit one block of 16.
  EXPECT_EQ(BuildAttentionMetadata({{10, 7, {0}}}, 16)
                .status()
                .code(),
            absl::StatusCode::kOutOfRange);
}

class ValidateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto md = BuildAttentionMetadata({{0, 5, {1, 2}},
                                      {3, 1, {0}}},
                                     4);
    ASSERT_TRUE(md.ok());
    md_ = *md;
    ASSERT_TRUE(md_.Validate(4, 3).ok());
  }
  AttentionMetadata md_;
};

TEST_F(ValidateTest, BlockOutOfRangeNamesSequenceAndBlock) {
  md_.block_table[1] = 9;
  absl::Status s = md_.Validate(4, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("sequence 0"));
  EXPECT_THAT(s.message(), HasSubstr("block 9"));
}

TEST_F(ValidateTest, NegativeBlockRejected) {
  md_.block_table[2] = -3;
  EXPECT_EQ(md_.Validate(4, 3).code(), absl::StatusCode::kOutOfRange);
}

TEST_F(ValidateTest, SlotOutOfRangeRejected) {
  md_.slot_mapping[2] = 12;  // 3 blocks of 4 -> slots 0..11
  EXPECT_FALSE(md_.Validate(4, 3).ok());
  md_.slot_mapping[2] = -2;
  EXPECT_FALSE(md_.Validate(4, 3).ok());
}

TEST_F(ValidateTest, QueryLongerThanSequenceRejected) {
  md_.seq_lens[0] = 4;
  absl::Status s = md_.Validate(4, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("sequence 0"));
}

TEST_F(ValidateTest, TooFewBlocksForSeqLen) {
  md_.seq_lens[1] = 9;  // needs 3 blocks, row has 2
  md_.max_seq_len = 9;
  EXPECT_EQ(md_.Validate(4, 3).code(), absl::StatusCode::kOutOfRange);
}

TEST_F(ValidateTest, InconsistentSizesRejected) {
  AttentionMetadata m = md_;
  m.query_start_loc.pop_back();
  EXPECT_EQ(m.Validate(4, 3).code(), absl::StatusCode::kInvalidArgument);
  m = md_;
  m.query_start_loc = {0, 5, 4};
  EXPECT_EQ(m.Validate(4, 3).code(), absl::StatusCode::kInvalidArgument);
  m = md_;
  m.max_query_len = 1;
  EXPECT_EQ(m.Validate(4, 3).code(), absl::StatusCode::kInvalidArgument);
  m = md_;
  m.num_actual_tokens = 7;
  EXPECT_EQ(m.Validate(4, 3).code(), absl::StatusCode::kInvalidArgument);
  m = md_;
  m.block_table.pop_back();
  EXPECT_EQ(m.Validate(4, 3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(md_.Validate(0, 3).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstream
