// The CUDA prefill attention kernel (attention/src/cuda/prefill_attention.cuh) compiled by
// the host compiler and run under a small warp emulator, against the golden CPU reference.
// Needs no GPU: it checks the kernel's index math (packed GQA rows, page-table walks,
// swizzled shared memory, the ldmatrix / mma fragment layouts as the PTX ISA defines them,
// masks, online softmax, the copy pipeline's stages) wherever the CUDA headers exist.
//
// The emulator runs one CTA at a time; each CUDA thread is a fiber (ucontext) with its own
// stack, and every warp-collective operation (ldmatrix, mma, shuffle, __syncwarp) and
// __syncthreads is a barrier among the fibers concerned. cp.async copies land only at
// cp.async.wait_group, so a read of a tile before its wait sees stale data. Misaligned
// cp.async / ldmatrix addresses, out-of-bounds shared memory and divergent barriers
// (deadlock) are reported as failures.
#define KVSTREAM_PREFILL_EMULATION 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "attention_test_util.h"
#include "cuda/kernel_params.h"
#include "kvstream/attention/backend.h"
#include "kvstream/attention/cpu_attention.h"
#include "kvstream/common/dtype.h"

// cuda_common.cuh's `#pragma unroll` is an error for GCC 12 with -Wall -Werror (and its
// diagnostic pragmas cannot silence it), so the conversions the kernel uses from it are
// given here, with the same results, and the header itself is skipped.
#define KVSTREAM_ATTENTION_CUDA_CUDA_COMMON_CUH_
namespace kvstream {
namespace internal {
namespace cuda {
inline float ToFloat(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
inline float ToFloat(__nv_fp8_e5m2 x) { return static_cast<float>(x); }
template <typename T>
T FromFloat(float x);
template <>
inline __half FromFloat<__half>(float x) { return __float2half_rn(x); }
template <>
inline __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
}  // namespace cuda
}  // namespace internal
}  // namespace kvstream

// ---------------------------------------------------------------------------------------
// What a host compiler lacks of CUDA's device dialect.
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __grid_constant__
#define __grid_constant__
#endif

namespace kvstream {
namespace internal {
namespace cuda {
namespace emulation {

// One emulated CTA: shared memory, fibers, barriers and the warps' exchange slots.
class Cta {
 public:
  Cta(int num_threads, size_t smem_bytes)
      : num_threads_(num_threads),
        smem_(smem_bytes + 16),
        fibers_(static_cast<size_t>(num_threads)),
        warp_arrived_(static_cast<size_t>(num_threads / 32), 0),
        exchange_(static_cast<size_t>(num_threads / 32) * 2 * 32) {
    for (Fiber& f : fibers_) f.stack.resize(kStackBytes);
    // Garbage, not zeros: the kernel must not rely on shared memory it did not write.
    for (size_t i = 0; i < smem_.size(); ++i) smem_[i] = static_cast<uint8_t>(i * 131 + 7);
  }

  // How the emulation may differ from one run to the next, to expose races: cp.async data
  // lands at the wait (a read before the wait sees stale data) or at the issue (a copy
  // into a buffer that others still read clobbers it), and fibers run in thread order or
  // in reverse.
  struct Mode {
    bool copies_land_at_issue = false;
    bool reverse_order = false;
  };
  void set_mode(Mode mode) { mode_ = mode; }
  bool copies_land_at_issue() const { return mode_.copies_land_at_issue; }

  // Runs `body` once per thread of block `block`. Returns false (and says why in error())
  // on a deadlock or a fault.
  bool Run(dim3 block, const std::function<void()>& body) {
    block_ = block;
    body_ = &body;
    current = this;
    for (int t = 0; t < num_threads_; ++t) {
      Fiber& f = fibers_[static_cast<size_t>(t)];
      f.done = false;
      f.blocked = false;
      f.pending.clear();
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack.data();
      f.context.uc_stack.ss_size = f.stack.size();
      f.context.uc_link = &scheduler_;
      makecontext(&f.context, &Cta::Trampoline, 0);
    }
    int finished = 0;
    while (finished < num_threads_ && error_.empty()) {
      bool progress = false;
      for (int i = 0; i < num_threads_ && error_.empty(); ++i) {
        const int t = mode_.reverse_order ? num_threads_ - 1 - i : i;
        Fiber& f = fibers_[static_cast<size_t>(t)];
        if (f.done || f.blocked) continue;
        running_ = t;
        swapcontext(&scheduler_, &f.context);
        progress = true;
        if (f.done) ++finished;
      }
      if (!progress && finished < num_threads_ && error_.empty()) {
        error_ = "deadlock: threads wait at barriers that others never reach";
      }
    }
    current = nullptr;
    return error_.empty();
  }

  const std::string& error() const { return error_; }
  int thread() const { return running_; }
  dim3 block() const { return block_; }
  uint8_t* smem() { return smem_.data(); }

  void Fault(const std::string& what) {
    if (error_.empty()) error_ = absl::StrCat("thread ", running_, ": ", what);
  }
  bool InSmem(uint32_t address, uint32_t bytes) const {
    return static_cast<size_t>(address) + bytes <= smem_.size() - 16;
  }

  void SyncThreads() {
    Fiber& self = fibers_[static_cast<size_t>(running_)];
    self.blocked = true;
    if (++cta_arrived_ == num_threads_) {
      cta_arrived_ = 0;
      for (Fiber& f : fibers_) f.blocked = false;
    }
    while (self.blocked) Yield();
  }

  // Exchange slots: every lane deposits its operands (Deposit), waits for its warp
  // (WarpSync), reads any lane's deposit (Read), then switches to the other set of slots
  // (EndCollective): a lane can run at most one collective ahead of the others, so two
  // sets never mix.
  struct Slot {
    uint32_t u[8];
    float f[4];
  };
  void WarpSync() {
    const int warp = running_ / 32;
    Fiber& self = fibers_[static_cast<size_t>(running_)];
    self.blocked = true;
    int& arrived = warp_arrived_[static_cast<size_t>(warp)];
    if (++arrived == 32) {
      arrived = 0;
      for (int l = 0; l < 32; ++l) fibers_[static_cast<size_t>(warp * 32 + l)].blocked = false;
    }
    while (self.blocked) Yield();
  }
  void EndCollective() {
    Fiber& self = fibers_[static_cast<size_t>(running_)];
    self.set ^= 1;
  }
  Slot& Deposit() {
    Fiber& self = fibers_[static_cast<size_t>(running_)];
    return exchange_[(static_cast<size_t>(running_ / 32) * 2 + static_cast<size_t>(self.set)) *
                         32 +
                     static_cast<size_t>(running_ & 31)];
  }
  Slot& Read(int lane) {
    Fiber& self = fibers_[static_cast<size_t>(running_)];
    return exchange_[(static_cast<size_t>(running_ / 32) * 2 + static_cast<size_t>(self.set)) *
                         32 +
                     static_cast<size_t>(lane)];
  }

  struct PendingCopy {
    uint32_t dst;
    const void* src;
    bool valid;
  };
  std::vector<PendingCopy>& pending() { return fibers_[static_cast<size_t>(running_)].pending; }

  static Cta* current;

 private:
  static constexpr size_t kStackBytes = 256 * 1024;
  struct Fiber {
    ucontext_t context;
    std::vector<char> stack;
    bool done = false;
    bool blocked = false;
    int set = 0;
    std::vector<PendingCopy> pending;
  };

  static void Trampoline() {
    Cta* cta = current;
    (*cta->body_)();
    cta->fibers_[static_cast<size_t>(cta->running_)].done = true;
    // Returning resumes uc_link, the scheduler.
  }
  void Yield() { swapcontext(&fibers_[static_cast<size_t>(running_)].context, &scheduler_); }

  int num_threads_;
  std::vector<uint8_t> smem_;
  std::vector<Fiber> fibers_;
  std::vector<int> warp_arrived_;
  std::vector<Slot> exchange_;
  int cta_arrived_ = 0;
  int running_ = 0;
  Mode mode_;
  dim3 block_;
  const std::function<void()>* body_ = nullptr;
  ucontext_t scheduler_;
  std::string error_;
};

Cta* Cta::current = nullptr;

inline uint8_t* SharedMemory() { return Cta::current->smem(); }

// A collective: deposit, wait for the warp, compute from every lane's deposit, switch sets.
template <typename Fill, typename Use>
void Collective(Fill fill, Use use) {
  Cta& cta = *Cta::current;
  fill(cta.Deposit());
  cta.WarpSync();
  use(cta);
  cta.EndCollective();
}

}  // namespace emulation

// ---- The PTX wrappers the kernel calls, emulated (see prefill_attention.cuh).

#define KVSTREAM_PREFILL_UNROLL
#define KVSTREAM_PREFILL_SHARED_MEMORY(name) \
  uint8_t* const name = ::kvstream::internal::cuda::emulation::SharedMemory()

inline uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(static_cast<const uint8_t*>(p) - emulation::SharedMemory());
}

inline void CpAsync16(uint32_t dst, const void* src, bool valid) {
  emulation::Cta& cta = *emulation::Cta::current;
  if (dst % 16 != 0 || !cta.InSmem(dst, 16)) cta.Fault(absl::StrCat("cp.async dst ", dst));
  if (valid && reinterpret_cast<uintptr_t>(src) % 16 != 0) cta.Fault("cp.async src unaligned");
  if (!cta.error().empty()) return;
  if (cta.copies_land_at_issue()) {
    if (valid) {
      std::memcpy(cta.smem() + dst, src, 16);
    } else {
      std::memset(cta.smem() + dst, 0, 16);
    }
    return;
  }
  cta.pending().push_back({dst, src, valid});
}
inline void CpAsyncCommit() {}
inline void CpAsyncWaitAll() {
  emulation::Cta& cta = *emulation::Cta::current;
  for (const emulation::Cta::PendingCopy& c : cta.pending()) {
    if (c.valid) {
      std::memcpy(cta.smem() + c.dst, c.src, 16);
    } else {
      std::memset(cta.smem() + c.dst, 0, 16);
    }
  }
  cta.pending().clear();
}

inline uint16_t LoadU16(emulation::Cta& cta, uint32_t address) {
  if (address % 2 != 0 || !cta.InSmem(address, 2)) cta.Fault(absl::StrCat("ldmatrix ", address));
  uint16_t v = 0;
  if (cta.InSmem(address, 2)) std::memcpy(&v, cta.smem() + address, 2);
  return v;
}

// ldmatrix .x4: lanes 8i .. 8i+7 give the row addresses of matrix i; lane l receives row
// l / 4, columns 2 (l % 4) and +1 of each matrix (transposed: rows 2 (l % 4) and +1 of
// column l / 4).
inline void LdMatrixEmulated(uint32_t (&r)[4], uint32_t address, bool trans) {
  emulation::Collective([&](emulation::Cta::Slot& s) { s.u[0] = address; },
                        [&](emulation::Cta& cta) {
                          const int lane = cta.thread() & 31;
                          const int g = lane >> 2;
                          const int t = lane & 3;
                          for (int i = 0; i < 4; ++i) {
                            for (int j = 0; j < 8; ++j) {
                              const uint32_t row = cta.Read(8 * i + j).u[0];
                              if (row % 16 != 0) cta.Fault("ldmatrix row address unaligned");
                            }
                            uint32_t lo, hi;
                            if (!trans) {
                              const uint32_t row = cta.Read(8 * i + g).u[0];
                              lo = LoadU16(cta, row + 4 * t);
                              hi = LoadU16(cta, row + 4 * t + 2);
                            } else {
                              lo = LoadU16(cta, cta.Read(8 * i + 2 * t).u[0] + 2 * g);
                              hi = LoadU16(cta, cta.Read(8 * i + 2 * t + 1).u[0] + 2 * g);
                            }
                            r[i] = lo | (hi << 16);
                          }
                        });
}
inline void LdMatrixX4(uint32_t (&r)[4], uint32_t address) { LdMatrixEmulated(r, address, false); }
inline void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t address) {
  LdMatrixEmulated(r, address, true);
}

template <typename T>
float HalfBits(uint32_t bits) {
  const uint16_t b = static_cast<uint16_t>(bits);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t f = static_cast<uint32_t>(b) << 16;
    float x;
    std::memcpy(&x, &f, 4);
    return x;
  } else {
    __half_raw raw;
    raw.x = b;
    return __half2float(__half(raw));
  }
}

// mma.m16n8k16 .row.col, fragments as in the PTX ISA ("Matrix Fragments for mma.m16n8k16
// with floating point type"), g = lane / 4, t = lane % 4:
//   A: a0,a1 (g, 2t..2t+1)  a2,a3 (g+8, 2t..)  a4,a5 (g, 2t+8..)  a6,a7 (g+8, 2t+8..)
//   B: b0,b1 (k 2t..2t+1, n g)  b2,b3 (k 2t+8.., n g)
//   C: c0,c1 (g, 2t..2t+1)  c2,c3 (g+8, 2t..2t+1)
template <typename T>
void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emulation::Collective(
      [&](emulation::Cta::Slot& s) {
        for (int i = 0; i < 4; ++i) s.u[i] = a[i];
        s.u[4] = b0;
        s.u[5] = b1;
      },
      [&](emulation::Cta& cta) {
        float A[16][16], B[16][8];
        for (int l = 0; l < 32; ++l) {
          const emulation::Cta::Slot& s = cta.Read(l);
          const int g = l >> 2, t = l & 3;
          for (int e = 0; e < 2; ++e) {
            A[g][2 * t + e] = HalfBits<T>(s.u[0] >> (16 * e));
            A[g + 8][2 * t + e] = HalfBits<T>(s.u[1] >> (16 * e));
            A[g][2 * t + 8 + e] = HalfBits<T>(s.u[2] >> (16 * e));
            A[g + 8][2 * t + 8 + e] = HalfBits<T>(s.u[3] >> (16 * e));
            B[2 * t + e][g] = HalfBits<T>(s.u[4] >> (16 * e));
            B[2 * t + 8 + e][g] = HalfBits<T>(s.u[5] >> (16 * e));
          }
        }
        const int lane = cta.thread() & 31;
        const int g = lane >> 2, t = lane & 3;
        for (int e = 0; e < 4; ++e) {
          const int row = g + 8 * (e >> 1);
          const int col = 2 * t + (e & 1);
          float sum = c[e];
          for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
          c[e] = sum;
        }
      });
}

inline float FastExp2(float x) { return std::exp2(x); }

}  // namespace cuda
}  // namespace internal
}  // namespace kvstream

// CUDA built-ins the kernel uses, for the emulator.
inline void __syncthreads() { kvstream::internal::cuda::emulation::Cta::current->SyncThreads(); }
inline void __syncwarp() {
  kvstream::internal::cuda::emulation::Collective([](auto&) {}, [](auto&) {});
}
inline float __shfl_xor_sync(unsigned /*mask*/, float value, int lane_mask) {
  float result = 0;
  kvstream::internal::cuda::emulation::Collective(
      [&](auto& s) { s.f[0] = value; },
      [&](auto& cta) { result = cta.Read((cta.thread() & 31) ^ lane_mask).f[0]; });
  return result;
}
inline float __fdividef(float a, float b) { return a / b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
#define threadIdx \
  (dim3(static_cast<unsigned>(::kvstream::internal::cuda::emulation::Cta::current->thread())))
#define blockIdx (::kvstream::internal::cuda::emulation::Cta::current->block())

#include "cuda/prefill_attention.cuh"  // NOLINT(build/include_order): after the emulation

#undef threadIdx
#undef blockIdx

namespace kvstream {
namespace {

using ::kvstream::testing_util::AttnCase;
using ::kvstream::testing_util::AttnProblem;
using ::kvstream::testing_util::SeqSpec;
using ::kvstream::testing_util::TestLayout;

// Runs the kernel for padded head size D and query type T over the whole grid.
using EmulationMode = internal::cuda::emulation::Cta::Mode;

template <int D, typename T, int Variant = internal::cuda::kPrefillBaseline>
absl::Status EmulateTyped(const internal::PagedKernelParams& kp,
                          const internal::cuda::PrefillOptions& options, EmulationMode mode) {
  using Traits = internal::cuda::PrefillTraits<D, Variant>;
  const bool fp8_async = options.load_mode == internal::cuda::kPrefillAsyncFp8;
  internal::cuda::emulation::Cta cta(Traits::kThreads,
                                     static_cast<size_t>(Traits::SmemBytes(fp8_async)));
  cta.set_mode(mode);
  const std::function<void()> body = [&] {
    internal::cuda::PrefillAttentionKernel<D, T, Variant>(kp, options);
  };
  for (unsigned y = 0; y < static_cast<unsigned>(kp.num_seqs); ++y) {
    for (unsigned x = 0; x < static_cast<unsigned>(kp.num_kv_heads * options.num_m_tiles);
         ++x) {
      if (!cta.Run(dim3(x, y), body)) {
        return absl::InternalError(absl::StrCat("block (", x, ", ", y, "): ", cta.error()));
      }
    }
  }
  return absl::OkStatus();
}

// The launcher's dispatch, with host memory standing in for device memory. `fast`: the
// fast variant, which must apply (PrefillFastApplies), as LaunchPrefillAttention's kFast.
absl::Status Emulate(const PagedAttentionParams& host, EmulationMode mode, bool fast) {
  PagedAttentionParams dev = host;
  dev.cache.memory = MemoryKind::kDevice;  // host pointers play the device's
  dev.host.query_start_loc = host.query_start_loc;
  dev.host.seq_lens = host.seq_lens;
  dev.host.block_table = host.block_table;
  dev.host.alibi_slopes = host.alibi_slopes;
  absl::StatusOr<internal::PagedKernelParams> kp = internal::MakePagedKernelParams(dev);
  if (!kp.ok()) return kp.status();
  const internal::cuda::PrefillOptions options =
      internal::cuda::ChoosePrefillOptions(*kp, host.cache.spec.dtype);
  const bool bf16 = host.q_dtype == DType::kBFloat16;
  if (fast) {
    constexpr int kFast = internal::cuda::kPrefillFast;
    if (!internal::cuda::PrefillFastApplies(*kp, options)) {
      return absl::InvalidArgumentError("the fast variant does not apply to this case");
    }
    if (internal::cuda::PrefillPaddedHeadDim(kp->head_size, kp->head_size_v) == 64) {
      return bf16 ? EmulateTyped<64, __nv_bfloat16, kFast>(*kp, options, mode)
                  : EmulateTyped<64, __half, kFast>(*kp, options, mode);
    }
    return bf16 ? EmulateTyped<128, __nv_bfloat16, kFast>(*kp, options, mode)
                : EmulateTyped<128, __half, kFast>(*kp, options, mode);
  }
  switch (internal::cuda::PrefillPaddedHeadDim(kp->head_size, kp->head_size_v)) {
    case 64:
      return bf16 ? EmulateTyped<64, __nv_bfloat16>(*kp, options, mode)
                  : EmulateTyped<64, __half>(*kp, options, mode);
    case 128:
      return bf16 ? EmulateTyped<128, __nv_bfloat16>(*kp, options, mode)
                  : EmulateTyped<128, __half>(*kp, options, mode);
    default:
      return bf16 ? EmulateTyped<256, __nv_bfloat16>(*kp, options, mode)
                  : EmulateTyped<256, __half>(*kp, options, mode);
  }
}

void ExpectEmulationMatchesReference(AttnProblem& pb, bool dense, EmulationMode mode,
                                     bool fast) {
  const AttnCase& c = pb.config();
  std::vector<uint8_t> ref_out = pb.NewOut();
  ASSERT_TRUE(RunAttentionReference(pb.params(ref_out)).ok());
  std::vector<uint8_t> out = pb.NewOut();
  PagedAttentionParams p = pb.params(out);
  const size_t e = DTypeSize(c.q_dtype);
  const int64_t q_row = int64_t{p.num_heads} * c.head_size;
  const int64_t o_row = int64_t{p.num_heads} * c.head_size_v;
  std::vector<uint8_t> dense_q, dense_out;
  if (dense) {
    // 16-byte aligned copies (vector storage is at least 16-byte aligned from operator new).
    dense_q.resize(static_cast<size_t>(p.num_tokens * q_row) * e);
    for (int64_t t = 0; t < p.num_tokens; ++t) {
      std::memcpy(dense_q.data() + t * q_row * e,
                  static_cast<const uint8_t*>(p.q) + t * p.q_token_stride * e,
                  static_cast<size_t>(q_row) * e);
    }
    dense_out.assign(static_cast<size_t>(p.num_tokens * o_row) * e, AttnProblem::kSentinel);
    p.q = dense_q.data();
    p.q_token_stride = q_row;
    p.out = dense_out.data();
    p.o_token_stride = o_row;
  }
  const absl::Status st = Emulate(p, mode, fast);
  ASSERT_TRUE(st.ok()) << st;
  if (dense) {
    for (int64_t t = 0; t < p.num_tokens; ++t) {
      std::memcpy(out.data() + t * pb.params(ref_out).o_token_stride * e,
                  dense_out.data() + t * o_row * e, static_cast<size_t>(o_row) * e);
    }
  }
  EXPECT_EQ(pb.CountStrayWrites(out), 0);
  const float tol = c.out_dtype == DType::kFloat16 ? 4e-3f : 1.2e-2f;
  int failures = 0;
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    for (int t = 0; t < c.seqs[s].query_len; ++t) {
      const int64_t row = pb.query_start(s) + t;
      for (int h = 0; h < pb.num_heads(); ++h) {
        for (int d = 0; d < c.head_size_v; ++d) {
          const float want = pb.Out(ref_out, row, h, d);
          const float got = pb.Out(out, row, h, d);
          if (!(std::fabs(want - got) <= tol + 1e-2f * std::fabs(want)) && ++failures <= 5) {
            ADD_FAILURE() << "seq " << s << " token " << t << " head " << h << " d " << d
                          << ": reference " << want << " emulated kernel " << got;
          }
        }
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

struct EmuCase {
  const char* name;
  int head_size, head_size_v, kv_heads, group, block_size;
  DType q_dtype, cache_dtype;
  KvQuantMode quant;
  TestLayout layout;
  bool causal;
  int window;
  bool alibi;
  float cap;
  bool dense;
  bool long_batch = false;  // many query and key tiles
  bool fast = false;        // the fast variant (PrefillVariant::kFast) instead of the baseline
};

class CudaPrefillEmulationTest : public ::testing::TestWithParam<EmuCase> {};

TEST_P(CudaPrefillEmulationTest, KernelMatchesReference) {
  const EmuCase& ec = GetParam();
  AttnCase c;
  c.head_size = ec.head_size;
  c.head_size_v = ec.head_size_v;
  c.num_kv_heads = ec.kv_heads;
  c.group = ec.group;
  c.block_size = ec.block_size;
  c.q_dtype = ec.q_dtype;
  c.out_dtype = ec.q_dtype;
  c.cache_dtype = ec.cache_dtype;
  c.quant = ec.quant;
  c.layout = ec.layout;
  c.causal = ec.causal;
  c.sliding_window = ec.window;
  c.alibi = ec.alibi;
  c.soft_cap = ec.cap;
  c.scale = 0.3f;
  // Prefill across two query tiles and three key tiles, chunked prefill, decode rows, an
  // empty query.
  c.seqs = {{0, 70}, {75, 9}, {130, 1}, {0, 1}, {12, 0}};
  if (ec.long_batch) c.seqs = {{0, 300}, {100, 77}, {400, 1}, {3, 1}, {0, 5}};
  c.pad_tokens = 2;
  c.seed = 5;
  AttnProblem pb(c);
  for (EmulationMode mode : {EmulationMode{false, false}, EmulationMode{true, true}}) {
    SCOPED_TRACE(mode.copies_land_at_issue ? "copies land at issue, reverse order"
                                           : "copies land at wait, thread order");
    ExpectEmulationMatchesReference(pb, ec.dense, mode, ec.fast);
  }
}

constexpr DType kBf16 = DType::kBFloat16;
constexpr DType kF16 = DType::kFloat16;
INSTANTIATE_TEST_SUITE_P(
    Cases, CudaPrefillEmulationTest,
    ::testing::Values(
        EmuCase{"d128_bf16_gqa4_dense", 128, 128, 2, 4, 16, kBf16, kBf16, KvQuantMode::kNone,
                TestLayout::kNHD, true, 0, false, 0, true},
        EmuCase{"d128_f16_mha_strided_hnd_bs5", 128, 128, 2, 1, 5, kF16, kF16,
                KvQuantMode::kNone, TestLayout::kHND, true, 0, false, 0, false},
        EmuCase{"d64_bf16_window_alibi_cap_bs1", 64, 64, 1, 3, 1, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, true, 20, true, 2.0f, true},
        EmuCase{"d64_48_f16_bidir_window", 64, 48, 2, 2, 16, kF16, kF16, KvQuantMode::kNone,
                TestLayout::kHND, false, 30, false, 0, true},
        EmuCase{"d256_192_128_bf16_bidir", 192, 128, 1, 2, 16, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, false, 0, false, 0, true},
        EmuCase{"d128_e4m3_perhead_async", 128, 128, 2, 2, 16, kBf16, DType::kFloat8E4M3,
                KvQuantMode::kPerHead, TestLayout::kNHD, true, 0, true, 0, true},
        EmuCase{"d128_80_e5m2_element_path", 80, 80, 2, 2, 16, kF16, DType::kFloat8E5M2,
                KvQuantMode::kPerTensor, TestLayout::kHND, true, 0, false, 0, false},
        EmuCase{"d128_96_48_e4m3_padded_async", 96, 48, 2, 2, 16, kF16, DType::kFloat8E4M3,
                KvQuantMode::kPerTensor, TestLayout::kNHD, true, 0, false, 0, true},
        EmuCase{"d128_bf16_padded_layout", 128, 128, 2, 2, 16, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kPadded, true, 0, false, 0, false},
        EmuCase{"long_d128_bf16_gqa4_causal", 128, 128, 1, 4, 16, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, true, 0, false, 0, true, true},
        EmuCase{"long_d128_f16_causal_window5_alibi_cap", 128, 128, 1, 2, 16, kF16, kF16,
                KvQuantMode::kNone, TestLayout::kHND, true, 5, true, 30.0f, true, true},
        EmuCase{"long_d64_bf16_bidir_window70_mqa8_bs5", 64, 64, 1, 8, 5, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, false, 70, false, 0, false, true},
        EmuCase{"long_d256_f16_e5m2_perhead_bidir", 256, 256, 2, 1, 16, kF16,
                DType::kFloat8E5M2, KvQuantMode::kPerHead, TestLayout::kNHD, false, 0, false, 0,
                true, true},
        // The fast variant (8 warps x 16 rows, unmasked blocks computed and masked).
        EmuCase{"fast_d128_bf16_gqa4_causal", 128, 128, 2, 4, 16, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, true, 0, false, 0, true, false, true},
        EmuCase{"fast_d128_f16_gqa4_window_alibi_cap_bs5", 128, 128, 1, 4, 5, kF16, kF16,
                KvQuantMode::kNone, TestLayout::kHND, true, 20, true, 2.0f, false, false, true},
        EmuCase{"fast_long_d128_bf16_gqa4_causal_window70_alibi_cap", 128, 128, 1, 4, 16,
                kBf16, kBf16, KvQuantMode::kNone, TestLayout::kNHD, true, 70, true, 30.0f, true,
                true, true},
        EmuCase{"fast_d64_bf16_bidir_window_mqa8_bs5", 64, 64, 1, 8, 5, kBf16, kBf16,
                KvQuantMode::kNone, TestLayout::kNHD, false, 30, false, 0, true, false, true}),
    [](const auto& test_info) { return std::string(test_info.param.name); });

}  // namespace
}  // namespace kvstream
