#include "common/thread_pool.h"

#include <pthread.h>
#include <sched.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define OFFLOAD_HAS_MXCSR 1
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace offload {
namespace {

// The floating-point mode (x86's MXCSR: flush-to-zero, denormals-are-zero, rounding) is per thread. A job's
// helpers run in the caller's, so a chunk's result does not depend on which thread took it
// (torch.set_flush_denormal(True) in the caller flushed only the caller's chunks).
unsigned fp_mode() {
#ifdef OFFLOAD_HAS_MXCSR
  return _mm_getcsr();
#else
  return 0;
#endif
}

void set_fp_mode(unsigned mode) {
#ifdef OFFLOAD_HAS_MXCSR
  _mm_setcsr(mode);
#else
  (void)mode;
#endif
}

// Threads wanted (caller included); 0 = the default (usable cores). Kept outside the pool and atomic so
// num_threads()/set_num_threads() never wait for the run lock a kernel holds (callers hold the GIL),
// and so the fresh pool a forked child gets keeps the setting.
std::atomic<int> g_want{0};

int wanted() {
  int n = g_want.load(std::memory_order_relaxed);
  return n > 0 ? n : usable_cores();
}

class Pool {
 public:
  ~Pool() { stop_workers(); }

  void run(int64_t n_chunks, const std::function<void(int64_t)>& fn) {
    if (n_chunks <= 0) return;
    std::lock_guard<std::mutex> g(run_mu_);  // one job at a time
    const int want = wanted();
    int threads = static_cast<int>(std::min<int64_t>(want, n_chunks));
    if (threads <= 1) {
      for (int64_t i = 0; i < n_chunks; ++i) fn(i);
      return;
    }
    ensure_workers(want - 1);
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &fn;
      n_chunks_ = n_chunks;
      next_.store(0);
      error_ = nullptr;
      helpers_wanted_ = threads - 1;
      helpers_running_ = 0;
      job_fp_mode_ = fp_mode();
      ++generation_;
    }
    cv_.notify_all();
    work();  // the caller takes chunks too
    std::unique_lock<std::mutex> lk(mu_);
    // Wait for every helper that joined this generation to leave it, so `fn` (a reference into
    // the caller's frame) is not used after we return.
    done_cv_.wait(lk, [&] { return helpers_running_ == 0 && helpers_wanted_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work() {
    for (;;) {
      int64_t i = next_.fetch_add(1);
      if (i >= n_chunks_) return;
      try {
        (*job_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_chunks_);  // stop handing out chunks
      }
    }
  }

  void worker_main() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || (generation_ != seen && helpers_wanted_ > 0); });
      if (stop_) return;
      seen = generation_;
      --helpers_wanted_;
      ++helpers_running_;
      const unsigned caller_mode = job_fp_mode_, own_mode = fp_mode();
      lk.unlock();
      set_fp_mode(caller_mode);
      work();
      set_fp_mode(own_mode);
      lk.lock();
      --helpers_running_;
      if (helpers_running_ == 0) done_cv_.notify_all();
    }
  }

  void ensure_workers(int n) {
    // Called under run_mu_, between jobs.
    while (static_cast<int>(workers_.size()) < n) workers_.emplace_back([this] { worker_main(); });
    // Surplus workers (after a shrink) simply never get picked: helpers_wanted_ caps them.
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::mutex run_mu_;

  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t n_chunks_ = 0;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
  uint64_t generation_ = 0;
  unsigned job_fp_mode_ = 0;  // the caller's floating-point mode, for the helpers of this generation
  int helpers_wanted_ = 0;
  int helpers_running_ = 0;
  bool stop_ = false;
};

std::atomic<Pool*> g_pool{nullptr};

// fork() copies only the forking thread: in the child the pool's workers are gone (run() would wait
// for them forever) and its mutexes may be frozen locked by a thread that no longer exists. The child
// drops that pool (leaked: destroying it would join threads that do not exist) and starts a fresh one.
void pool_after_fork_child() { g_pool.store(new Pool(), std::memory_order_release); }

Pool& pool() {
  // Leaked on purpose: joining threads from a static destructor at interpreter exit can deadlock.
  static const bool ready = [] {
    g_pool.store(new Pool(), std::memory_order_release);
    pthread_atfork(nullptr, nullptr, &pool_after_fork_child);
    return true;
  }();
  (void)ready;
  return *g_pool.load(std::memory_order_acquire);
}

}  // namespace

int usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

int num_threads() { return wanted(); }

void set_num_threads(int n) {
  if (n < 0 || n > kMaxThreads)
    throw std::invalid_argument("offload.set_num_threads: n must be between 1 and " + std::to_string(kMaxThreads) +
                                " (or 0 for the default: usable cores), got " + std::to_string(n));
  g_want.store(n, std::memory_order_relaxed);  // read by the next run()
}

void parallel_run(int64_t n_chunks, const std::function<void(int64_t)>& fn) { pool().run(n_chunks, fn); }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  int64_t chunks = (n + grain - 1) / grain;
  parallel_run(chunks, [&](int64_t c) { fn(c * grain, std::min(n, (c + 1) * grain)); });
}

}  // namespace offload
