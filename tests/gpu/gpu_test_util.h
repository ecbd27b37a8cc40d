// Helpers for the CUDA kernel tests: host <-> device copies into DeviceBuffers, and
// DeviceAttnProblem, a device copy of one attention test problem (AttnProblem from
// tests/unit/attention_test_util.h) with the host mirrors the CUDA path validates through,
// plus the comparison of a device output with the golden CPU reference, and
// KVSTREAM_SKIP_WITHOUT_GPU().
//
// Copies use the legacy default stream (cudaMemcpy). Streams made by CudaStream::Create
// synchronise with it, so uploads are ordered before kernels enqueued there, and a
// download after CudaStream::Synchronize sees their results.
#ifndef KVSTREAM_TESTS_GPU_GPU_TEST_UTIL_H_
#define KVSTREAM_TESTS_GPU_GPU_TEST_UTIL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/common/cuda_resources.h"
#include "kvstream/common/cuda_status.h"
#include "kvstream/common/numeric.h"
#include "kvstream/common/status_macros.h"
#include "tests/unit/attention_test_util.h"

// Skips the current test (GTEST_SKIP, so from a test body or SetUp) where no GPU can be
// used, saying why: "no usable GPU: " and the message of CudaAvailability().
#define KVSTREAM_SKIP_WITHOUT_GPU()                                             \
  do {                                                                          \
    const ::absl::Status kvstream_gpu_status_ = ::kvstream::CudaAvailability(); \
    if (!kvstream_gpu_status_.ok()) {                                           \
      GTEST_SKIP() << "no usable GPU: " << kvstream_gpu_status_.message();      \
    }                                                                           \
  } while (0)

namespace kvstream {
namespace gpu_test {

// `bytes` host bytes in a new device buffer (empty for 0 bytes). Blocks until copied.
inline absl::StatusOr<DeviceBuffer> ToDevice(const void* data, size_t bytes) {
  ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Create(bytes, MemoryKind::kDevice));
  if (bytes > 0) {
    RETURN_IF_ERROR(CudaErrorToStatus(
        static_cast<int>(cudaMemcpy(buffer.data(), data, bytes, cudaMemcpyHostToDevice)),
        "cudaMemcpy to device"));
  }
  return buffer;
}

template <typename T>
absl::StatusOr<DeviceBuffer> ToDevice(const std::vector<T>& values) {
  return ToDevice(values.data(), values.size() * sizeof(T));
}

// The first `bytes` of `buffer` (device memory) into `out`. Blocks until copied.
inline absl::Status ToHost(const void* device, size_t bytes, void* out) {
  if (bytes == 0) return absl::OkStatus();
  return CudaErrorToStatus(
      static_cast<int>(cudaMemcpy(out, device, bytes, cudaMemcpyDeviceToHost)),
      "cudaMemcpy to host");
}

// Whether `device` has compute capability 9.0 or newer (DecodeLaunchOptions::dependent_merge).
inline absl::StatusOr<bool> ComputeCapability9(int device = 0) {
  int major = 0;
  RETURN_IF_ERROR(CudaErrorToStatus(
      static_cast<int>(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)),
      "cudaDeviceGetAttribute"));
  return major >= 9;
}

inline absl::StatusOr<int> NumSms(int device = 0) {
  int n = 0;
  RETURN_IF_ERROR(CudaErrorToStatus(
      static_cast<int>(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device)),
      "cudaDeviceGetAttribute"));
  return n;
}

// A device copy of an AttnProblem. The problem must outlive this object, and must not be
// changed after Create (the host mirrors point into it).
class DeviceAttnProblem {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceAttnProblem>> Create(
      testing_util::AttnProblem& pb) {
    std::unique_ptr<DeviceAttnProblem> d(new DeviceAttnProblem(pb));
    ASSIGN_OR_RETURN(d->q_, ToDevice(pb.q_bytes()));
    ASSIGN_OR_RETURN(d->k_, ToDevice(pb.k_bytes()));
    ASSIGN_OR_RETURN(d->v_, ToDevice(pb.v_bytes()));
    ASSIGN_OR_RETURN(d->query_start_loc_, ToDevice(pb.query_start_loc()));
    ASSIGN_OR_RETURN(d->seq_lens_, ToDevice(pb.seq_lens()));
    ASSIGN_OR_RETURN(d->block_table_, ToDevice(pb.block_table()));
    ASSIGN_OR_RETURN(d->alibi_, ToDevice(pb.alibi_slopes()));
    d->host_out_ = pb.NewOut();
    ASSIGN_OR_RETURN(d->out_, ToDevice(d->host_out_));
    return d;
  }

  // Device params: every pointer on the device, host mirrors into the problem.
  PagedAttentionParams params() {
    PagedAttentionParams p = pb_.params(host_out_);
    p.host.query_start_loc = p.query_start_loc;
    p.host.seq_lens = p.seq_lens;
    p.host.block_table = p.block_table;
    p.host.alibi_slopes = p.alibi_slopes;
    p.q = q_.data();
    p.out = out_.data();
    p.cache.k = k_.data();
    p.cache.v = v_.data();
    p.cache.memory = MemoryKind::kDevice;
    p.query_start_loc = query_start_loc_.data_as<int32_t>();
    p.seq_lens = seq_lens_.data_as<int32_t>();
    p.block_table = block_table_.data_as<int32_t>();
    if (p.alibi_slopes != nullptr) p.alibi_slopes = alibi_.data_as<float>();
    return p;
  }

  // The output buffer as the host layout of AttnProblem::NewOut().
  absl::StatusOr<std::vector<uint8_t>> Out() const {
    std::vector<uint8_t> out(host_out_.size());
    RETURN_IF_ERROR(ToHost(out_.data(), out.size(), out.data()));
    return out;
  }

  // Refills the device output with the sentinel.
  absl::Status ResetOut() {
    return CudaErrorToStatus(static_cast<int>(cudaMemcpy(out_.data(), host_out_.data(),
                                                         host_out_.size(),
                                                         cudaMemcpyHostToDevice)),
                             "cudaMemcpy to device");
  }

 private:
  explicit DeviceAttnProblem(testing_util::AttnProblem& pb) : pb_(pb) {}

  testing_util::AttnProblem& pb_;
  std::vector<uint8_t> host_out_;  // sentinel-filled; only its size and bytes are used
  DeviceBuffer q_, k_, v_, query_start_loc_, seq_lens_, block_table_, alibi_, out_;
};

// Absolute tolerance of a CUDA output of `dtype` against the double-precision reference,
// values in [-1, 1]: the output format's rounding plus float accumulation.
inline float GpuTolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 2e-4f;
    case DType::kFloat16: return 2.5e-3f;
    default: return 1.5e-2f;  // bfloat16
  }
}

// Compares every element of the batch's query rows of `got` with `want` (whole output
// buffers in NewOut()'s layout): |want - got| <= abs_tol + rel_tol * |want|, and no NaN on
// either side. Reports at most a few elements, and the worst absolute error.
inline void ExpectQueryRowsClose(const testing_util::AttnProblem& pb,
                                 const std::vector<uint8_t>& want,
                                 const std::vector<uint8_t>& got, double abs_tol,
                                 double rel_tol) {
  const testing_util::AttnCase& c = pb.config();
  int failures = 0;
  int nans = 0;
  double worst = 0;
  testing_util::ForEachQueryOutput(pb, [&](const testing_util::QueryOutput& o) {
    const auto [s, t, row, h, d] = o;
    const float w = pb.Out(want, row, h, d);
    const float g = pb.Out(got, row, h, d);
    if (std::isnan(g) || std::isnan(w)) {
      if (++nans <= 3) {
        ADD_FAILURE() << "NaN at seq " << s << " token " << t << " head " << h << " d "
                      << d << ": reference " << w << " gpu " << g;
      }
      return;
    }
    const double err = std::fabs(static_cast<double>(w) - g);
    worst = std::max(worst, err);
    if (err > abs_tol + rel_tol * std::fabs(w)) {
      if (++failures <= 5) {
        ADD_FAILURE() << "seq " << s << " (seq_len " << pb.seq_len(s) << ", query_len "
                      << c.seqs[s].query_len << ") token " << t << " head " << h << " d "
                      << d << ": reference " << w << " gpu " << g;
      }
    }
  });
  EXPECT_EQ(failures, 0) << "worst absolute error " << worst;
  EXPECT_EQ(nans, 0);
}

// Compares `got` (a whole output buffer in NewOut()'s layout) with the golden reference
// on the same problem: every element of every query row within GpuTolerance (absolute,
// plus as much relative), no NaN, and no byte outside the rows written. Reports at most a
// few elements.
inline void ExpectMatchesReference(testing_util::AttnProblem& pb, const std::vector<uint8_t>& got,
                                   const std::string& what) {
  SCOPED_TRACE(what);
  std::vector<uint8_t> want = pb.NewOut();
  const absl::Status st = RunAttentionReference(pb.params(want));
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(pb.CountStrayWrites(got), 0) << "wrote outside the query rows";
  const double tol = GpuTolerance(pb.config().out_dtype);
  ExpectQueryRowsClose(pb, want, got, tol, tol);
}

}  // namespace gpu_test
}  // namespace kvstream

#endif  // KVSTREAM_TESTS_GPU_GPU_TEST_UTIL_H_
