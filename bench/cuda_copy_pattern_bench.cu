// kvstream_bench_copy_pattern: how fast the cuda_ipc copy kernel moves one layer's KV blocks
// in one process, by where the blocks lie, beside one contiguous cudaMemcpyAsync of the
// same bytes in the same run. It separates what the kernel costs from what scattering costs:
//
//   contiguous   block i of the layer at offset i x block on both sides (the memcpy's access
//                pattern cut into table entries)
//   shuffled-L   a random permutation of the layer's own bytes on both sides
//   shuffled-P   blocks drawn at random from a pool of P MiB on both sides (the transport
//                benchmark's pattern, P = 256)
//   sorted-P     as shuffled-P, the table sorted by destination address
//
//   kvstream_bench_copy_pattern [--device=N] [--reps=N]
//
// Every row copies a 32 MiB or 128 MiB layer (16- or 64-token blocks of Llama-3-8B's 2 KiB per
// token per tensor: 32 KiB or 128 KiB blocks) several times, each repetition from another
// region of the pools so that the source is not left in L2, and reports the median of the
// per-copy device times (an event pair around each). Kernels: the transport's per-segment
// kernel (a persistent grid of CTAs taking whole entries, and `/e`: one CTA per entry; the
// table in device memory) at 8 and 4 vectors per thread; the same loop at other CTA widths
// (`cta<T>x<V>`: T threads, V 16-byte vectors per thread per pass, every thread reading the
// entry); `pre<T>x<V>`: as cta, each thread also loading the next entry's fields while it
// copies the current one, so that no warp waits at a barrier or on a table read between
// entries (the transport's kernel shares each entry through shared memory behind a barrier
// per entry); TMA bulk copies (`bulk<S>x<C>`); and a grid-stride copy of the contiguous
// bytes (`gridstride`) as what a plain SM copy reaches; and one cudaMemcpyBatchAsync of the
// whole table (`batch`, and `batch/ce` with the copy engines preferred), its host time per
// call on a line of its own. GB/s are of layer bytes (1e9 per second); ratio = memcpy time /
// kernel time.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_ipc/copy_kernel.cuh"
#include "cuda_ipc/copy_kernel.h"

namespace {

#define CHECK_CUDA(call)                                                              \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,               \
                   cudaGetErrorString(e_));                                           \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

using kvstream::internal::CopyRun;
using kvstream::internal::IpcCopySegment;

// One CTA of kThreads per entry, grid-stride over entries; every thread reads the entry.
template <int kThreads, int kVectors>
__global__ void __launch_bounds__(kThreads) CtaCopy(const IpcCopySegment* table, uint32_t n) {
  for (uint32_t e = blockIdx.x; e < n; e += gridDim.x) {
    // The transport's own pass loop (copy_kernel.cuh), at this CTA width.
    CopyRun<kThreads, kVectors>(reinterpret_cast<const char*>(__ldg(&table[e].src)),
                                reinterpret_cast<char*>(__ldg(&table[e].dst)),
                                __ldg(&table[e].length), threadIdx.x);
  }
}

// As CtaCopy, but each thread loads the next entry's fields into registers before it copies
// the current entry, so that no CTA waits on a table read between entries (the transport's
// CTA kernel shares them through shared memory behind a barrier instead).
template <int kThreads, int kVectors>
__global__ void __launch_bounds__(kThreads)
    CtaCopyPrefetch(const IpcCopySegment* table, uint32_t n) {
  uint32_t e = blockIdx.x;
  if (e >= n) return;
  uint64_t src = __ldg(&table[e].src);
  uint64_t dst = __ldg(&table[e].dst);
  uint64_t len = __ldg(&table[e].length);
  while (true) {
    const uint32_t next = e + gridDim.x;
    uint64_t next_src = 0, next_dst = 0, next_len = 0;
    if (next < n) {
      next_src = __ldg(&table[next].src);
      next_dst = __ldg(&table[next].dst);
      next_len = __ldg(&table[next].length);
    }
    CopyRun<kThreads, kVectors>(reinterpret_cast<const char*>(src), reinterpret_cast<char*>(dst),
                                len, threadIdx.x);
    if (next >= n) return;
    e = next;
    src = next_src;
    dst = next_dst;
    len = next_len;
  }
}

__global__ void __launch_bounds__(256) GridStrideCopy(const int4* src, int4* dst, uint64_t nvec) {
  constexpr int kVectors = 8;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x * kVectors + threadIdx.x;
       i < nvec; i += stride * kVectors) {
    int4 v[kVectors];
#pragma unroll
    for (int k = 0; k < kVectors; ++k) {
      if (i + k * blockDim.x < nvec) v[k] = __ldg(&src[i + k * blockDim.x]);
    }
#pragma unroll
    for (int k = 0; k < kVectors; ++k) {
      if (i + k * blockDim.x < nvec) dst[i + k * blockDim.x] = v[k];
    }
  }
}


// --- Bulk copies through shared memory (Hopper's cp.async.bulk, the TMA unit) ---
// One thread per CTA issues everything: chunks of an entry are loaded global -> shared into
// kStages buffers (completion on an mbarrier per buffer), and each is stored shared -> global
// as soon as it has landed; a buffer is reloaded once its store has read it.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ inline uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ inline void MbarInit(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ inline void MbarExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ inline void MbarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n KVS_WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra KVS_WAIT_%=;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ inline void BulkLoad(uint32_t smem, const void* gmem, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem),
      "l"(gmem), "r"(bytes), "r"(bar)
      : "memory");
}
__device__ inline void BulkStore(void* gmem, uint32_t smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem),
               "r"(smem), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ inline void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
__device__ inline void BulkWaitAll() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
#endif

template <int kStages>
__global__ void __launch_bounds__(32) BulkCopy(const IpcCopySegment* table, uint32_t n,
                                               uint32_t chunk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char buffers[];
  __shared__ __align__(8) uint64_t bars[kStages];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < kStages; ++s) MbarInit(SmemAddr(&bars[s]));
  uint32_t e = blockIdx.x;
  uint64_t off = 0, src = 0, dst = 0, len = 0;
  if (e < n) {
    src = __ldg(&table[e].src);
    dst = __ldg(&table[e].dst);
    len = __ldg(&table[e].length);
  }
  char* stage_dst[kStages];
  uint32_t stage_bytes[kStages];
  auto load_next = [&](int s) -> bool {
    if (e >= n) return false;
    const uint32_t b = static_cast<uint32_t>(len - off < chunk ? len - off : chunk);
    const uint32_t bar = SmemAddr(&bars[s]);
    MbarExpectTx(bar, b);
    BulkLoad(SmemAddr(buffers + static_cast<size_t>(s) * chunk),
             reinterpret_cast<const char*>(src) + off, b, bar);
    stage_dst[s] = reinterpret_cast<char*>(dst) + off;
    stage_bytes[s] = b;
    off += b;
    if (off >= len) {
      e += gridDim.x;
      off = 0;
      if (e < n) {
        src = __ldg(&table[e].src);
        dst = __ldg(&table[e].dst);
        len = __ldg(&table[e].length);
      }
    }
    return true;
  };
  int issued = 0;
  while (issued < kStages && load_next(issued)) ++issued;
  for (int i = 0; i < issued; ++i) {
    const int s = i % kStages;
    MbarWait(SmemAddr(&bars[s]), static_cast<uint32_t>(i / kStages) & 1u);
    BulkStore(stage_dst[s], SmemAddr(buffers + static_cast<size_t>(s) * chunk), stage_bytes[s]);
    if (e < n) {
      BulkWaitRead();  // the store has read the buffer
      if (load_next(s)) ++issued;
    }
  }
  BulkWaitAll();
#endif
}

// Counts 32-bit words of the table's destinations that differ from their sources.
__global__ void CountMismatches(const IpcCopySegment* table, uint32_t n, unsigned long long* bad) {
  for (uint32_t e = blockIdx.x; e < n; e += gridDim.x) {
    const uint32_t* s = reinterpret_cast<const uint32_t*>(table[e].src);
    const uint32_t* d = reinterpret_cast<const uint32_t*>(table[e].dst);
    unsigned long long local = 0;
    for (uint64_t i = threadIdx.x; i < table[e].length / 4; i += blockDim.x) local += s[i] != d[i];
    if (local) atomicAdd(bad, local);
  }
}

__global__ void FillPattern(uint32_t* p, uint64_t words) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    p[i] = static_cast<uint32_t>(i * 2654435761u);
  }
}

template <typename Launch>
float MedianMs(int reps, cudaStream_t stream, Launch launch) {
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  launch(0);  // warm-up
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(ev[2 * r], stream));
    launch(r);
    CHECK_CUDA(cudaEventRecord(ev[2 * r + 1], stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<float> ms(reps);
  for (int r = 0; r < reps; ++r) CHECK_CUDA(cudaEventElapsedTime(&ms[r], ev[2 * r], ev[2 * r + 1]));
  for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
  std::nth_element(ms.begin(), ms.begin() + reps / 2, ms.end());
  return ms[reps / 2];
}

struct Pattern {
  std::string name;
  size_t pool_bytes;  // 0: the layer's own bytes
  bool sorted;
};

// Block offsets (in blocks) for `n` blocks of a pool of `pool_blocks`: the identity, or
// distinct random blocks.
std::vector<uint64_t> Offsets(size_t n, size_t pool_blocks, bool contiguous,
                              std::mt19937_64& rng) {
  std::vector<uint64_t> out(n);
  if (contiguous) {
    std::iota(out.begin(), out.end(), 0);
    return out;
  }
  std::vector<uint64_t> all(pool_blocks);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  std::copy(all.begin(), all.begin() + n, out.begin());
  return out;
}

int Run(int device, int reps) {
  CHECK_CUDA(cudaSetDevice(device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("device %d: %s, %d SMs, L2 %d MiB\n", device, prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  constexpr size_t kPoolBytes = size_t{1} << 30;  // per side; patterns use a prefix of it
  char* src_pool = nullptr;
  char* dst_pool = nullptr;
  CHECK_CUDA(cudaMalloc(&src_pool, kPoolBytes));
  CHECK_CUDA(cudaMalloc(&dst_pool, kPoolBytes));
  FillPattern<<<1024, 256>>>(reinterpret_cast<uint32_t*>(src_pool), kPoolBytes / 4);
  CHECK_CUDA(cudaGetLastError());
  unsigned long long* bad = nullptr;
  CHECK_CUDA(cudaMalloc(&bad, sizeof(*bad)));
  CHECK_CUDA(cudaMemset(dst_pool, 0, kPoolBytes));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  constexpr int kRegions = 8;  // 8 x 128 MiB layers = 1 GiB: repetitions rotate over them
  IpcCopySegment* table = nullptr;
  CHECK_CUDA(cudaMalloc(&table, sizeof(IpcCopySegment) * 8192 * kRegions));
  std::mt19937_64 rng(1234);

  const std::vector<Pattern> patterns = {{"contiguous", 0, false},
                                         {"shuffled-L", 0, false},
                                         {"shuffled-256M", size_t{256} << 20, false},
                                         {"sorted-256M", size_t{256} << 20, true},
                                         {"shuffled-1G", size_t{1} << 30, false}};
  std::printf("%-6s %-5s %-14s %-13s %9s %9s %6s\n", "block", "MiB", "pattern", "kernel",
              "us", "GB/s", "ratio");
  for (size_t block_tokens : {16, 64}) {
    const size_t block_bytes = block_tokens * 2048;
    for (size_t layer_mib : {32, 128}) {
      const size_t layer_bytes = layer_mib << 20;
      const size_t n = layer_bytes / block_bytes;
      // The ceiling: one contiguous copy, rotating over regions of the pools.
      const float memcpy_ms = MedianMs(reps, stream, [&](int r) {
        const size_t off = (static_cast<size_t>(r) % kRegions) * layer_bytes % kPoolBytes;
        CHECK_CUDA(cudaMemcpyAsync(dst_pool + off, src_pool + off, layer_bytes,
                                   cudaMemcpyDeviceToDevice, stream));
      });
      auto row = [&](const std::string& pattern, const std::string& kernel, float ms) {
        std::printf("%-6zu %-5zu %-14s %-13s %9.1f %9.0f %6.3f\n", block_tokens, layer_mib,
                    pattern.c_str(), kernel.c_str(), ms * 1e3, layer_bytes / (ms * 1e6),
                    memcpy_ms / ms);
      };
      row("contiguous", "memcpy", memcpy_ms);
      const int grid_stride_grid = prop.multiProcessorCount * 8;
      row("contiguous", "gridstride", MedianMs(reps, stream, [&](int r) {
            const size_t off = (static_cast<size_t>(r) % kRegions) * layer_bytes % kPoolBytes;
            GridStrideCopy<<<grid_stride_grid, 256, 0, stream>>>(
                reinterpret_cast<const int4*>(src_pool + off),
                reinterpret_cast<int4*>(dst_pool + off), layer_bytes / 16);
          }));
      for (const Pattern& p : patterns) {
        const size_t pool = p.pool_bytes == 0 ? layer_bytes : p.pool_bytes;
        const bool contiguous = p.name == "contiguous";
        std::vector<IpcCopySegment> host(n * kRegions);
        for (int region = 0; region < kRegions; ++region) {
          // Regions of the layer's own bytes (contiguous, shuffled-L) are disjoint slices
          // of the pool; pooled patterns draw from their whole pool.
          const size_t base = p.pool_bytes == 0 ? region * layer_bytes % kPoolBytes : 0;
          const size_t pool_blocks = pool / block_bytes;
          std::vector<uint64_t> s = Offsets(n, pool_blocks, contiguous, rng);
          std::vector<uint64_t> d = Offsets(n, pool_blocks, contiguous, rng);
          if (p.sorted) std::sort(d.begin(), d.end());
          for (size_t i = 0; i < n; ++i) {
            IpcCopySegment& e = host[region * n + i];
            e.src = reinterpret_cast<uint64_t>(src_pool + base + s[i] * block_bytes);
            e.dst = reinterpret_cast<uint64_t>(dst_pool + base + d[i] * block_bytes);
            e.length = block_bytes;
          }
        }
        CHECK_CUDA(cudaMemcpy(table, host.data(), host.size() * sizeof(IpcCopySegment),
                              cudaMemcpyHostToDevice));
        auto entries = [&](int r) { return table + (r % kRegions) * n; };
        for (int vectors : {8, 4}) {
          auto max = kvstream::internal::IpcSegmentCopyMaxCtasPerSm(
              kvstream::internal::IpcCopyUnit::kCta, vectors);
          if (!max.ok()) {
            std::fprintf(stderr, "%s\n", max.status().ToString().c_str());
            return 1;
          }
          const int per_sm = *max;
          const int grid = static_cast<int>(
              std::min<size_t>(n, static_cast<size_t>(per_sm) * prop.multiProcessorCount));
          // A persistent grid, and one CTA per entry (the default for long tables).
          for (const int g : {grid, static_cast<int>(n)}) {
            const std::string name =
                "transport v" + std::to_string(vectors) + (g == grid ? "" : "/e");
            row(p.name, name, MedianMs(reps, stream, [&](int r) {
                  auto st = kvstream::internal::LaunchIpcSegmentCopy(
                      entries(r), static_cast<uint32_t>(n),
                      kvstream::internal::IpcTableSource::kDevice,
                      kvstream::internal::IpcCopyUnit::kCta, vectors, g, stream);
                  if (!st.ok()) std::exit(1);
                }));
          }
        }
        const int sms = prop.multiProcessorCount;
        // Correctness first: region 0 copied into a cleared pool, every word compared.
        auto check = [&](const std::string& name, auto launch_region0) {
          CHECK_CUDA(cudaMemsetAsync(dst_pool, 0, kPoolBytes, stream));
          CHECK_CUDA(cudaMemsetAsync(bad, 0, sizeof(*bad), stream));
          launch_region0();
          CountMismatches<<<1024, 256, 0, stream>>>(entries(0), static_cast<uint32_t>(n), bad);
          unsigned long long mismatches = 0;
          CHECK_CUDA(cudaMemcpyAsync(&mismatches, bad, sizeof(mismatches), cudaMemcpyDeviceToHost, stream));
          CHECK_CUDA(cudaStreamSynchronize(stream));
          if (mismatches != 0) {
            std::printf("%s: %llu words differ\n", name.c_str(), mismatches);
            std::exit(1);
          }
        };
        auto cta = [&](const char* name, auto kernel, int threads) {
          int per_sm = 0;
          CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
          const int grid = static_cast<int>(std::min<size_t>(n, static_cast<size_t>(per_sm) * sms));
          check(name, [&] {
            kernel<<<grid, threads, 0, stream>>>(entries(0), static_cast<uint32_t>(n));
          });
          row(p.name, name, MedianMs(reps, stream, [&](int r) {
                kernel<<<grid, threads, 0, stream>>>(entries(r), static_cast<uint32_t>(n));
              }));
          row(p.name, std::string(name) + "/e", MedianMs(reps, stream, [&](int r) {
                kernel<<<static_cast<int>(n), threads, 0, stream>>>(entries(r),
                                                                    static_cast<uint32_t>(n));
              }));
        };
        auto bulk = [&](const char* name, auto kernel, int stages, uint32_t chunk) {
          const int smem = stages * static_cast<int>(chunk);
          CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
          int per_sm = 0;
          CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32, smem));
          for (int k : {1, 2, 4}) {
            if (k > per_sm) break;
            const int grid = static_cast<int>(std::min<size_t>(n, static_cast<size_t>(k) * sms));
            check(name, [&] {
              kernel<<<grid, 32, smem, stream>>>(entries(0), static_cast<uint32_t>(n), chunk);
            });
            row(p.name, std::string(name) + "/" + std::to_string(k), MedianMs(reps, stream, [&](int r) {
                  kernel<<<grid, 32, smem, stream>>>(entries(r), static_cast<uint32_t>(n), chunk);
                }));
          }
        };
        // The copy engines' way: one cudaMemcpyBatchAsync of every entry (pointer arrays on
        // the host), with no flag and with cudaMemcpyFlagPreferOverlapWithCompute (copy
        // engines rather than SMs). The host time of the call is printed beside it.
        std::vector<void*> batch_dst(host.size());
        std::vector<const void*> batch_src(host.size());
        std::vector<size_t> batch_len(host.size());
        for (size_t i = 0; i < host.size(); ++i) {
          batch_dst[i] = reinterpret_cast<void*>(host[i].dst);
          batch_src[i] = reinterpret_cast<const void*>(host[i].src);
          batch_len[i] = host[i].length;
        }
        for (const unsigned flags :
             {0u, static_cast<unsigned>(cudaMemcpyFlagPreferOverlapWithCompute)}) {
          cudaMemcpyAttributes attr{};
          attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
          attr.flags = flags;
          size_t attr_index = 0;
          double host_us = 0.0;
          int calls = 0;
          auto launch = [&](int r) {
            const size_t first = static_cast<size_t>(r % kRegions) * n;
            const auto t0 = std::chrono::steady_clock::now();
            CHECK_CUDA(cudaMemcpyBatchAsync(batch_dst.data() + first, batch_src.data() + first,
                                            batch_len.data() + first, n, &attr, &attr_index, 1,
                                            stream));
            host_us +=
                std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                    .count();
            ++calls;
          };
          const std::string name = flags == 0 ? "batch" : "batch/ce";
          check(name, [&] { launch(0); });
          host_us = 0.0;
          calls = 0;
          const float ms = MedianMs(reps, stream, launch);
          row(p.name, name, ms);
          std::printf("%-6zu %-5zu %-14s %-13s host %.1f us per call\n", block_tokens, layer_mib,
                      p.name.c_str(), name.c_str(), host_us / calls);
        }
        bulk("bulk4x32k", BulkCopy<4>, 4, 32 << 10);
        bulk("bulk3x32k", BulkCopy<3>, 3, 32 << 10);
        bulk("bulk6x16k", BulkCopy<6>, 6, 16 << 10);
        bulk("bulk4x16k", BulkCopy<4>, 4, 16 << 10);
        bulk("bulk2x32k", BulkCopy<2>, 2, 32 << 10);
        cta("cta256x8", CtaCopy<256, 8>, 256);
        cta("pre256x8", CtaCopyPrefetch<256, 8>, 256);
        cta("pre256x4", CtaCopyPrefetch<256, 4>, 256);
        cta("pre512x4", CtaCopyPrefetch<512, 4>, 512);
        cta("pre128x16", CtaCopyPrefetch<128, 16>, 128);
        cta("cta128x16", CtaCopy<128, 16>, 128);
        cta("cta512x4", CtaCopy<512, 4>, 512);
        cta("cta1024x2", CtaCopy<1024, 2>, 1024);
      }
      CHECK_CUDA(cudaGetLastError());
    }
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaFree(table));
  CHECK_CUDA(cudaFree(bad));
  CHECK_CUDA(cudaFree(src_pool));
  CHECK_CUDA(cudaFree(dst_pool));
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int device = 0;
  int reps = 40;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--device=", 9) == 0) {
      device = std::atoi(argv[i] + 9);
    } else if (std::strncmp(argv[i], "--reps=", 7) == 0) {
      reps = std::max(1, std::atoi(argv[i] + 7));
    } else {
      std::fprintf(stderr, "usage: kvstream_bench_copy_pattern [--device=N] [--reps=N]\n");
      return 2;
    }
  }
  return Run(device, reps);
}
