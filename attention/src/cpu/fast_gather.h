// Conversions into float rows for the CPU attention fast path: the addresses of a KV
// tile's rows along the block table, K and V rows of any cache dtype dequantised into a
// tile, and query rows scaled as they are loaded. Exact conversions (vec_math.h), so they
// decide nothing about the result.
#ifndef KVSTREAM_ATTENTION_CPU_FAST_GATHER_H_
#define KVSTREAM_ATTENTION_CPU_FAST_GATHER_H_

#include <cstdint>

#include "kvstream/attention/backend.h"
#include "kvstream/common/numeric.h"
#include "cpu/fast_prefetch.h"
#include "cpu/fast_problem.h"
#include "cpu/fast_target.h"
#include "cpu/vec_math.h"

namespace kvstream {
namespace internal {
namespace cpu_fast {

template <DType kDType>
KVSTREAM_INLINE void ConvertContiguous(const void* src, int n, const float* table, float* dst) {
  if constexpr (kDType == DType::kFloat32) {
    const float* s = static_cast<const float*>(src);
    KVSTREAM_SIMD
    for (int i = 0; i < n; ++i) dst[i] = s[i];
  } else if constexpr (kDType == DType::kBFloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    KVSTREAM_SIMD
    for (int i = 0; i < n; ++i) dst[i] = BFloat16BitsToFloatVec(s[i]);
  } else if constexpr (kDType == DType::kFloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    KVSTREAM_SIMD
    for (int i = 0; i < n; ++i) dst[i] = HalfBitsToFloatVec(s[i]);
  } else {
    // fp8: the table already holds fp8 value * scale.
    const uint8_t* s = static_cast<const uint8_t*>(src);
    KVSTREAM_SIMD
    for (int i = 0; i < n; ++i) dst[i] = table[s[i]];
  }
}

// Addresses of rows j0 .. j0+n-1 of KV head g of one cache tensor: one division per tile,
// then a walk along the block table (a division per key costs as much as converting it).
KVSTREAM_INLINE void TileRows(const Problem& pb, const void* base, const CacheStrides& st,
                              const int32_t* block_row, int g, int64_t j0, int n,
                              const char** rows) {
  const char* bytes = static_cast<const char*>(base);
  const int64_t elem = pb.cache_elem;
  int64_t b = j0 / pb.block_size;
  int64_t t = j0 - b * pb.block_size;
  const int64_t head_offset = g * st.head;
  int64_t block_offset = block_row[b] * st.block + head_offset;
  for (int i = 0; i < n; ++i) {
    rows[i] = bytes + (block_offset + t * st.token) * elem;
    if (++t == pb.block_size && i + 1 < n) {
      t = 0;
      block_offset = block_row[++b] * st.block + head_offset;
    }
  }
}

// Converts n rows of `width` elements into dst (row stride ld); with a prefetcher, spreads
// the keys [0, pf_to) of the next tile over the rows.
template <DType kDType>
KVSTREAM_INLINE void GatherRowsAs(const char* const* rows, int n, int width, int64_t dim_stride,
                                  const float* table, float* dst, int64_t ld,
                                  TilePrefetcher* pf, int pf_to) {
  for (int i = 0; i < n; ++i) {
    if (pf != nullptr) pf->Spread(i, n, 0, pf_to);
    if (dim_stride == 1) {
      ConvertContiguous<kDType>(rows[i], width, table, dst + i * ld);
    } else {
      // Strided head dimension (a borrowed tensor): correct, not fast.
      const int64_t elem = static_cast<int64_t>(DTypeSize(kDType));
      for (int d = 0; d < width; ++d) {
        const char* e = rows[i] + d * dim_stride * elem;
        if constexpr (kDType == DType::kFloat8E4M3 || kDType == DType::kFloat8E5M2) {
          dst[i * ld + d] = table[static_cast<uint8_t>(*e)];
        } else {
          dst[i * ld + d] = LoadAsFloat(e, kDType, 0);
        }
      }
    }
  }
}

KVSTREAM_INLINE void GatherRows(DType dtype, const char* const* rows, int n, int width,
                                int64_t dim_stride, const float* table, float* dst, int64_t ld,
                                TilePrefetcher* pf = nullptr, int pf_to = 0) {
  switch (dtype) {
    case DType::kFloat32:
      GatherRowsAs<DType::kFloat32>(rows, n, width, dim_stride, table, dst, ld, pf, pf_to);
      break;
    case DType::kFloat16:
      GatherRowsAs<DType::kFloat16>(rows, n, width, dim_stride, table, dst, ld, pf, pf_to);
      break;
    case DType::kBFloat16:
      GatherRowsAs<DType::kBFloat16>(rows, n, width, dim_stride, table, dst, ld, pf, pf_to);
      break;
    case DType::kFloat8E4M3:
      GatherRowsAs<DType::kFloat8E4M3>(rows, n, width, dim_stride, table, dst, ld, pf, pf_to);
      break;
    case DType::kFloat8E5M2:
      GatherRowsAs<DType::kFloat8E5M2>(rows, n, width, dim_stride, table, dst, ld, pf, pf_to);
      break;
    default:
      break;  // rejected by validation
  }
}

KVSTREAM_INLINE void LoadQueryRow(const void* src, DType dtype, int n, float scale, float* dst) {
  switch (dtype) {
    case DType::kFloat32: ConvertContiguous<DType::kFloat32>(src, n, nullptr, dst); break;
    case DType::kFloat16: ConvertContiguous<DType::kFloat16>(src, n, nullptr, dst); break;
    case DType::kBFloat16: ConvertContiguous<DType::kBFloat16>(src, n, nullptr, dst); break;
    default: break;  // rejected by validation
  }
  KVSTREAM_SIMD
  for (int i = 0; i < n; ++i) dst[i] *= scale;
}

}  // namespace cpu_fast
}  // namespace internal
}  // namespace kvstream

#endif  // KVSTREAM_ATTENTION_CPU_FAST_GATHER_H_
