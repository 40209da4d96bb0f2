// Flags between GPUs, and the one bounded wait every kernel uses.
//
// A writer makes its data visible before the flag that announces it: plain stores (or NVLink
// stores to a peer), then a system-scope fence, then the flag stored with release semantics. A
// reader spins on the flag with acquire semantics before it reads the data. Flags carry the
// call's tag (a per-kind call counter kept on the device), so none is ever reset and a step can
// be replayed from a CUDA graph.
//
// No wait is unbounded: past the recipe's timeout ([moe_comm] wait_timeout_s) the first waiter
// records the kernel, the phase and the peer in the error words, raises the abort word, and
// every wait of every kernel on this rank then returns at once. The kernel runs to its end with
// meaningless data, and the host raises an error naming what was waited for.
#pragma once

#include <cstdint>

#include "common/errors.h"

namespace moe_comm {

// What a wait needs to give up cleanly: the bound, and where to say why.
struct WaitContext {
  int64_t timeout_ns = 0;
  int32_t* abort = nullptr;   // device memory: 0 until a wait of this rank times out
  int32_t* errors = nullptr;  // [kErrorWords], mapped pinned host memory
};

#if defined(__CUDACC__)

__device__ __forceinline__ void store_release_sys(uint32_t* addr, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* addr) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* addr) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
  return value;
}

__device__ __forceinline__ int64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return (int64_t)t;
}

__device__ __forceinline__ bool aborted(const WaitContext& w) { return *(volatile int32_t*)w.abort != 0; }

// The first wait to time out on this rank says what it waited for; later ones only see abort.
static __device__ __noinline__ void give_up(const WaitContext& w, int kernel, int phase, int peer) {
  if (atomicCAS(w.abort, 0, 1) == 0) {
    volatile int32_t* e = w.errors;
    e[kErrorTimeoutPhase] = phase;
    e[kErrorTimeoutPeer] = peer;
    __threadfence_system();
    e[kErrorTimeoutKernel] = kernel + 1;
  }
}

// Every lane spins until done(*flag) (so each lane's later loads are ordered after the
// acquire). Returns false if it gave up (timeout, or another wait of this rank did).
template <typename Word, typename Done>
__device__ __forceinline__ bool wait_until(const Word* flag, Done done, const WaitContext& w, int kernel, int phase,
                                           int peer) {
  if (done(load_acquire_sys(flag))) return true;
  const int64_t start = global_time_ns();
  while (true) {
    for (int spin = 0; spin < 64; ++spin) {
      if (done(load_acquire_sys(flag))) return true;
    }
    if (aborted(w)) return false;
    if (global_time_ns() - start > w.timeout_ns) {
      give_up(w, kernel, phase, peer);
      return false;
    }
  }
}

// A flag that carries exactly this call's tag: the protocol's handshakes keep a writer from
// running a call ahead, so any other value means "not yet".
template <typename Word>
__device__ __forceinline__ bool wait_equal(const Word* flag, Word value, const WaitContext& w, int kernel, int phase,
                                           int peer) {
  return wait_until(flag, [value](Word v) { return v == value; }, w, kernel, phase, peer);
}

// A flag whose writer may run ahead (tags only grow): this tag or a later one.
template <typename Word>
__device__ __forceinline__ bool wait_at_least(const Word* flag, Word value, const WaitContext& w, int kernel,
                                              int phase, int peer) {
  return wait_until(flag, [value](Word v) { return v >= value; }, w, kernel, phase, peer);
}

// Called by every lane after its stores: the fence orders them (this lane's) before the flag,
// which lane 0 releases once the whole warp has fenced.
__device__ __forceinline__ void publish_flag(uint32_t* flag, uint32_t tag, int lane) {
  __threadfence_system();
  __syncwarp();
  if (lane == 0) store_release_sys(flag, tag);
}

#endif  // __CUDACC__

}  // namespace moe_comm
