// Helper kernels for kvstream_bench_cuda_kernels: a kernel that holds a stream until the
// host releases it (so that many launches queue up and run back to back, timed without
// host gaps), a streaming-read kernel (the bandwidth ceiling of a read-only kernel), a
// paged-read kernel (the reads of a paged decode without its compute), and a fill of
// random values. Plain functions over void* so the benchmark needs no CUDA
// compiler; each returns the cudaError_t of its launch as an int.
#ifndef KVSTREAM_BENCH_CUDA_BENCH_KERNELS_H_
#define KVSTREAM_BENCH_CUDA_BENCH_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace kvstream {
namespace bench {

// Enqueues a one-thread kernel that spins until *flag (pinned host memory, written by the
// host) is non-zero, or `timeout_ms` passes.
int LaunchHoldStream(const volatile int* flag, int timeout_ms, void* stream);

// Reads `bytes` (a multiple of 16) at `data` once with 16-byte loads over `num_sms` * 8
// CTAs, and writes one word per CTA to `sink` (num_sms * 8 uint32 of device memory) so
// that the loads are not removed.
int LaunchStreamingRead(const void* data, size_t bytes, uint32_t* sink, int num_sms,
                        void* stream);

// The K and V rows a decode of `seqs` sequences of `seq_len` keys reads, and nothing else.
// Row (key j, head h) of sequence s is 256 bytes at
//   table given: table[s * blocks_per_seq + (j >> block_shift)] * block_stride +
//                (j & (2^block_shift - 1)) * token_stride + h * head_stride
//   table null:  ((s * heads + h) * seq_len + j) * 256 (each sequence's head one run)
// from k and from v alike (byte offsets). The work is split as the tensor-core decode
// splits it: one CTA of 128 threads per (head, sequence, split), each split a contiguous
// range of keys, copied with cp.async through a ring of three 16 KiB stages (32 keys' K
// and V rows) so that four CTAs share an SM. One word per CTA goes to `sink` (heads *
// seqs * splits uint32 of device memory) so that the copies are not removed.
struct PagedReadArgs {
  const void* k;
  const void* v;
  const int32_t* table;  // null: contiguous runs
  int seqs;
  int seq_len;
  int heads;
  int splits;
  int blocks_per_seq;
  int block_shift;  // log2 of the block size
  int64_t block_stride;
  int64_t token_stride;
  int64_t head_stride;
  uint32_t* sink;
};
int LaunchPagedRead(const PagedReadArgs& args, void* stream);

// Fills `count` elements at `data` with values in [-1, 1) drawn from `seed`: dtype_code 0
// float32, 1 float16, 2 bfloat16, 3 fp8 e4m3, 4 fp8 e5m2 (codes of values in range).
int LaunchFillRandom(void* data, size_t count, int dtype_code, uint32_t seed, void* stream);

}  // namespace bench
}  // namespace kvstream

#endif  // KVSTREAM_BENCH_CUDA_BENCH_KERNELS_H_
