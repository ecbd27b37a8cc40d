// Tests of common/tensor.h: TensorView reshape over contiguous and strided memory, -1
// inference and its errors, contiguity, and the owning Tensor.
#include "kvstream/common/tensor.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvstream {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Every element reached through `view` (row-major over its shape), as offsets from base.
std::vector<int64_t> Offsets(const TensorView& view, const float* base) {
  std::vector<int64_t> out;
  std::vector<int64_t> idx(view.dim(), 0);
  const int64_t n = view.numel();
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int d = 0; d < view.dim(); ++d) off += idx[d] * view.stride(d);
    out.push_back(static_cast<const float*>(view.data()) + off - base);
    for (int d = view.dim() - 1; d >= 0; --d) {
      if (++idx[d] < view.size(d)) break;
      idx[d] = 0;
    }
  }
  return out;
}

TEST(TensorViewTest, ContiguousStridesAndNumel) {
  std::vector<float> buf(24);
  TensorView v(buf.data(), DType::kFloat32, {2, 3, 4});
  EXPECT_THAT(v.strides(), ElementsAre(12, 4, 1));
  EXPECT_EQ(v.numel(), 24);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.DebugString(), "[2, 3, 4] float32");
  EXPECT_THAT(ContiguousStrides({5, 1, 2}), ElementsAre(2, 2, 1));
  EXPECT_TRUE(TensorView().empty());
}

TEST(TensorViewTest, ReshapeContiguous) {
  std::vector<float> buf(24);
  TensorView v(buf.data(), DType::kFloat32, {2, 3, 4});
  auto r = v.Reshape({6, 4});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->shape(), ElementsAre(6, 4));
  EXPECT_THAT(r->strides(), ElementsAre(4, 1));
  EXPECT_EQ(r->data(), buf.data());
  EXPECT_EQ(r->dtype(), DType::kFloat32);

  r = v.Reshape({24});
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(r->strides(), ElementsAre(1));

  r = v.Reshape({2, 2, 2, 3});
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(r->strides(), ElementsAre(12, 6, 3, 1));
  EXPECT_EQ(Offsets(*r, buf.data()), Offsets(v, buf.data()));
}

TEST(TensorViewTest, ReshapeInfersMinusOne) {
  std::vector<float> buf(24);
  TensorView v(buf.data(), DType::kFloat32, {2, 3, 4});
  auto r = v.Reshape({-1, 4});
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(r->shape(), ElementsAre(6, 4));
  r = v.Reshape({2, -1, 2});
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(r->shape(), ElementsAre(2, 6, 2));
  EXPECT_THAT(r->strides(), ElementsAre(12, 2, 1));
  r = v.Reshape({-1});
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(r->shape(), ElementsAre(24));
}

TEST(TensorViewTest, ReshapeSizeOneDimsKeepContiguity) {
  std::vector<float> buf(6);
  TensorView v(buf.data(), DType::kFloat32, {2, 3});
  auto r = v.Reshape({1, 6, 1});
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(r->shape(), ElementsAre(1, 6, 1));
  EXPECT_EQ(r->stride(1), 1);
  // A size-1 dimension may carry any stride and the view is still contiguous.
  EXPECT_TRUE(r->is_contiguous());
  EXPECT_TRUE(TensorView(buf.data(), DType::kFloat32, {1, 6}, {99, 1}).is_contiguous());
  auto back = r->Reshape({2, 3});
  ASSERT_TRUE(back.ok());
  EXPECT_THAT(back->strides(), ElementsAre(3, 1));
}

TEST(TensorViewTest, ReshapeStridedRowsSplitsButDoesNotMerge) {
  // Rows of 4 used elements at a row pitch of 8 (a slice of a wider tensor).
  std::vector<float> buf(3 * 8);
  TensorView v(buf.data(), DType::kFloat32, {3, 4}, {8, 1});
  EXPECT_FALSE(v.is_contiguous());
  auto split = v.Reshape({3, 2, 2});
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_THAT(split->strides(), ElementsAre(8, 2, 1));
  EXPECT_EQ(Offsets(*split, buf.data()), Offsets(v, buf.data()));
  auto split_rows = v.Reshape({3, 1, 4});
  ASSERT_TRUE(split_rows.ok());
  EXPECT_EQ(Offsets(*split_rows, buf.data()), Offsets(v, buf.data()));

  auto merged = v.Reshape({12});
  ASSERT_FALSE(merged.ok());
  EXPECT_EQ(merged.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(merged.status().message(), HasSubstr("[3, 4]"));
  EXPECT_THAT(merged.status().message(), HasSubstr("[12]"));
  EXPECT_THAT(merged.status().message(), HasSubstr("not contiguous"));
}

TEST(TensorViewTest, ReshapeOfStridedOuterDimsMerges) {
  // [2, 3, 4] where the outer two dims are mutually contiguous but rows are padded:
  // strides (24, 8, 1). Merging dims 0 and 1 is fine; merging 1 and 2 is not.
  std::vector<float> buf(2 * 24);
  TensorView v(buf.data(), DType::kFloat32, {2, 3, 4}, {24, 8, 1});
  auto r = v.Reshape({6, 4});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->strides(), ElementsAre(8, 1));
  EXPECT_EQ(Offsets(*r, buf.data()), Offsets(v, buf.data()));
  EXPECT_FALSE(v.Reshape({2, 12}).ok());
}

TEST(TensorViewTest, ReshapeOfTransposedViewFails) {
  std::vector<float> buf(12);
  TensorView t(buf.data(), DType::kFloat32, {4, 3}, {1, 4});  // transpose of [3, 4]
  EXPECT_FALSE(t.is_contiguous());
  auto r = t.Reshape({12});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  // Splitting a single dimension still works.
  auto s = t.Reshape({2, 2, 3});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(Offsets(*s, buf.data()), Offsets(t, buf.data()));
}

TEST(TensorViewTest, ReshapeErrors) {
  std::vector<float> buf(24);
  TensorView v(buf.data(), DType::kFloat32, {2, 3, 4});
  auto two = v.Reshape({-1, -1});
  ASSERT_FALSE(two.ok());
  EXPECT_THAT(two.status().message(), HasSubstr("more than one -1"));
  auto neg = v.Reshape({-2, 12});
  ASSERT_FALSE(neg.ok());
  EXPECT_THAT(neg.status().message(), HasSubstr("negative"));
  auto count = v.Reshape({5, 5});
  ASSERT_FALSE(count.ok());
  EXPECT_THAT(count.status().message(), HasSubstr("[2, 3, 4]"));
  EXPECT_THAT(count.status().message(), HasSubstr("[5, 5]"));
  auto indivisible = v.Reshape({-1, 5});
  ASSERT_FALSE(indivisible.ok());
  EXPECT_EQ(indivisible.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(v.Reshape({0, -1}).ok());
}

TEST(TensorViewTest, ReshapeEmpty) {
  std::vector<float> buf(1);
  TensorView v(buf.data(), DType::kFloat32, {0, 4});
  EXPECT_TRUE(TensorView(buf.data(), DType::kFloat32, {0, 4}, {7, 9}).is_contiguous());
  auto r = v.Reshape({4, 0});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->numel(), 0);
  auto inferred = v.Reshape({-1, 2});
  ASSERT_TRUE(inferred.ok());
  EXPECT_THAT(inferred->shape(), ElementsAre(0, 2));
}

TEST(TensorTest, ZerosIsAlignedZeroFilledAndTyped) {
  Tensor t = Tensor::Zeros({3, 5}, DType::kBFloat16);
  ASSERT_NE(t.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
  EXPECT_EQ(t.nbytes(), 30u);
  EXPECT_TRUE(t.view().is_contiguous());
  for (int64_t i = 0; i < t.numel(); ++i) EXPECT_EQ(t.data_as<uint16_t>()[i], 0);
  t.SetFloat(7, 1.5f);
  EXPECT_EQ(t.data_as<uint16_t>()[7], 0x3fc0);
  EXPECT_EQ(t.GetFloat(7), 1.5f);
  Tensor moved = std::move(t);
  EXPECT_EQ(moved.GetFloat(7), 1.5f);
}

TEST(TensorTest, NegativeShapeGivesEmptyTensor) {
  Tensor t = Tensor::Zeros({2, -1}, DType::kFloat32);
  EXPECT_EQ(t.data(), nullptr);
}

}  // namespace
}  // namespace kvstream
