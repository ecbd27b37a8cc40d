// DeviceChecksummer against Kvsum64Host over the same bytes: random spans of random lengths
// 1 .. 100000 at random odd offsets, tiny spans that share words, empty inputs, 20000
// block-sized spans (a layer's K runs then V runs), results into pinned, registered and
// device memory, many calls in flight on one stream and on two, a staging ring that wraps
// and runs out (ResourceExhausted, then usable again once the work completed), tables
// larger than a ring's per-call share and larger than the whole ring, the in-flight limit,
// and rejected arguments. Both ways of copying the table (internal stream, caller's
// stream). Skips, saying why, where no GPU can be used.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gpu_test_util.h"
#include "kvstream/cache/layer_checksum.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace {

using ::kvstream::gpu_test::ToDevice;
using ::kvstream::gpu_test::ToHost;
using TableCopy = DeviceChecksummer::TableCopy;

constexpr absl::Duration kWait = absl::Seconds(60);

// Random bytes on the host and the same bytes on the device; spans are (offset, length)
// pairs into both.
struct Mirror {
  std::vector<uint8_t> host;
  DeviceBuffer device;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;

  std::vector<ChecksumSpan> HostSpans() const {
    std::vector<ChecksumSpan> spans;
    for (const auto& [offset, length] : ranges) spans.push_back({host.data() + offset, length});
    return spans;
  }
  std::vector<ChecksumSpan> DeviceSpans() const {
    std::vector<ChecksumSpan> spans;
    for (const auto& [offset, length] : ranges) {
      spans.push_back({device.data_as<uint8_t>() + offset, length});
    }
    return spans;
  }
};

absl::Status Upload(Mirror& m, uint32_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i + 8 <= m.host.size(); i += 8) {
    const uint64_t w = rng();
    std::memcpy(&m.host[i], &w, 8);
  }
  for (size_t i = m.host.size() & ~size_t{7}; i < m.host.size(); ++i) {
    m.host[i] = static_cast<uint8_t>(rng());
  }
  ASSIGN_OR_RETURN(m.device, ToDevice(m.host.data(), m.host.size()));
  return absl::OkStatus();
}

// `count` spans of lengths from `length`, at offsets from `gap` past the previous span's
// end (odd gaps: odd offsets), in shuffled order.
template <typename LengthFn, typename GapFn>
Mirror MakeMirror(int count, uint32_t seed, LengthFn length, GapFn gap) {
  std::mt19937 rng(seed);
  Mirror m;
  uint64_t at = 0;
  for (int i = 0; i < count; ++i) {
    at += gap(rng);
    const uint64_t len = length(rng);
    m.ranges.emplace_back(at, len);
    at += len;
  }
  m.host.resize(at + 16);
  std::shuffle(m.ranges.begin(), m.ranges.end(), rng);
  return m;
}

// Blocks a stream from the host until released (or 20 s passed): a host function that
// waits on a flag, so that work queued behind it is deterministically pending. The flag
// lives in state the host function owns a reference to, so it may run after this object
// is gone.
class StreamHold {
 public:
  static absl::StatusOr<std::unique_ptr<StreamHold>> Create(void* stream) {
    auto released = std::make_shared<std::atomic<bool>>(false);
    auto* arg = new std::shared_ptr<std::atomic<bool>>(released);
    const cudaError_t e = cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), &Wait, arg);
    if (e != cudaSuccess) {
      delete arg;
      return CudaErrorToStatus(static_cast<int>(e), "cudaLaunchHostFunc");
    }
    return std::unique_ptr<StreamHold>(new StreamHold(std::move(released)));
  }
  ~StreamHold() { released_->store(true); }

 private:
  explicit StreamHold(std::shared_ptr<std::atomic<bool>> released)
      : released_(std::move(released)) {}
  static void CUDART_CB Wait(void* arg) {
    std::unique_ptr<std::shared_ptr<std::atomic<bool>>> released(
        static_cast<std::shared_ptr<std::atomic<bool>>*>(arg));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!(*released)->load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  std::shared_ptr<std::atomic<bool>> released_;
};

class LayerChecksumGpuTest : public ::testing::TestWithParam<TableCopy> {
 protected:
  void SetUp() override {
    const absl::Status available = CudaAvailability();
    if (!available.ok()) GTEST_SKIP() << "no usable GPU: " << available.message();
    absl::StatusOr<CudaStream> stream = CudaStream::Create(0);
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = std::move(*stream);
    absl::StatusOr<DeviceBuffer> pinned = DeviceBuffer::CreateZeroed(64 * 8, MemoryKind::kPinned);
    ASSERT_TRUE(pinned.ok()) << pinned.status();
    pinned_ = std::move(*pinned);
    absl::StatusOr<DeviceBuffer> dev = DeviceBuffer::CreateZeroed(64 * 8, MemoryKind::kDevice);
    ASSERT_TRUE(dev.ok()) << dev.status();
    device_result_ = std::move(*dev);
  }

  absl::StatusOr<std::unique_ptr<DeviceChecksummer>> Make(int max_in_flight = 64,
                                                          size_t staging_bytes = 8u << 20) {
    DeviceChecksummer::Options options;
    options.device = 0;
    options.max_in_flight = max_in_flight;
    options.staging_bytes = staging_bytes;
    options.table_copy = GetParam();
    return DeviceChecksummer::Create(options);
  }

  absl::Status Wait(void* stream) {
    ASSIGN_OR_RETURN(CudaEvent done, CudaEvent::Create());
    RETURN_IF_ERROR(done.Record(stream));
    return done.Synchronize(kWait);
  }

  uint64_t* pinned(int i = 0) { return pinned_.data_as<uint64_t>() + i; }
  uint64_t* device_result(int i = 0) { return device_result_.data_as<uint64_t>() + i; }

  // The device checksum of `m`'s spans into pinned memory, and into device memory, each
  // compared with Kvsum64Host over the host copies.
  void ExpectMatches(DeviceChecksummer& summer, const Mirror& m, const std::string& what) {
    SCOPED_TRACE(what);
    const uint64_t want = Kvsum64Host(m.HostSpans());
    const std::vector<ChecksumSpan> spans = m.DeviceSpans();
    // Both destinations start off the answer, so that a result not written shows.
    const uint64_t wrong = ~want;
    *pinned() = wrong;
    ASSERT_EQ(cudaMemcpy(device_result(), &wrong, 8, cudaMemcpyHostToDevice), cudaSuccess);
    const absl::Status to_pinned = summer.Enqueue(spans, stream_.get(), pinned());
    ASSERT_TRUE(to_pinned.ok()) << to_pinned;
    const absl::Status to_device = summer.Enqueue(spans, stream_.get(), device_result());
    ASSERT_TRUE(to_device.ok()) << to_device;
    const absl::Status waited = Wait(stream_.get());
    ASSERT_TRUE(waited.ok()) << waited;
    EXPECT_EQ(*pinned(), want) << "pinned result";
    uint64_t got = ~want;
    ASSERT_TRUE(ToHost(device_result(), 8, &got).ok());
    EXPECT_EQ(got, want) << "device result";
  }

  CudaStream stream_;
  DeviceBuffer pinned_;
  DeviceBuffer device_result_;
};

TEST_P(LayerChecksumGpuTest, RandomSpansAtOddOffsets) {
  absl::StatusOr<std::unique_ptr<DeviceChecksummer>> summer = Make();
  ASSERT_TRUE(summer.ok()) << summer.status();
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    Mirror m = MakeMirror(
        seed * 40, seed, [](std::mt19937& r) { return 1 + r() % 100000; },
        [](std::mt19937& r) { return 2 * (r() % 64) + 1; });
    ASSERT_TRUE(Upload(m, seed).ok());
    ExpectMatches(**summer, m, absl::StrCat("seed ", seed, ", ", m.ranges.size(), " spans"));
  }
}

TEST_P(LayerChecksumGpuTest, TinyAndEmptyInputs) {
  absl::StatusOr<std::unique_ptr<DeviceChecksummer>> summer = Make();
  ASSERT_TRUE(summer.ok()) << summer.status();
  Mirror none;
  none.host.resize(16);
  ASSERT_TRUE(Upload(none, 1).ok());
  ExpectMatches(**summer, none, "no spans");
  EXPECT_EQ(*pinned(), 0u);
  none.ranges = {{0, 0}, {3, 0}};
  ExpectMatches(**summer, none, "only empty spans");
  none.ranges = {{5, 1}};
  ExpectMatches(**summer, none, "one byte");
  Mirror tiny = MakeMirror(
      3000, 2, [](std::mt19937& r) { return 1 + r() % 9; },
      [](std::mt19937& r) { return r() % 4; });
  ASSERT_TRUE(Upload(tiny, 2).ok());
  ExpectMatches(**summer, tiny, "3000 spans of 1 .. 9 bytes");
  // Every length 1 .. 40 at every position in B 0 .. 15 and address offset 0 .. 15.
  Mirror grid;
  grid.host.resize(4096);
  ASSERT_TRUE(Upload(grid, 3).ok());
  for (uint64_t length = 1; length <= 40; ++length) {
    for (uint64_t prefix = 0; prefix < 16; ++prefix) {
      for (uint64_t offset = 0; offset < 16; ++offset) {
        grid.ranges = {{2048 + offset, prefix}, {offset, length}, {1024 + offset, 9}};
        ExpectMatches(**summer, grid,
                      absl::StrCat("length ", length, " prefix ", prefix, " offset ", offset));
        if (HasFailure()) return;
      }
    }
  }
}

TEST_P(LayerChecksumGpuTest, TwentyThousandBlockSizedSpans) {
  // A layer of 10000 shuffled blocks of 16 KiB in K and in V (block size 16 x 4 heads x
  // 128 x bf16): K runs, then V runs, 20000 spans, one call.
  constexpr uint64_t kBlock = 16384;
  constexpr int kBlocks = 10000;
  Mirror m;
  m.host.resize(2 * kBlocks * kBlock);
  std::vector<uint64_t> ids(kBlocks);
  for (int i = 0; i < kBlocks; ++i) ids[static_cast<size_t>(i)] = static_cast<uint64_t>(i);
  std::mt19937 rng(4);
  for (const uint64_t region : {uint64_t{0}, uint64_t{kBlocks} * kBlock}) {
    std::shuffle(ids.begin(), ids.end(), rng);
    for (uint64_t id : ids) m.ranges.emplace_back(region + id * kBlock, kBlock);
  }
  ASSERT_TRUE(Upload(m, 4).ok());
  absl::StatusOr<std::unique_ptr<DeviceChecksummer>> summer = Make();
  ASSERT_TRUE(summer.ok()) << summer.status();
  ExpectMatches(**summer, m, "20000 blocks");
  // A misplaced block changes the sum: swap two K runs.
  const uint64_t good = *pinned();
  std::swap(m.ranges[0], m.ranges[1]);
  ExpectMatches(**summer, m, "two blocks swapped");
  EXPECT_NE(*pinned(), good);
}

TEST_P(LayerChecksumGpuTest, RegisteredHostResult) {
  absl::StatusOr<std::unique_ptr<DeviceChecksummer>> summer = Make();
  ASSERT_TRUE(summer.ok()) << summer.status();
  Mirror m = MakeMirror(
      20, 5, [](std::mt19937& r) { return 1 + r() % 100000; },
      [](std::mt19937& r) { return 2 * (r() % 8) + 1; });
  ASSERT_TRUE(Upload(m, 5).ok());
  std::vector<uint64_t> registered(512, 0);
  ASSERT_EQ(cudaHostRegister(registered.data(), registered.size() * 8, cudaHostRegisterMapped),
            cudaSuccess);
  const absl::Status enqueued = (*summer)->Enqueue(m.DeviceSpans(), stream_.get(), &registered[7]);
  const absl::Status waited = Wait(stream_.get());
  cudaHostUnregister(registered.data());
  ASSERT_TRUE(enqueued.ok()) << enqueued;
  ASSERT_TRUE(waited.ok()) << waited;
  EXPECT_EQ(registered[7], Kvsum64Host(m.HostSpans()));
}

TEST_P(LayerChecksumGpuTest, ManyCallsInFlightOnOneAndTwoStreams) {
  absl::StatusOr<std::unique_ptr<DeviceChecksummer>> summer = Make();
  ASSERT_TRUE(summer.ok()) << summer.status();
  absl::StatusOr<CudaStream> second = CudaStream::Create(0);
  ASSERT_TRUE(second.ok()) << second.status();
  std::vector<Mirror> inputs;
  for (uint32_t i = 0; i < 32; ++i) {
    inputs.push_back(MakeMirror(
        static_cast<int>(1 + i * 7), 100 + i, [](std::mt19937& r) { return 1 + r() % 100000; },
        [](std::mt19937& r) { return r() % 16; }));
    ASSERT_TRUE(Upload(inputs.back(), 100 + i).ok());
  }
  for (const bool two_streams : {false, true}) {
    SCOPED_TRACE(two_streams ? "two streams" : "one stream");
    for (int i = 0; i < 64; ++i) *pinned(i) = 0;
    {
      // Held streams: all 32 calls are enqueued before any runs.
      absl::StatusOr<std::unique_ptr<StreamHold>> hold1 = StreamHold::Create(stream_.get());
      absl::StatusOr<std::unique_ptr<StreamHold>> hold2 = StreamHold::Create(second->get());
      ASSERT_TRUE(hold1.ok() && hold2.ok());
      for (size_t i = 0; i < inputs.size(); ++i) {
        void* s = two_streams && i % 2 == 1 ? second->get() : stream_.get();
        const absl::Status st =
            (*summer)->Enqueue(inputs[i].DeviceSpans(), s, pinned(static_cast<int>(i)));
        ASSERT_TRUE(st.ok()) << "call " << i << ": " << st;
      }
    }
    ASSERT_TRUE(Wait(stream_.get()).ok());
    ASSERT_TRUE(Wait(second->get()).ok());
    for (size_t i = 0; i < inputs.size(); ++i) {
      EXPECT_EQ(*pinned(static_cast<int>(i)), Kvsum64Host(inputs[i].HostSpans())) << "call " << i;
    }
  }
}

TEST_P(LayerChecksumGpuTest, RingWrapsRunsOutAndRecovers) {
  // A 64 KiB ring with room for four calls' average share (16 KiB) holds calls of ~22 KiB:
  // tables larger than a fixed slot would be.
  constexpr size_t kRing = 64 << 10;
  absl::StatusOr<std::unique_ptr<DeviceChecksummer>> summer = Make(/*max_in_flight=*/4, kRing);
  ASSERT_TRUE(summer.ok()) << summer.status();
  DeviceChecksummer& s = **summer;
  absl::StatusOr<CudaStream> held = CudaStream::Create(0);
  ASSERT_TRUE(held.ok()) << held.status();
  auto spans_of = [](int count, uint32_t seed) {
    return MakeMirror(
        count, seed, [](std::mt19937&) { return 64; }, [](std::mt19937& r) { return r() % 3; });
  };
  Mirror a = spans_of(1400, 1), b = spans_of(1400, 2), c = spans_of(1400, 3), d = spans_of(1400, 4);
  for (Mirror* m : {&a, &b, &c, &d}) ASSERT_TRUE(Upload(*m, 9).ok());
  const size_t call = s.StagingBytesFor(1400, 1400 * 64);
  ASSERT_GT(call, kRing / 3);  // three do not fit: the third wraps or waits
  ASSERT_LE(2 * call, kRing);
  ASSERT_GT(call, kRing / 4);

  // a completes; b is held; c wraps to the start (into a's range); d finds no room.
  ASSERT_TRUE(s.Enqueue(a.DeviceSpans(), stream_.get(), pinned(0)).ok());
  ASSERT_TRUE(Wait(stream_.get()).ok());
  {
    absl::StatusOr<std::unique_ptr<StreamHold>> hold = StreamHold::Create(held->get());
    ASSERT_TRUE(hold.ok()) << hold.status();
    ASSERT_TRUE(s.Enqueue(b.DeviceSpans(), held->get(), pinned(1)).ok());
    ASSERT_TRUE(s.Enqueue(c.DeviceSpans(), stream_.get(), pinned(2)).ok());
    const absl::Status full = s.Enqueue(d.DeviceSpans(), stream_.get(), pinned(3));
    EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  }
  ASSERT_TRUE(Wait(held->get()).ok());
  ASSERT_TRUE(Wait(stream_.get()).ok());
  const absl::Status retried = s.Enqueue(d.DeviceSpans(), stream_.get(), pinned(3));
  ASSERT_TRUE(retried.ok()) << retried;
  ASSERT_TRUE(Wait(stream_.get()).ok());
  EXPECT_EQ(*pinned(0), Kvsum64Host(a.HostSpans()));
  EXPECT_EQ(*pinned(1), Kvsum64Host(b.HostSpans()));
  EXPECT_EQ(*pinned(2), Kvsum64Host(c.HostSpans()));
  EXPECT_EQ(*pinned(3), Kvsum64Host(d.HostSpans()));

  // A table larger than the whole ring is refused outright.
  Mirror huge = spans_of(5000, 5);
  ASSERT_TRUE(Upload(huge, 5).ok());
  const absl::Status too_big = s.Enqueue(huge.DeviceSpans(), stream_.get(), pinned(4));
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument) << too_big;
  EXPECT_NE(too_big.message().find("staging"), absl::string_view::npos) << too_big;
}

TEST_P(LayerChecksumGpuTest, InFlightLimit) {
  absl::StatusOr<std::unique_ptr<DeviceChecksummer>> summer = Make(/*max_in_flight=*/2);
  ASSERT_TRUE(summer.ok()) << summer.status();
  Mirror m = MakeMirror(
      10, 6, [](std::mt19937& r) { return 1 + r() % 1000; }, [](std::mt19937&) { return 1; });
  ASSERT_TRUE(Upload(m, 6).ok());
  const uint64_t want = Kvsum64Host(m.HostSpans());
  {
    absl::StatusOr<std::unique_ptr<StreamHold>> hold = StreamHold::Create(stream_.get());
    ASSERT_TRUE(hold.ok()) << hold.status();
    ASSERT_TRUE((*summer)->Enqueue(m.DeviceSpans(), stream_.get(), pinned(0)).ok());
    ASSERT_TRUE((*summer)->Enqueue(m.DeviceSpans(), stream_.get(), pinned(1)).ok());
    const absl::Status third = (*summer)->Enqueue(m.DeviceSpans(), stream_.get(), pinned(2));
    EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  }
  ASSERT_TRUE(Wait(stream_.get()).ok());
  ASSERT_TRUE((*summer)->Enqueue(m.DeviceSpans(), stream_.get(), pinned(2)).ok());
  ASSERT_TRUE(Wait(stream_.get()).ok());
  EXPECT_EQ(*pinned(0), want);
  EXPECT_EQ(*pinned(1), want);
  EXPECT_EQ(*pinned(2), want);
}

TEST_P(LayerChecksumGpuTest, RejectsBadArguments) {
  absl::StatusOr<std::unique_ptr<DeviceChecksummer>> summer = Make();
  ASSERT_TRUE(summer.ok()) << summer.status();
  Mirror m = MakeMirror(
      3, 7, [](std::mt19937&) { return 100; }, [](std::mt19937&) { return 0; });
  ASSERT_TRUE(Upload(m, 7).ok());
  const std::vector<ChecksumSpan> spans = m.DeviceSpans();
  DeviceChecksummer& s = **summer;
  auto code = [](const absl::Status& st) { return st.code(); };
  EXPECT_EQ(code(s.Enqueue(spans, stream_.get(), nullptr)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(s.Enqueue(spans, stream_.get(),
                           reinterpret_cast<uint64_t*>(pinned_.data_as<uint8_t>() + 4))),
            absl::StatusCode::kInvalidArgument);
  uint64_t pageable = 0;
  const absl::Status st = s.Enqueue(spans, stream_.get(), &pageable);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("pageable"), absl::string_view::npos) << st;
  std::vector<ChecksumSpan> with_null = spans;
  with_null.insert(with_null.begin() + 1, ChecksumSpan{nullptr, 5});
  const absl::Status null_span = s.Enqueue(with_null, stream_.get(), pinned());
  EXPECT_EQ(null_span.code(), absl::StatusCode::kInvalidArgument) << null_span;
  EXPECT_NE(null_span.message().find("span 1"), absl::string_view::npos) << null_span;
  // A null pointer with length 0 is an empty span, not an error.
  with_null[1].length = 0;
  EXPECT_TRUE(s.Enqueue(with_null, stream_.get(), pinned()).ok());
  ASSERT_TRUE(Wait(stream_.get()).ok());
  EXPECT_EQ(*pinned(), Kvsum64Host(m.HostSpans()));
  if (GpuCount() >= 2) {
    absl::StatusOr<CudaStream> other = CudaStream::Create(1);
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_EQ(code(s.Enqueue(spans, other->get(), pinned())), absl::StatusCode::kInvalidArgument);
    absl::StatusOr<DeviceBuffer> other_result = [] {
      CudaDeviceScope scope(1);
      return DeviceBuffer::Create(8, MemoryKind::kDevice);
    }();
    ASSERT_TRUE(other_result.ok()) << other_result.status();
    EXPECT_EQ(code(s.Enqueue(spans, stream_.get(), other_result->data_as<uint64_t>())),
              absl::StatusCode::kInvalidArgument);
  }
}

INSTANTIATE_TEST_SUITE_P(TableCopies, LayerChecksumGpuTest,
                         ::testing::Values(TableCopy::kInternalStream, TableCopy::kCallerStream),
                         [](const ::testing::TestParamInfo<TableCopy>& param) {
                           return param.param == TableCopy::kInternalStream ? "InternalStream"
                                                                            : "CallerStream";
                         });

}  // namespace
}  // namespace kvstream
