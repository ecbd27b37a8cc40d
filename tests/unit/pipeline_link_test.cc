// Tests of the pipeline stage link: frames decoded strictly, stages joined over TCP through
// rendezvous files, the errors of a wrong or missing neighbour, and a link to a hand-played
// neighbour that sends partial, oversized or late frames.
#include "kvstream/serving/pipeline_link.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "absl/time/clock.h"
#include "kvstream/common/byte_io.h"
#include "kvstream/transfer/socket.h"
#include "tests/testing/temp_dir.h"

// The largest single allocation made by a thread while it tracks them, to check that Receive
// does not allocate what a peer merely announces. Replacing the global operator new is the
// one way to see allocations made inside the library; under ThreadSanitizer, whose runtime
// defines operator new itself (a second definition does not link), its allocator hook sees
// the same allocations.
namespace {
thread_local bool tracking_allocations = false;
std::atomic<size_t> largest_allocation{0};

void NoteAllocation(size_t n) {
  if (tracking_allocations) {
    size_t seen = largest_allocation.load();
    while (n > seen && !largest_allocation.compare_exchange_weak(seen, n)) {
    }
  }
}
}  // namespace

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVSTREAM_TEST_ALLOCATOR_HOOK 1
#endif
#endif
#ifdef KVSTREAM_TEST_ALLOCATOR_HOOK
#include <sanitizer/allocator_interface.h>
namespace {
void OnMalloc(const volatile void*, size_t n) { NoteAllocation(n); }
void OnFree(const volatile void*) {}
[[maybe_unused]] const int kAllocatorHookInstalled = __sanitizer_install_malloc_and_free_hooks(OnMalloc, OnFree);
}  // namespace
#else
void* operator new(std::size_t n) {
  NoteAllocation(n);
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
// Out of line: inlined into a caller, GCC pairs the free() with the caller's operator new
// and warns of a mismatch (-Wmismatched-new-delete), though the two are replaced together.
__attribute__((noinline)) void operator delete(void* p) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#endif

namespace kvstream {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

// Tracks the largest allocation of this thread while in scope.
class AllocationTracker {
 public:
  AllocationTracker() {
    largest_allocation = 0;
    tracking_allocations = true;
  }
  ~AllocationTracker() { tracking_allocations = false; }
  size_t largest() const { return largest_allocation.load(); }
};

std::string FrameHeader(uint64_t payload_len) {
  std::string out;
  ByteWriter w(&out);
  w.U32(0x4650564B);  // "KVPF"
  w.U64(payload_len);
  return out;
}

std::string Frame(const StageMessage& m) {
  absl::StatusOr<std::string> payload = EncodeStageMessage(m);
  EXPECT_TRUE(payload.ok()) << payload.status();
  return FrameHeader(payload->size()) + *payload;
}

// A payload with no values and one error of `code` for request "r", built by hand so that it
// can carry codes the encoder refuses.
std::string PayloadWithCode(uint32_t code) {
  std::string out;
  ByteWriter w(&out);
  w.U64(1);  // step
  w.U64(2);  // schedule
  w.U64(0);  // values
  w.U32(1);  // errors
  w.U32(1);
  w.Raw("r");
  w.U32(code);
  w.U32(0);  // message
  return out;
}

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

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
  absl::StatusOr<std::string> encoded = EncodeStageMessage(m);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  const std::string& frame = *encoded;
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
}

// The wire format, byte for byte: little-endian integers, floats as 4-byte IEEE-754, u32
// length-prefixed strings. Stages of different builds must keep agreeing on it.
TEST(StageMessageTest, WireFormatIsPinned) {
  StageMessage m;
  m.step = 7;
  m.schedule = 0x0123456789abcdefull;
  m.values = {1.5f, -2.0f};
  m.errors = {{"r", 4, "m"}};
  absl::StatusOr<std::string> encoded = EncodeStageMessage(m);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  const std::string want =
      "0700000000000000"  // step
      "efcdab8967452301"  // schedule
      "0200000000000000"  // value count
      "0000c03f"          // 1.5f
      "000000c0"          // -2.0f
      "01000000"          // error count
      "0100000072"        // request id "r"
      "04000000"          // code (DeadlineExceeded)
      "010000006d";       // message "m"
  EXPECT_EQ(absl::BytesToHexString(*encoded), want);
  auto back = DecodeStageMessage(absl::HexStringToBytes(want));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->values, m.values);
  EXPECT_EQ(back->errors[0].message, "m");
}

// Every bound of a payload is checked, and the message names what was wrong.
TEST(StageMessageTest, OutOfBoundsFieldsAreNamed) {
  std::string out;
  ByteWriter w(&out);
  w.U64(1);
  w.U64(2);
  w.U64(0);
  w.U32(1);
  w.U32(kMaxStageRequestIdBytes + 1);  // request id length over the limit
  out += std::string(kMaxStageRequestIdBytes + 1, 'x') + std::string(8, '\0');
  absl::StatusOr<StageMessage> back = DecodeStageMessage(out);
  EXPECT_EQ(back.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(back.status().message(), HasSubstr("error 0: request id length 257 exceeds"));

  out.clear();
  w.U64(1);
  w.U64(2);
  w.U64(0);
  w.U32(1);
  w.U32(1);
  out += "r";
  w.U32(4);
  w.U32(kMaxStageErrorMessageBytes + 1);  // message length over the limit
  out += std::string(kMaxStageErrorMessageBytes + 1, 'm');
  back = DecodeStageMessage(out);
  EXPECT_THAT(back.status().message(), HasSubstr("error 0: error message length 4097 exceeds"));

  // An error count the remaining bytes could not hold is refused before any is decoded.
  out.clear();
  w.U64(1);
  w.U64(2);
  w.U64(0);
  w.U32(1000);
  out += std::string(11 * 1000, '\0');
  back = DecodeStageMessage(out);
  EXPECT_THAT(back.status().message(), HasSubstr("error count 1000 runs past the end"));
}

TEST(StageMessageTest, RequestIdsOverTheLimitAreRefusedNotTruncated) {
  StageMessage m = Sample();
  m.errors[1].request_id = std::string(kMaxStageRequestIdBytes + 1, 'x');
  absl::StatusOr<std::string> encoded = EncodeStageMessage(m);
  EXPECT_EQ(encoded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(encoded.status().message(), HasSubstr("257 bytes, over the limit of 256"));

  m.errors[1].request_id = std::string(kMaxStageRequestIdBytes, 'x');
  encoded = EncodeStageMessage(m);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  auto back = DecodeStageMessage(*encoded);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->errors[1].request_id, m.errors[1].request_id);
}

TEST(StageMessageTest, LongErrorMessagesAreTruncated) {
  StageMessage m = Sample();
  m.errors[0].message = std::string(kMaxStageErrorMessageBytes, 'a') + "tail";
  absl::StatusOr<std::string> encoded = EncodeStageMessage(m);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  auto back = DecodeStageMessage(*encoded);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->errors[0].message, std::string(kMaxStageErrorMessageBytes, 'a'));
}

TEST(StageMessageTest, OnlyErrorCodesTravel) {
  for (int32_t code : {0, -1, 17}) {
    StageMessage m = Sample();
    m.errors[0].code = code;
    absl::StatusOr<std::string> encoded = EncodeStageMessage(m);
    EXPECT_EQ(encoded.status().code(), absl::StatusCode::kInvalidArgument) << code;
    EXPECT_THAT(encoded.status().message(), HasSubstr("not an error code")) << code;
  }
  for (uint32_t code : {0u, 17u, 0xffffffffu}) {
    absl::StatusOr<StageMessage> back = DecodeStageMessage(PayloadWithCode(code));
    EXPECT_EQ(back.status().code(), absl::StatusCode::kInvalidArgument) << code;
    EXPECT_THAT(back.status().message(), HasSubstr(absl::StrCat("has code ", code))) << code;
  }
  for (uint32_t code : {1u, 16u}) {
    absl::StatusOr<StageMessage> back = DecodeStageMessage(PayloadWithCode(code));
    ASSERT_TRUE(back.ok()) << code << ": " << back.status();
    EXPECT_EQ(back->errors[0].code, static_cast<int32_t>(code));
  }
}

class StageLinkTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(dir_.ok()); }
  std::string Prefix() const { return dir_.path() + "/stages"; }
  StageChannelOptions Options(int stage, int num_stages, absl::Duration timeout) const {
    StageChannelOptions o;
    o.stage = stage;
    o.num_stages = num_stages;
    o.rendezvous = Prefix();
    o.timeout = timeout;
    return o;
  }

  // Connects stage 0 of 2 to a stage 1 played by hand through peer_, a blocking socket with
  // a 2 s receive timeout, so that a test controls every byte stage 0 receives.
  std::unique_ptr<StageChannel> ConnectToHandPlayedStage(
      uint64_t max_frame_bytes = StageChannelOptions().max_frame_bytes) {
    absl::StatusOr<ScopedFd> listener = ListenTcp("127.0.0.1", 0);
    EXPECT_TRUE(listener.ok()) << listener.status();
    if (!listener.ok()) return nullptr;
    absl::StatusOr<uint16_t> port = BoundTcpPort(listener->get());
    EXPECT_TRUE(port.ok()) << port.status();
    std::ofstream(Prefix() + ".pp1") << "127.0.0.1:" << port.value_or(0) << "\n";

    absl::StatusOr<std::unique_ptr<StageChannel>> channel = absl::UnknownError("unset");
    StageChannelOptions o = Options(0, 2, absl::Seconds(10));
    o.max_frame_bytes = max_frame_bytes;
    std::thread connect([&] { channel = ConnectStages(o); });
    absl::StatusOr<AcceptedSocket> accepted =
        AcceptSocket(listener->get(), absl::Now() + absl::Seconds(10), "hand-played stage 1");
    EXPECT_TRUE(accepted.ok()) << accepted.status();
    if (accepted.ok()) {
      EXPECT_TRUE(SetNonBlocking(accepted->fd.get(), false).ok());
      peer_ = accepted->fd.release();
    }
    listener->Reset();
    const timeval two_seconds{2, 0};
    setsockopt(peer_, SOL_SOCKET, SO_RCVTIMEO, &two_seconds, sizeof(two_seconds));
    // Stage 0's hello, byte for byte: "KVPH", version 2, stage 0 of 2, an empty group key.
    std::string hello(20, '\0');
    EXPECT_EQ(recv(peer_, hello.data(), hello.size(), MSG_WAITALL), 20);
    EXPECT_EQ(absl::BytesToHexString(hello), "4b565048020000000000000002000000" "00000000");
    hello.clear();
    ByteWriter w(&hello);
    w.U32(0x4850564B);  // "KVPH"
    w.U32(2);           // version
    w.U32(1);           // stage 1
    w.U32(2);           // of 2
    w.U32(0);           // group key: empty, as stage 0's
    Write(hello);
    connect.join();
    EXPECT_TRUE(channel.ok()) << channel.status();
    return channel.ok() ? std::move(*channel) : nullptr;
  }
  // Writes to the hand-played stage's socket; errors (the link closed) are ignored.
  void Write(const std::string& bytes) {
    size_t off = 0;
    while (off < bytes.size()) {
      const ssize_t n = send(peer_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return;
      off += static_cast<size_t>(n);
    }
  }
  // True when the hand-played stage sees its link closed within 2 s.
  bool PeerSeesClose() {
    char c;
    const ssize_t n = recv(peer_, &c, 1, 0);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
  }

  TempDir dir_;
  int peer_ = -1;
};

TEST_F(StageLinkTest, DeadlineBeforeAFrameBeginsLeavesTheLinkIntact) {
  std::unique_ptr<StageChannel> ch = ConnectToHandPlayedStage();
  ASSERT_NE(ch, nullptr);
  absl::StatusOr<StageMessage> early = ch->ReceiveBackward(absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(early.status().message(), HasSubstr("intact"));
  Write(Frame(Sample()));
  absl::StatusOr<StageMessage> later = ch->ReceiveBackward(absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_EQ(later->step, 7u);

  absl::Status late = ch->SendForward(Sample(), absl::Now() - absl::Seconds(1));
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(ch->SendForward(Sample(), absl::Now() + absl::Seconds(5)).ok());
  const std::string want = Frame(Sample());
  std::string got(want.size(), '\0');
  ASSERT_EQ(recv(peer_, got.data(), got.size(), MSG_WAITALL), static_cast<ssize_t>(want.size()));
  EXPECT_EQ(got, want);
  close(peer_);
}

TEST_F(StageLinkTest, DeadlineInTheMiddleOfAFrameBreaksTheLink) {
  std::unique_ptr<StageChannel> ch = ConnectToHandPlayedStage();
  ASSERT_NE(ch, nullptr);
  StageMessage m = Sample();
  m.values.assign(1000, 0.5f);
  const std::string frame = Frame(m);
  Write(frame.substr(0, frame.size() / 2));
  absl::StatusOr<StageMessage> cut = ch->ReceiveBackward(absl::Now() + absl::Milliseconds(200));
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(cut.status().message(), HasSubstr("the link is closed"));
  EXPECT_TRUE(PeerSeesClose());

  // The rest of the frame and a whole one arrive too late: the stream is out of step, and
  // the link says why instead of parsing payload bytes as a header.
  Write(frame.substr(frame.size() / 2) + Frame(Sample()));
  absl::StatusOr<StageMessage> after = ch->ReceiveBackward(absl::Now() + absl::Seconds(2));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(after.status().message(), HasSubstr("earlier failure"));
  EXPECT_THAT(after.status().message(), HasSubstr("deadline exceeded"));
  absl::Status send = ch->SendForward(Sample(), absl::Now() + absl::Seconds(2));
  EXPECT_EQ(send.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(send.message(), HasSubstr("earlier failure"));
  close(peer_);
}

TEST_F(StageLinkTest, DeadlineInTheMiddleOfAHeaderBreaksTheLink) {
  std::unique_ptr<StageChannel> ch = ConnectToHandPlayedStage();
  ASSERT_NE(ch, nullptr);
  const std::string frame = Frame(Sample());
  Write(frame.substr(0, 5));
  EXPECT_EQ(ch->ReceiveBackward(absl::Now() + absl::Milliseconds(100)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  Write(frame.substr(5));
  EXPECT_EQ(ch->ReceiveBackward(absl::Now() + absl::Seconds(2)).status().code(),
            absl::StatusCode::kUnavailable);
  close(peer_);
}

TEST_F(StageLinkTest, SendCutShortByItsDeadlineBreaksTheLink) {
  std::unique_ptr<StageChannel> ch = ConnectToHandPlayedStage();
  ASSERT_NE(ch, nullptr);
  // The hand-played stage reads nothing, and its receive buffer is held small, so 16 MiB
  // is more than the two socket buffers hold. The deadline is long enough for the frame to
  // be encoded on a loaded machine (a deadline passed before the first byte leaves the link
  // intact, another test's case): it always expires in the middle of the frame.
  const int small = 64 << 10;
  ASSERT_EQ(setsockopt(peer_, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)), 0);
  StageMessage big;
  big.values.assign(size_t{4} << 20, 1.0f);
  absl::Status cut = ch->SendForward(big, absl::Now() + absl::Seconds(2));
  EXPECT_EQ(cut.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(cut.message(), HasSubstr("the link is closed"));
  absl::Status next = ch->SendForward(Sample(), absl::Now() + absl::Seconds(2));
  EXPECT_EQ(next.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(next.message(), HasSubstr("earlier failure"));
  EXPECT_EQ(ch->ReceiveBackward(absl::Now() + absl::Seconds(2)).status().code(),
            absl::StatusCode::kUnavailable);
  close(peer_);
}

TEST_F(StageLinkTest, FramesOverTheLimitAreRefused) {
  std::unique_ptr<StageChannel> ch = ConnectToHandPlayedStage(/*max_frame_bytes=*/1 << 20);
  ASSERT_NE(ch, nullptr);
  StageMessage big;
  big.values.assign(300000, 1.0f);
  absl::Status refused = ch->SendForward(big, absl::Now() + absl::Seconds(2));
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("1200028 bytes"));
  EXPECT_THAT(refused.message(), HasSubstr("limit of 1048576"));
  StageMessage long_id = Sample();
  long_id.errors[0].request_id = std::string(300, 'i');
  EXPECT_EQ(ch->SendForward(long_id, absl::Now() + absl::Seconds(2)).code(),
            absl::StatusCode::kInvalidArgument);
  // Nothing of either was written: the link carries the next message intact.
  ASSERT_TRUE(ch->SendForward(Sample(), absl::Now() + absl::Seconds(2)).ok());
  const std::string want = Frame(Sample());
  std::string got(want.size(), '\0');
  ASSERT_EQ(recv(peer_, got.data(), got.size(), MSG_WAITALL), static_cast<ssize_t>(want.size()));
  EXPECT_EQ(got, want);

  Write(FrameHeader(2 << 20));
  absl::StatusOr<StageMessage> announced = ch->ReceiveBackward(absl::Now() + absl::Seconds(5));
  EXPECT_EQ(announced.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(announced.status().message(), HasSubstr("announces 2097152 bytes"));
  EXPECT_THAT(announced.status().message(), HasSubstr("limit of 1048576"));
  EXPECT_EQ(ch->ReceiveBackward(absl::Now() + absl::Seconds(2)).status().code(),
            absl::StatusCode::kUnavailable);
  close(peer_);
}

TEST_F(StageLinkTest, AnnouncedLengthsAreNotAllocatedUpFront) {
  {
    // Over the default limit: refused at once, before any payload buffer.
    std::unique_ptr<StageChannel> ch = ConnectToHandPlayedStage();
    ASSERT_NE(ch, nullptr);
    Write(FrameHeader(uint64_t{512} << 20));
    AllocationTracker allocations;
    absl::StatusOr<StageMessage> m = ch->ReceiveBackward(absl::Now() + absl::Seconds(2));
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_LT(allocations.largest(), size_t{1} << 20);
    close(peer_);
  }
  unlink((Prefix() + ".pp1").c_str());
  {
    // Under the limit but stalling after 64 KiB: the buffer stays near what arrived.
    std::unique_ptr<StageChannel> ch = ConnectToHandPlayedStage();
    ASSERT_NE(ch, nullptr);
    Write(FrameHeader(uint64_t{200} << 20) + std::string(64 << 10, '\0'));
    AllocationTracker allocations;
    absl::StatusOr<StageMessage> m = ch->ReceiveBackward(absl::Now() + absl::Milliseconds(300));
    EXPECT_EQ(m.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_LT(allocations.largest(), size_t{16} << 20);
    close(peer_);
  }
}

TEST_F(StageLinkTest, InfiniteDeadlineWaitsWithoutSpinning) {
  std::unique_ptr<StageChannel> ch = ConnectToHandPlayedStage();
  ASSERT_NE(ch, nullptr);
  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(150));
    Write(Frame(Sample()));
  });
  const double cpu_before = ThreadCpuSeconds();
  absl::StatusOr<StageMessage> m = ch->ReceiveBackward(absl::InfiniteFuture());
  const double cpu = ThreadCpuSeconds() - cpu_before;
  late.join();
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->step, 7u);
  EXPECT_LT(cpu, 0.05) << "the wait spun";
  EXPECT_TRUE(ch->SendForward(Sample(), absl::InfiniteFuture()).ok());
  close(peer_);
}

TEST_F(StageLinkTest, ThreeStagesPassMessagesBothWays) {
  std::vector<absl::StatusOr<std::unique_ptr<StageChannel>>> ch;
  for (int s = 0; s < 3; ++s) ch.emplace_back(absl::UnknownError("unset"));
  std::vector<std::thread> threads;
  for (int s = 0; s < 3; ++s) {
    threads.emplace_back([&, s] { ch[s] = ConnectStages(Options(s, 3, absl::Seconds(20))); });
  }
  for (std::thread& t : threads) t.join();
  for (int s = 0; s < 3; ++s) ASSERT_TRUE(ch[s].ok()) << s << ": " << ch[s].status();
  // Connected stages leave no rendezvous file behind for a later job to misread.
  for (const char* suffix : {".pp1", ".pp2"}) {
    EXPECT_NE(access((Prefix() + suffix).c_str(), F_OK), 0) << suffix << " is still there";
  }
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

TEST_F(StageLinkTest, StagesOfAnotherGroupAreRejected) {
  absl::StatusOr<std::unique_ptr<StageChannel>> first = absl::UnknownError("unset");
  absl::StatusOr<std::unique_ptr<StageChannel>> last = absl::UnknownError("unset");
  StageChannelOptions a = Options(0, 2, absl::Seconds(20));
  a.group_key = "engine kvs-decode0; job one";
  StageChannelOptions b = Options(1, 2, absl::Seconds(20));
  b.group_key = "engine kvs-decode0; job two";
  std::thread t0([&] { first = ConnectStages(a); });
  std::thread t1([&] { last = ConnectStages(b); });
  t0.join();
  t1.join();
  EXPECT_EQ(last.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(last.status().message(),
              HasSubstr("stage 0 belongs to group 'engine kvs-decode0; job one', this stage to "
                        "'engine kvs-decode0; job two'"));
  EXPECT_FALSE(first.ok());

  // Equal keys connect; a key over the limit is refused before anything is published.
  b.group_key = a.group_key;
  std::thread t2([&] { first = ConnectStages(a); });
  std::thread t3([&] { last = ConnectStages(b); });
  t2.join();
  t3.join();
  EXPECT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(last.ok()) << last.status();
  StageChannelOptions long_key = Options(1, 2, absl::Seconds(1));
  long_key.group_key.assign(kMaxStageGroupKeyBytes + 1, 'k');
  const auto refused = ConnectStages(long_key);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("group key"));
}

TEST_F(StageLinkTest, MissingNeighbourIsADeadline) {
  auto alone = ConnectStages(Options(0, 2, absl::Milliseconds(300)));
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(alone.status().message(), HasSubstr(".pp1"));
  // A later stage whose previous stage never connects stops at its deadline too, naming
  // what it waited for.
  auto last_alone = ConnectStages(Options(1, 2, absl::Milliseconds(300)));
  EXPECT_EQ(last_alone.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(last_alone.status().message(), HasSubstr("waiting for stage 0"));
  EXPECT_EQ(ConnectStages(Options(2, 2, absl::Seconds(1))).status().code(),
            absl::StatusCode::kInvalidArgument);
  StageChannelOptions no_path = Options(0, 2, absl::Seconds(1));
  no_path.rendezvous.clear();
  EXPECT_EQ(ConnectStages(no_path).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstream
