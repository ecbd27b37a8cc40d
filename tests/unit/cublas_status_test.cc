// CublasErrorToStatus: cuBLAS's codes become the Status codes its contract names, with the
// operation and the cuBLAS name in the message.
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "kvstream/common/cuda_status.h"

namespace kvstream {
namespace {

TEST(CublasStatusTest, SuccessIsOk) { EXPECT_TRUE(CublasErrorToStatus(0, "gemm").ok()); }

TEST(CublasStatusTest, CodesMapAsDocumented) {
  struct Case {
    int status;
    absl::StatusCode code;
    const char* name;
  };
  for (const Case& c : {Case{1, absl::StatusCode::kFailedPrecondition, "NOT_INITIALIZED"},
                        Case{3, absl::StatusCode::kResourceExhausted, "ALLOC_FAILED"},
                        Case{7, absl::StatusCode::kInvalidArgument, "INVALID_VALUE"},
                        Case{8, absl::StatusCode::kFailedPrecondition, "ARCH_MISMATCH"},
                        Case{13, absl::StatusCode::kInternal, "EXECUTION_FAILED"},
                        Case{15, absl::StatusCode::kFailedPrecondition, "NOT_SUPPORTED"},
                        Case{99, absl::StatusCode::kInternal, "unknown"}}) {
    const absl::Status s = CublasErrorToStatus(c.status, "cublasGemmEx");
    EXPECT_EQ(s.code(), c.code) << c.status;
    EXPECT_TRUE(absl::StrContains(s.message(), "cublasGemmEx")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), c.name)) << s;
  }
}

}  // namespace
}  // namespace kvstream
