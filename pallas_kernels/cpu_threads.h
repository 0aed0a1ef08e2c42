// How the CPU kernels (attention, oneDNN matmuls) split a call's work over threads.
//
// The threads are XLA's own intra-op pool (ffi::ThreadPool): they are awake while XLA
// runs a program, so a task scheduled on them starts within microseconds, and no second
// set of threads competes with them for the cores. The calling thread takes work items
// too, from the same counter: a task that starts late finds nothing left, so a call is
// never slower than running it alone on the caller, and the task never touches the
// caller's state after the call returns (it holds the shared counter, not the caller's).
//
// Tried and dropped: oneDNN's own OpenMP team (woken for each of ~200 calls a step, beside
// XLA's spinning threads: ~50 us per call), and helper threads of our own that spin
// between calls (fast for a lone decode, but two spinning pools on two cores slowed
// 512-token prefill steps by 15%).

#ifndef JAXSERVE_CPU_THREADS_H_
#define JAXSERVE_CPU_THREADS_H_

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <thread>

namespace jaxserve {

// The threads a call can use at most (the caller and the pool's others): what the work is
// cut for (cpu_matmul.cc packs a weight in this many column slices).
inline int Threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

// Runs fn(0), ..., fn(n - 1) on the calling thread and on up to n - 1 tasks scheduled on
// `pool`, and returns when all have run.
template <typename Pool>
void RunOnPool(Pool& pool, int n, const std::function<void(int)>& fn) {
  struct State {
    std::atomic<int> next{0}, pending{0};
    const std::function<void(int)>* fn = nullptr;
    int n = 0;
  };
  if (n <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  auto state = std::make_shared<State>();
  state->fn = &fn;
  state->n = n;
  state->pending.store(n, std::memory_order_relaxed);
  auto take = [](State& st) {
    for (int i; (i = st.next.fetch_add(1, std::memory_order_acq_rel)) < st.n;) {
      (*st.fn)(i);
      st.pending.fetch_sub(1, std::memory_order_acq_rel);
    }
  };
  // No more threads than cores: XLA may run this call on a thread outside its pool (then
  // all of the pool's threads could join the caller) or on one of them, and a third thread
  // on a 2-core machine only time-slices the other two (and spins in the pool's wait
  // afterwards). Capped, a lone decode took 15.2-17.9 against 16.4-20.1 ms/token (2-core
  // AMX Xeon, AMX on and off, 6 interleaved pairs); offline batches within run-to-run drift.
  const int helpers = std::min({static_cast<int>(pool.num_threads()), Threads() - 1, n - 1});
  for (int h = 0; h < helpers; ++h) pool.Schedule([state, take] { take(*state); });
  take(*state);
  // A helper finishing its item: spin briefly, then yield, so a helper that a busy machine
  // has descheduled gets the core back rather than watching this thread spin.
  for (int spins = 0; state->pending.load(std::memory_order_acquire) > 0; ++spins) {
#if defined(__x86_64__) || defined(__i386__)
    if (spins < 1024) {
      __builtin_ia32_pause();
      continue;
    }
#endif
    std::this_thread::yield();
  }
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_THREADS_H_
