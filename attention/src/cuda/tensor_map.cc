// EncodeCacheTensorMap (tensor_map.h).
#include "cuda/tensor_map.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <atomic>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvstream/common/status_macros.h"

namespace kvstream {
namespace internal {
namespace {

absl::Status Error(absl::string_view what, absl::string_view message) {
  return absl::InternalError(absl::StrCat(what, ": ", message));
}

// cuTensorMapEncodeTiled from the driver, or the reason it is not there. A found function
// is kept for the process; a failed lookup is tried again on the next call.
absl::StatusOr<PFN_cuTensorMapEncodeTiled_v12000> EncodeFunction(absl::string_view what) {
  static std::atomic<PFN_cuTensorMapEncodeTiled_v12000> cached{nullptr};
  if (PFN_cuTensorMapEncodeTiled_v12000 fn = cached.load(std::memory_order_acquire)) return fn;
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                           cudaEnableDefault, &found);
  if (err != cudaSuccess) {
    return Error(what,
                 absl::StrCat("looking up cuTensorMapEncodeTiled: ", cudaGetErrorString(err)));
  }
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
    return Error(what, absl::StrCat("the driver has no cuTensorMapEncodeTiled (query result ",
                                    static_cast<int>(found), ")"));
  }
  const auto typed = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  cached.store(typed, std::memory_order_release);
  return typed;
}

}  // namespace

absl::StatusOr<CUtensorMap> EncodeCacheTensorMap(const void* cache, DType dtype,
                                                 const CacheMapShape& s,
                                                 absl::string_view what) {
  ASSIGN_OR_RETURN(PFN_cuTensorMapEncodeTiled_v12000 encode, EncodeFunction(what));
  // Dimensions innermost first: element, token, half, head, block (raw rows: the whole row
  // of bytes, token, a half of extent 1, head, block).
  const bool raw = s.raw_fp8_rows;
  const int64_t element_bytes = raw ? 1 : 2;
  const cuuint64_t row = raw ? static_cast<cuuint64_t>(s.row_bytes) : 64;
  const cuuint64_t dims[5] = {row, static_cast<cuuint64_t>(s.block_size),
                              static_cast<cuuint64_t>(raw ? 1 : s.halves),
                              static_cast<cuuint64_t>(s.num_kv_heads),
                              static_cast<cuuint64_t>(s.num_blocks)};
  const cuuint64_t strides[4] = {static_cast<cuuint64_t>(s.token_stride * element_bytes), 128,
                                 static_cast<cuuint64_t>(s.head_stride * element_bytes),
                                 static_cast<cuuint64_t>(s.block_stride * element_bytes)};
  const cuuint32_t box[5] = {static_cast<cuuint32_t>(row), s.box_tokens, raw ? 1 : s.box_halves,
                             s.box_heads, 1};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  CUtensorMap map;
  const CUtensorMapDataType type = raw                        ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                               : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = encode(
      &map, type, 5, const_cast<void*>(cache), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, raw ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Error(what, absl::StrCat("cuTensorMapEncodeTiled failed with CUresult ",
                                    static_cast<int>(r), " (strides ", s.block_stride, "/",
                                    s.token_stride, "/", s.head_stride, ", ", s.num_blocks,
                                    " blocks of ", s.block_size, ")"));
  }
  return map;
}

}  // namespace internal
}  // namespace kvstream
