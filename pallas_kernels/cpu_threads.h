// How the CPU kernels (attention, oneDNN matmuls) split a call's work over threads.
//
// The threads are XLA's own intra-op pool (ffi::ThreadPool), so no second set of threads
// competes with them for the cores. The calling thread takes work items too, from the same
// counter: a helper that starts late finds nothing left, so a call is never slower than
// running it alone on the caller, and a helper never touches the caller's state after the
// call returns (it holds the shared work, not the caller's).
//
// XLA's threads sleep between tasks, and a sleeping one took 60-110 us to start on a
// task (2-core AMX Xeon, a Firecracker VM: the woken vCPU itself had been halted), a third
// of a 504-row matmul call and more than half of a 32-row one. So a helper that has run
// out of items lingers, spinning, for the next call's work (kLinger); the model's step is
// a chain of such calls with little between them. A 32-sequence decode step went from
// 46.9 to 39.7 ms, a lone decode from 21.2-24.1 to 19.2-19.5 ms/token, offline throughput
// (32 x 200 / 64) from 480-481 to 518-539 tok/s.
//
// Tried and dropped: oneDNN's own OpenMP team (woken for each of ~200 calls a step, beside
// XLA's threads: ~50 us per call), and helper threads of our own that spin between calls
// (fast for a lone decode, but two spinning pools on two cores slowed 512-token prefill
// steps by 15%; a lingering helper is one of XLA's threads, so the cores are not
// oversubscribed, and it stops after kLinger without a call).

#ifndef JAXSERVE_CPU_THREADS_H_
#define JAXSERVE_CPU_THREADS_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace jaxserve {

// The threads a call can use at most (the caller and the pool's others): what the work is
// cut for (cpu_matmul.cc packs a weight in this many column slices).
inline int Threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

// A call's shared work: items taken from one counter by the caller and any helper.
struct PoolWork {
  std::atomic<int> next{0}, pending{0};
  const std::function<void(int)>* fn = nullptr;
  int n = 0;

  // Runs items until none is left.
  void Take() {
    for (int i; (i = next.fetch_add(1, std::memory_order_acq_rel)) < n;) {
      (*fn)(i);
      pending.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
};

// The newest call's work, for helpers that linger (RunOnPool): `generation` counts the
// calls posted, so a lingering helper polls one atomic and takes the lock only to fetch a
// new call's work.
struct PoolPost {
  std::mutex mu;
  std::shared_ptr<PoolWork> work;
  std::atomic<uint64_t> generation{0};
  std::atomic<int> lingering{0};  // helpers polling for the next call
};

inline PoolPost& Post() {
  static PoolPost* post = new PoolPost;  // never destroyed: helpers may poll it at exit
  return *post;
}

// Takes the newest posted call's work (a lingering helper).
inline void TakePosted(PoolPost& post) {
  std::shared_ptr<PoolWork> work;
  {
    std::lock_guard<std::mutex> lock(post.mu);
    work = post.work;
  }
  if (work) work->Take();
}

// How long a helper that has finished its items waits, spinning, for the next call's work
// before it returns to the pool (see the top). Long enough for the gaps between a step's
// calls (a few XLA fusions); the host's work between steps is longer, and a helper spinning
// through it would take a core from the host's threads.
constexpr auto kLinger = std::chrono::microseconds(200);

// Runs fn(0), ..., fn(n - 1) on the calling thread and on up to n - 1 helpers (lingering
// ones, else tasks scheduled on `pool`, which then linger `linger`), and returns when all
// have run.
template <typename Pool>
void RunOnPool(Pool& pool, int n, const std::function<void(int)>& fn,
               std::chrono::steady_clock::duration linger = kLinger) {
  if (n <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  auto work = std::make_shared<PoolWork>();
  work->fn = &fn;
  work->n = n;
  work->pending.store(n, std::memory_order_relaxed);
  PoolPost& post = Post();
  {
    std::lock_guard<std::mutex> lock(post.mu);
    post.work = work;
  }
  // Sequentially consistent, as the helper's side below: a helper this call counts among
  // the lingering either takes its work or is still lingering when it is posted.
  post.generation.fetch_add(1, std::memory_order_seq_cst);
  // No more threads than cores: XLA may run this call on a thread outside its pool (then
  // all of the pool's threads could join the caller) or on one of them, and a third thread
  // on a 2-core machine only time-slices the other two (and spins in the pool's wait
  // afterwards). Capped, a lone decode took 15.2-17.9 against 16.4-20.1 ms/token (2-core
  // AMX Xeon, AMX on and off, 6 interleaved pairs); offline batches within run-to-run drift.
  // Helpers already lingering take the posted work without a task of their own.
  const int helpers = std::min({static_cast<int>(pool.num_threads()), Threads() - 1, n - 1}) -
                      post.lingering.load(std::memory_order_seq_cst);
  for (int h = 0; h < helpers; ++h) {
    pool.Schedule([work, linger] {
      work->Take();
      PoolPost& post = Post();
      post.lingering.fetch_add(1, std::memory_order_seq_cst);
      // A call may have been posted, and have counted this helper, before `seen` is read:
      // its work is the newest, so take what is left of that once.
      uint64_t seen = post.generation.load(std::memory_order_seq_cst);
      TakePosted(post);
      auto until = std::chrono::steady_clock::now() + linger;
      for (int spins = 0;; ++spins) {
        const uint64_t now = post.generation.load(std::memory_order_acquire);
        if (now != seen) {
          seen = now;
          TakePosted(post);
          until = std::chrono::steady_clock::now() + linger;
          continue;
        }
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        if (spins % 64 == 0 && std::chrono::steady_clock::now() > until) break;
      }
      post.lingering.fetch_sub(1, std::memory_order_seq_cst);
      // A call posted as this helper stopped may have counted on it: take its work.
      if (post.generation.load(std::memory_order_seq_cst) != seen) TakePosted(post);
    });
  }
  work->Take();
  // A helper finishing its item: spin briefly, then yield, so a helper that a busy machine
  // has descheduled gets the core back rather than watching this thread spin.
  for (int spins = 0; work->pending.load(std::memory_order_acquire) > 0; ++spins) {
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
