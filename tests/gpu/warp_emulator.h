// A small warp emulator for running CUDA kernels on the host (tests only): every thread of
// one CTA is a fiber (ucontext) with its own stack; warp collectives (ldmatrix, mma.sync,
// shuffles, __syncwarp) and __syncthreads are barriers among the fibers concerned, with
// the fragment layouts the PTX ISA defines. cp.async copies are tracked per commit group
// and land only at cp.async.wait_group (or, in a second mode, at issue, to expose copies
// into buffers that other threads still read). Misaligned cp.async / ldmatrix addresses,
// shared memory out of bounds and divergent barriers (deadlock) are reported as faults.
//
// The kernels take their PTX wrappers from attention/src/cuda/mma_ptx.cuh; with
// KVSTREAM_CUDA_EMULATION defined before this header, the end of this file defines them
// instead, forwarding to the functions below:
//
//   #define KVSTREAM_CUDA_EMULATION 1
//   #include "warp_emulator.h"
//   #include "cuda/decode_tc_attention.cuh"
//   #undef threadIdx
//   #undef blockIdx
//
// and runs every CTA of the grid with Cta::Run. One CTA at a time; not thread-safe.
#ifndef KVSTREAM_TESTS_GPU_WARP_EMULATOR_H_
#define KVSTREAM_TESTS_GPU_WARP_EMULATOR_H_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvstream {
namespace gpu_test {
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
      f.committed = 0;
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
    int group;  // the commit group it belongs to: the calling thread's committed() then
  };
  std::vector<PendingCopy>& pending() { return fibers_[static_cast<size_t>(running_)].pending; }
  // Commit groups the calling thread has closed (cp.async.commit_group) in this run.
  int& committed() { return fibers_[static_cast<size_t>(running_)].committed; }

  static Cta* current;

 private:
  static constexpr size_t kStackBytes = 256 * 1024;
  struct Fiber {
    ucontext_t context;
    std::vector<char> stack;
    bool done = false;
    bool blocked = false;
    int set = 0;
    int committed = 0;
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


inline Cta* Cta::current = nullptr;

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

// ---- PTX instructions.

inline uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(static_cast<const uint8_t*>(p) - SharedMemory());
}

inline void LandCopy(Cta& cta, const Cta::PendingCopy& c) {
  if (c.valid) {
    std::memcpy(cta.smem() + c.dst, c.src, 16);
  } else {
    std::memset(cta.smem() + c.dst, 0, 16);
  }
}

// cp.async.cg.shared.global [dst], [src], 16, (valid ? 16 : 0).
inline void CpAsync16(uint32_t dst, const void* src, bool valid) {
  Cta& cta = *Cta::current;
  if (dst % 16 != 0 || !cta.InSmem(dst, 16)) cta.Fault(absl::StrCat("cp.async dst ", dst));
  if (valid && reinterpret_cast<uintptr_t>(src) % 16 != 0) cta.Fault("cp.async src unaligned");
  if (!cta.error().empty()) return;
  const Cta::PendingCopy copy{dst, src, valid, cta.committed()};
  if (cta.copies_land_at_issue()) {
    LandCopy(cta, copy);
    return;
  }
  cta.pending().push_back(copy);
}
inline void CpAsyncCommit() { ++Cta::current->committed(); }
// cp.async.wait_group n: every committed group but the n most recent has landed.
inline void CpAsyncWaitGroup(int n) {
  Cta& cta = *Cta::current;
  std::vector<Cta::PendingCopy>& pending = cta.pending();
  std::vector<Cta::PendingCopy> rest;
  for (const Cta::PendingCopy& c : pending) {
    if (c.group < cta.committed() - n) {
      LandCopy(cta, c);
    } else {
      rest.push_back(c);
    }
  }
  pending.swap(rest);
}

inline uint16_t LoadU16(Cta& cta, uint32_t address) {
  if (address % 2 != 0 || !cta.InSmem(address, 2)) cta.Fault(absl::StrCat("ldmatrix ", address));
  uint16_t v = 0;
  if (cta.InSmem(address, 2)) std::memcpy(&v, cta.smem() + address, 2);
  return v;
}

// ldmatrix .x4: lanes 8i .. 8i+7 give the row addresses of matrix i; lane l receives row
// l / 4, columns 2 (l % 4) and +1 of each matrix (transposed: rows 2 (l % 4) and +1 of
// column l / 4).
inline void LdMatrixX4(uint32_t (&r)[4], uint32_t address, bool trans) {
  Collective([&](Cta::Slot& s) { s.u[0] = address; },
             [&](Cta& cta) {
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
  Collective(
      [&](Cta::Slot& s) {
        for (int i = 0; i < 4; ++i) s.u[i] = a[i];
        s.u[4] = b0;
        s.u[5] = b1;
      },
      [&](Cta& cta) {
        float A[16][16], B[16][8];
        for (int l = 0; l < 32; ++l) {
          const Cta::Slot& s = cta.Read(l);
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

// movmatrix.m8n8.trans.b16: lane l holds row l / 4, columns 2 (l % 4) and +1 of an 8x8
// matrix x and receives the same places of x^T: x^T[g][2t + e] = x[2t + e][g], which lane
// 4 (2t + e) + g / 2 holds in half g % 2.
inline uint32_t MovMatrixTrans(uint32_t x) {
  uint32_t result = 0;
  Collective([&](Cta::Slot& s) { s.u[0] = x; },
             [&](Cta& cta) {
               const int lane = cta.thread() & 31;
               const int g = lane >> 2;
               const int t = lane & 3;
               for (int e = 0; e < 2; ++e) {
                 const uint32_t word = cta.Read(4 * (2 * t + e) + g / 2).u[0];
                 result |= ((word >> (16 * (g % 2))) & 0xffffu) << (16 * e);
               }
             });
  return result;
}

inline void SyncThreads() { Cta::current->SyncThreads(); }
inline void SyncWarp() { Collective([](auto&) {}, [](auto&) {}); }
inline float ShflXor(float value, int lane_mask) {
  float result = 0;
  Collective([&](auto& s) { s.f[0] = value; },
             [&](auto& cta) { result = cta.Read((cta.thread() & 31) ^ lane_mask).f[0]; });
  return result;
}
inline bool AnyLane(bool predicate) {
  bool result = false;
  Collective([&](auto& s) { s.u[0] = predicate ? 1u : 0u; },
             [&](auto& cta) {
               for (int l = 0; l < 32; ++l) result = result || cta.Read(l).u[0] != 0;
             });
  return result;
}

}  // namespace emulation
}  // namespace gpu_test
}  // namespace kvstream

// The PTX wrappers of attention/src/cuda/mma_ptx.cuh, emulated: a test defines
// KVSTREAM_CUDA_EMULATION, includes this header, then the kernel's header.
#if defined(KVSTREAM_CUDA_EMULATION)
#define KVSTREAM_CUDA_UNROLL
#define KVSTREAM_CUDA_SHARED_MEMORY(name) \
  uint8_t* const name = ::kvstream::gpu_test::emulation::SharedMemory()

// What a host compiler lacks of CUDA's device dialect, and the built-ins the kernels use.
// threadIdx and blockIdx are macros: a test #undefs them after including the kernel.
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __grid_constant__
#define __grid_constant__
#endif
inline void __syncthreads() { kvstream::gpu_test::emulation::SyncThreads(); }
inline void __syncwarp() { kvstream::gpu_test::emulation::SyncWarp(); }
inline float __shfl_xor_sync(unsigned /*mask*/, float value, int lane_mask) {
  return kvstream::gpu_test::emulation::ShflXor(value, lane_mask);
}
inline int __any_sync(unsigned /*mask*/, bool predicate) {
  return kvstream::gpu_test::emulation::AnyLane(predicate) ? 1 : 0;
}
inline float __fdividef(float a, float b) { return a / b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
#define threadIdx \
  (dim3(static_cast<unsigned>(::kvstream::gpu_test::emulation::Cta::current->thread())))
#define blockIdx (::kvstream::gpu_test::emulation::Cta::current->block())

namespace kvstream {
namespace internal {
namespace ptx {

inline uint32_t SmemAddress(const void* p) { return gpu_test::emulation::SmemAddress(p); }
inline void CpAsync16(uint32_t dst, const void* src, bool valid) {
  gpu_test::emulation::CpAsync16(dst, src, valid);
}
inline void CpAsync16EvictFirst(uint32_t dst, const void* src, bool valid) {
  gpu_test::emulation::CpAsync16(dst, src, valid);  // a cache policy changes no data
}
inline void CpAsyncCommit() { gpu_test::emulation::CpAsyncCommit(); }
template <int kPending>
void CpAsyncWaitGroup() {
  gpu_test::emulation::CpAsyncWaitGroup(kPending);
}
inline void LdMatrixX4(uint32_t (&r)[4], uint32_t address) {
  gpu_test::emulation::LdMatrixX4(r, address, false);
}
inline void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t address) {
  gpu_test::emulation::LdMatrixX4(r, address, true);
}
template <typename T>
void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  gpu_test::emulation::Mma16816<T>(c, a, b0, b1);
}
inline uint32_t MovMatrixTrans(uint32_t x) { return gpu_test::emulation::MovMatrixTrans(x); }
inline float FastExp2(float x) { return std::exp2(x); }

}  // namespace ptx
}  // namespace internal
}  // namespace kvstream
#endif  // defined(KVSTREAM_CUDA_EMULATION)

#endif  // KVSTREAM_TESTS_GPU_WARP_EMULATOR_H_
