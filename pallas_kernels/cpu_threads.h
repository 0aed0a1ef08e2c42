// The threads the CPU kernels (attention, oneDNN matmuls) split their work over.
//
// Why not XLA's intra-op pool (ffi::ThreadPool): a decode step calls ~200 kernels a few
// tens of microseconds apart, and a pool thread that has gone to sleep between two of
// them takes longer to wake (on the VMs these CPUs run in, ~100 us) than a decode-sized
// matmul takes to run. These helpers spin between calls instead, yielding the core to
// any other thread that has work (XLA's fusions run beside them), and sleep only after
// 2 ms without work. One pool per process: every kernel shares it, so two spinning pools
// never fight over the same cores.

#ifndef JAXSERVE_CPU_THREADS_H_
#define JAXSERVE_CPU_THREADS_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace jaxserve {

class SpinPool {
 public:
  // The process's pool: one helper per core but the caller's.
  static SpinPool& Get() {
    static SpinPool* pool = new SpinPool(std::max(1u, std::thread::hardware_concurrency()) - 1);  // never freed
    return *pool;
  }

  int threads() const { return static_cast<int>(helpers_.size()) + 1; }

  // Runs fn(0), ..., fn(n - 1), some on the calling thread and some on helpers, and
  // returns when all have run and no helper still holds the job. One job at a time: while
  // the helpers are busy with another caller's job (XLA runs independent ops side by
  // side), a caller runs its whole job itself, since the cores are busy anyway.
  void Run(int n, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> serial(run_mu_, std::try_to_lock);
    if (n <= 1 || helpers_.empty() || !serial.owns_lock()) {
      for (int i = 0; i < n; ++i) fn(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &fn;
      jobs_ = n;
      next_.store(0, std::memory_order_relaxed);
      pending_.store(n, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    Take(fn, n);
    while (pending_.load(std::memory_order_acquire) > 0) Pause();
    {
      std::lock_guard<std::mutex> lock(mu_);  // a helper arriving from now on finds no job
      job_ = nullptr;
    }
    while (active_.load(std::memory_order_acquire) > 0) Pause();  // ...and none still holds it
  }

 private:
  explicit SpinPool(unsigned n) {
    for (unsigned t = 0; t < n; ++t) helpers_.emplace_back([this] { Loop(); });
    for (auto& t : helpers_) t.detach();
  }

  static void Pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
  }

  void Take(const std::function<void(int)>& fn, int n) {
    for (int i; (i = next_.fetch_add(1, std::memory_order_acq_rel)) < n;) {
      fn(i);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        if (spins < 256) {
          Pause();
          continue;
        }
        std::this_thread::yield();
        if (spins % 64 == 0 && std::chrono::steady_clock::now() - start > std::chrono::milliseconds(2)) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        }
      }
      const std::function<void(int)>* job;
      int n;
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = generation_.load(std::memory_order_acquire);
        job = job_;
        n = jobs_;
        if (job != nullptr) active_.fetch_add(1, std::memory_order_acq_rel);
      }
      if (job == nullptr) continue;  // that job is over
      Take(*job, n);
      active_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::vector<std::thread> helpers_;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> next_{0}, pending_{0}, active_{0};
  const std::function<void(int)>* job_ = nullptr;
  int jobs_ = 0;
};

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_THREADS_H_
