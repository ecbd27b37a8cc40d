// Tests of the pipeline stage link: frames decoded strictly, stages joined over TCP through
// rendezvous files, and the errors of a wrong or missing neighbour.
#include "launch/pipeline_link.h"

#include <stdlib.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"

namespace kvstream {
namespace {

using ::testing::HasSubstr;

StageMessage Sample() {
  StageMessage m;
  m.step = 7;
  m.schedule = 0x0123456789abcdefull;
  m.values = {1.5f, -0.0f, 3e-38f, 65504.0f};
  m.errors = {{"req-1", 4, "layer 'model.layers.3.self_attn.attn' did not arrive"},
              {"req-2", 14, ""}};
  return m;
}

TEST(StageMessageTest, RoundTripAndStrictDecoding) {
  const StageMessage m = Sample();
  const std::string frame = EncodeStageMessage(m);
  auto back = DecodeStageMessage(frame);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->step, m.step);
  EXPECT_EQ(back->schedule, m.schedule);
  EXPECT_EQ(back->values, m.values);
  ASSERT_EQ(back->errors.size(), 2u);
  EXPECT_EQ(back->errors[0].request_id, "req-1");
  EXPECT_EQ(back->errors[0].code, 4);
  EXPECT_EQ(back->errors[0].message, m.errors[0].message);
  EXPECT_EQ(back->errors[1].code, 14);

  for (size_t cut = 0; cut < frame.size(); ++cut) {
    EXPECT_EQ(DecodeStageMessage(frame.substr(0, cut)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << cut;
  }
  EXPECT_THAT(DecodeStageMessage(frame + "x").status().message(), HasSubstr("trailing"));
  std::string huge = frame;
  huge[16 + 7] = '\x7f';  // the value count's top byte
  EXPECT_THAT(DecodeStageMessage(huge).status().message(), HasSubstr("past the end"));
  StageMessage bad_code = Sample();
  bad_code.errors[0].code = 17;
  EXPECT_EQ(DecodeStageMessage(EncodeStageMessage(bad_code)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

class StageLinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/kvstream-stage-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override {
    for (const char* suffix : {".pp1", ".pp2"}) unlink((Prefix() + suffix).c_str());
    rmdir(dir_.c_str());
  }
  std::string Prefix() const { return dir_ + "/stages"; }
  StageChannelOptions Options(int stage, int num_stages, absl::Duration timeout) const {
    StageChannelOptions o;
    o.stage = stage;
    o.num_stages = num_stages;
    o.rendezvous = Prefix();
    o.timeout = timeout;
    return o;
  }

  std::string dir_;
};

TEST_F(StageLinkTest, ThreeStagesPassMessagesBothWays) {
  std::vector<absl::StatusOr<std::unique_ptr<StageChannel>>> ch;
  for (int s = 0; s < 3; ++s) ch.emplace_back(absl::UnknownError("unset"));
  std::vector<std::thread> threads;
  for (int s = 0; s < 3; ++s) {
    threads.emplace_back([&, s] { ch[s] = ConnectStages(Options(s, 3, absl::Seconds(20))); });
  }
  for (std::thread& t : threads) t.join();
  for (int s = 0; s < 3; ++s) ASSERT_TRUE(ch[s].ok()) << s << ": " << ch[s].status();
  EXPECT_EQ((*ch[1])->stage(), 1);
  EXPECT_EQ((*ch[1])->num_stages(), 3);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);

  StageMessage m = Sample();
  m.values.assign(100000, 0.25f);  // larger than a socket buffer
  ASSERT_TRUE((*ch[0])->SendForward(m, deadline).ok());
  auto at1 = (*ch[1])->ReceiveForward(deadline);
  ASSERT_TRUE(at1.ok()) << at1.status();
  EXPECT_EQ(at1->values, m.values);
  at1->step = 8;
  ASSERT_TRUE((*ch[1])->SendForward(*at1, deadline).ok());
  auto at2 = (*ch[2])->ReceiveForward(deadline);
  ASSERT_TRUE(at2.ok()) << at2.status();
  EXPECT_EQ(at2->step, 8u);
  StageMessage back;
  back.step = 9;
  back.values = {42.0f};
  ASSERT_TRUE((*ch[2])->SendBackward(back, deadline).ok());
  auto b1 = (*ch[1])->ReceiveBackward(deadline);
  ASSERT_TRUE(b1.ok()) << b1.status();
  ASSERT_TRUE((*ch[1])->SendBackward(*b1, deadline).ok());
  auto b0 = (*ch[0])->ReceiveBackward(deadline);
  ASSERT_TRUE(b0.ok()) << b0.status();
  EXPECT_EQ(b0->step, 9u);
  EXPECT_EQ(b0->values, std::vector<float>{42.0f});

  // The ends have no neighbour on one side; a wait with nothing coming ends at its deadline.
  EXPECT_EQ((*ch[0])->SendBackward(back, deadline).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*ch[2])->ReceiveBackward(deadline).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*ch[1])->ReceiveForward(absl::Now() + absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);

  // A stage that goes away is seen by its neighbour.
  ch[2]->reset();
  EXPECT_EQ((*ch[1])->ReceiveBackward(deadline).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(StageLinkTest, StagesThatDisagreeOnThePipelineSizeAreRejected) {
  absl::StatusOr<std::unique_ptr<StageChannel>> first = absl::UnknownError("unset");
  absl::StatusOr<std::unique_ptr<StageChannel>> last = absl::UnknownError("unset");
  std::thread t0([&] { first = ConnectStages(Options(0, 3, absl::Seconds(20))); });
  std::thread t1([&] { last = ConnectStages(Options(1, 2, absl::Seconds(20))); });
  t0.join();
  t1.join();
  EXPECT_EQ(last.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(last.status().message(), HasSubstr("expected stage 0 of 2, got stage 0 of 3"));
  EXPECT_FALSE(first.ok());
}

TEST_F(StageLinkTest, MissingNeighbourIsADeadline) {
  auto alone = ConnectStages(Options(0, 2, absl::Milliseconds(300)));
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(alone.status().message(), HasSubstr(".pp1"));
  EXPECT_EQ(ConnectStages(Options(2, 2, absl::Seconds(1))).status().code(),
            absl::StatusCode::kInvalidArgument);
  StageChannelOptions no_path = Options(0, 2, absl::Seconds(1));
  no_path.rendezvous.clear();
  EXPECT_EQ(ConnectStages(no_path).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstream
