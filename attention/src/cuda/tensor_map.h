// Tensor maps (the Tensor Memory Accelerator's descriptors of a global tensor) of a paged
// K or V cache, for the TMA-fed kernels. cuTensorMapEncodeTiled is a driver function; it is
// taken from the runtime (cudaGetDriverEntryPointByVersion) and kept once found, so that
// nothing links libcuda directly. A map is 128 bytes of host memory, encoded per launch
// (about a microsecond) and passed to the kernel by value: caches may move between
// launches.
#ifndef KVSTREAM_ATTENTION_CUDA_TENSOR_MAP_H_
#define KVSTREAM_ATTENTION_CUDA_TENSOR_MAP_H_

#include <cuda.h>

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvstream/common/dtype.h"

namespace kvstream {
namespace internal {

// A 16-bit cache seen as [block][head][column half][token][64 elements] (innermost last),
// strides in elements (any NHD / HND layout whose rows are 16-byte aligned), and the box
// one copy moves: box_tokens tokens x box_halves halves x box_heads heads of one block.
// A copy lands in shared memory as [box_heads][box_halves][box_tokens][64] with the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)); what lies outside the
// cache (a block id past num_blocks) reads as zeros.
//
// raw_fp8_rows: instead, an fp8 cache seen as [block][head][token][head_size bytes], whole
// rows per box (box_tokens x box_heads, box_halves 1), landing unswizzled as
// [box_heads][box_tokens][head_size] bytes; `halves` is then 1.
struct CacheMapShape {
  bool raw_fp8_rows = false;
  int64_t row_bytes = 0;  // raw_fp8_rows: head_size
  int64_t block_size;
  int64_t halves;  // head_size / 64
  int64_t num_kv_heads;
  int64_t num_blocks;
  int64_t block_stride;
  int64_t token_stride;
  int64_t head_stride;
  uint32_t box_tokens;
  uint32_t box_halves;
  uint32_t box_heads;
};

// The tensor map of `cache` (dtype float16 or bfloat16; raw_fp8_rows: either fp8).
// InternalError naming `what` when the driver lacks the encoder or refuses the shape.
absl::StatusOr<CUtensorMap> EncodeCacheTensorMap(const void* cache, DType dtype,
                                                 const CacheMapShape& shape,
                                                 absl::string_view what);

}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CUDA_TENSOR_MAP_H_
