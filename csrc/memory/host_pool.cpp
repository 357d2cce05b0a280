// The host pool: torch's CPU allocator while a runtime is open on a CPU (offload/store/host_pool.py).
//
// Why: a training step frees and re-allocates the same transients every step (activations, autograd's
// gradients, the gathered units' flat buffers, reduce outputs). glibc either maps each one fresh (frugal:
// RSS tight, every page faulted again each step) or keeps freed ones in its heaps, where different sizes and
// lifetimes fragment them and the process grows step after step (12-25 MiB a step measured, issue 21). Here
// every request of at least `min_bytes` is served from blocks of a few size classes (8 per power of two, so
// at most 1/8 of a block is rounding): a freed block waits in a cache for the next request of its class,
// already faulted in. What the pool maps (in use + cached) never exceeds the most it has had in use at once
// plus `headroom` bytes: the blocks cheapest to map again (huge pages), oldest first, go back to the OS first. Resident host memory is then the
// step's own peak plus at most the headroom, flat from step to step, and a repeating step maps nothing new
// (as torch's CUDA caching allocator holds what the peak needed).
// Smaller requests go to glibc (posix_memalign, 64-byte aligned as torch's own allocator does) without taking
// the pool's lock; raw_deallocate's one deleter frees either kind. Not reported to torch's
// memory profiler (profile_memory=True sees no CPU allocations while the pool is installed).
//
// Blocks are anonymous mappings (2 MiB transparent huge pages asked for from 2 MiB up: 512x fewer faults).
// A block freed after uninstall() is unmapped at once; the pool object itself lives until the process ends,
// so tensors outliving the runtime free correctly. fork(): the lock is held across it (pthread_atfork), so
// a child never inherits it locked by a thread that does not exist there.
#include <sys/mman.h>
#include <pthread.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <pybind11/pybind11.h>

#include "common/registry.h"

namespace offload {
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHuge = size_t(2) << 20;
constexpr size_t kAlignment = 64;  // c10::gAlignment

// The class a request of n bytes is served from: n rounded up to 1/8 of its power of two (at least a page).
size_t size_class(size_t n) {
  if (n > (size_t(1) << 62)) throw std::invalid_argument("host pool: a request above 2^62 bytes");
  size_t pow2 = 1;
  while (pow2 < n) pow2 <<= 1;  // the power of two at or above n
  size_t step = std::max(kPage, pow2 / 16);  // eighths of the power below: 1/8 of [pow2/2, pow2]
  return (n + step - 1) / step * step;
}

struct Stats {
  size_t in_use = 0, cached = 0, peak_in_use = 0, peak_mapped = 0;
  size_t window_peak_in_use = 0;  // the peak since take_window_peak() last restarted it (a step's, say)
  uint64_t hits = 0, misses = 0, maps = 0, unmaps = 0, small = 0;  // small: read from small_ by stats()
};

class HostPool final : public c10::Allocator {
 public:
  static HostPool& get() {
    static HostPool* pool = new HostPool();  // never destroyed: tensors may be freed during interpreter exit
    return *pool;
  }

  bool install(size_t min_bytes, size_t headroom) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!installed_) {
      previous_ = c10::GetCPUAllocator();  // given back at uninstall
      if (previous_ == this) previous_ = c10::GetDefaultCPUAllocator();
    }
    min_bytes_.store(std::max(min_bytes, kPage), std::memory_order_relaxed);
    headroom_ = headroom;
    evict_to(cache_limit());
    c10::SetCPUAllocator(this, /*priority=*/0);
    installed_ = c10::GetCPUAllocator() == this;  // false where an allocator of higher priority is in place
    return installed_;
  }

  void uninstall() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!installed_) return;
    c10::SetCPUAllocator(previous_, /*priority=*/0);
    installed_ = false;
    evict_to(0);
  }

  size_t trim() {  // the cache back to the OS and the peak restarted from what is in use; the bytes released
    std::lock_guard<std::mutex> lock(mu_);
    size_t before = stats_.cached;
    evict_to(0);
    stats_.peak_in_use = stats_.in_use;
    return before;
  }

  size_t take_window_peak() {  // the peak in use since the last call, restarted from what is in use now
    std::lock_guard<std::mutex> lock(mu_);
    size_t peak = stats_.window_peak_in_use;
    stats_.window_peak_in_use = stats_.in_use;
    return peak;
  }

  Stats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    Stats s = stats_;
    s.small = small_.load(std::memory_order_relaxed);
    return s;
  }

  bool installed() {
    std::lock_guard<std::mutex> lock(mu_);
    return installed_;
  }

  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return c10::DataPtr(nullptr, nullptr, &HostPool::deleter, cpu);
    if (n >= min_bytes_.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> lock(mu_);
      void* p = take(size_class(n));
      return c10::DataPtr(p, p, &HostPool::deleter, cpu);
    }
    // Small (most of a step's allocations, from every thread): glibc, no lock of ours on the way in or out, aligned
    // as torch's own CPU allocator aligns (its vectorized kernels expect 64 bytes)
    small_.fetch_add(1, std::memory_order_relaxed);
    void* p = nullptr;
    if (posix_memalign(&p, kAlignment, n) != 0 || p == nullptr) {
      TORCH_CHECK(false, "offload host pool: can't allocate memory: you tried to allocate ", n, " bytes");
    }
    return c10::DataPtr(p, p, &std::free, cpu);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &HostPool::deleter;  // frees both kinds (torch's raw_deallocate takes one deleter for all)
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  struct Cached {
    void* ptr;
    size_t size;
  };

  HostPool() {
    pthread_atfork([] { get().mu_.lock(); }, [] { get().mu_.unlock(); }, [] { get().mu_.unlock(); });
  }

  static void deleter(void* p) { get().release(p); }

  // Under mu_: a block of exactly `size` bytes, from the cache or freshly mapped (throws, as torch's allocator
  // does, when even an empty cache leaves no room).
  void* take(size_t size) {
    auto cls = free_.find(size);
    if (cls != free_.end() && !cls->second.empty()) {
      auto it = cls->second.back();  // the most recently freed: its pages are the likeliest still warm
      cls->second.pop_back();
      void* p = it->ptr;
      lru_of(size).erase(it);
      stats_.cached -= size;
      stats_.in_use += size;
      note_peak();
      ++stats_.hits;
      live_.emplace(p, size);
      return p;
    }
    ++stats_.misses;
    void* p = map(size);
    if (p == nullptr && stats_.cached > 0) {  // out of address space or memory: give the cache back, once more
      evict_to(0);
      p = map(size);
    }
    if (p == nullptr) {
      TORCH_CHECK(false, "offload host pool: can't allocate memory: you tried to allocate ", size,
                  " bytes (mmap: ", std::strerror(errno), "); ", stats_.in_use,
                  " bytes are in use by the pool. Lower the batch size or sequence length, or the cpu_budget.");
    }
    stats_.in_use += size;
    note_peak();
    evict_to(cache_limit());  // a new class at the peak: blocks of other classes make room
    stats_.peak_mapped = std::max(stats_.peak_mapped, stats_.in_use + stats_.cached);
    live_.emplace(p, size);
    return p;
  }

  void note_peak() {  // under mu_, after in_use grew
    stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.in_use);
    stats_.window_peak_in_use = std::max(stats_.window_peak_in_use, stats_.in_use);
  }

  void* map(size_t size) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    ++stats_.maps;
    if (size >= kHuge) madvise(p, size, MADV_HUGEPAGE);  // advice: a refusal costs only speed
    return p;
  }

  void unmap(void* p, size_t size) {
    munmap(p, size);
    ++stats_.unmaps;
  }

  void release(void* p) {
    if (p == nullptr) return;
    std::unique_lock<std::mutex> lock(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) {  // a small request's (through raw_deallocate): glibc's
      lock.unlock();
      std::free(p);
      return;
    }
    size_t size = it->second;
    live_.erase(it);
    stats_.in_use -= size;
    if (!installed_) {
      unmap(p, size);
      return;
    }
    auto& lru = lru_of(size);
    lru.push_back({p, size});
    free_[size].push_back(std::prev(lru.end()));
    stats_.cached += size;
    evict_to(cache_limit());
  }

  // Under mu_: the most the cache may hold now: mapped stays within the peak in use plus the headroom.
  size_t cache_limit() const {
    size_t allowed = stats_.peak_in_use + headroom_;
    return allowed > stats_.in_use ? allowed - stats_.in_use : 0;
  }

  // Cached blocks by what mapping them again costs: huge-page ones (2 MiB and up: a fault per 2 MiB, 0.03 ms a
  // MiB measured) go first, the small ones (a fault per 4 KiB, 0.4 ms a MiB) after; oldest freed first in each.
  std::list<Cached>& lru_of(size_t size) { return size >= kHuge ? lru_huge_ : lru_small_; }

  // Under mu_: unmap cached blocks, the cheapest to map again first, until the cache holds at most `cap` bytes.
  void evict_to(size_t cap) {
    while (stats_.cached > cap && !(lru_huge_.empty() && lru_small_.empty())) {
      auto& lru = lru_huge_.empty() ? lru_small_ : lru_huge_;
      Cached oldest = lru.front();
      auto& cls = free_[oldest.size];
      for (auto it = cls.begin(); it != cls.end(); ++it) {  // a class holds few blocks: a short scan
        if (*it == lru.begin()) {
          cls.erase(it);
          break;
        }
      }
      lru.pop_front();
      stats_.cached -= oldest.size;
      unmap(oldest.ptr, oldest.size);
    }
  }

  std::mutex mu_;
  c10::Allocator* previous_ = nullptr;
  bool installed_ = false;
  std::atomic<size_t> min_bytes_{128 << 10};
  std::atomic<uint64_t> small_{0};
  size_t headroom_ = 0;
  std::list<Cached> lru_huge_, lru_small_;  // cached blocks, oldest freed first (lru_of)
  std::unordered_map<size_t, std::vector<std::list<Cached>::iterator>> free_;  // class -> its cached blocks
  std::unordered_map<void*, size_t> live_;  // block -> its class size, while a tensor holds it
  Stats stats_;
};

}  // namespace

void register_host_pool(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "host_pool_install",
      [](size_t min_bytes, size_t headroom) { return HostPool::get().install(min_bytes, headroom); },
      py::arg("min_bytes"), py::arg("headroom"),
      "Make the pool torch's CPU allocator for requests of at least min_bytes, mapping at most headroom bytes "
      "more than its peak in use; False if another allocator of higher priority is in place");
  m.def("host_pool_uninstall", [] { HostPool::get().uninstall(); },
        "Give torch its previous CPU allocator back and the cache to the OS");
  m.def("host_pool_installed", [] { return HostPool::get().installed(); });
  m.def("host_pool_trim", [] { return HostPool::get().trim(); },
        "Unmap every cached block and restart the peak in use from now; the bytes released");
  m.def("host_pool_take_window_peak", [] { return HostPool::get().take_window_peak(); },
        "The most the pool had in use since the last call (a step's peak), restarted from what is in use now");
  m.def("host_pool_size_class", &size_class, py::arg("nbytes"), "The block size a request of nbytes takes");
  m.def("host_pool_stats", [] {
    Stats s = HostPool::get().stats();
    py::dict d;
    d["in_use_bytes"] = s.in_use;
    d["cached_bytes"] = s.cached;
    d["peak_in_use_bytes"] = s.peak_in_use;
    d["peak_mapped_bytes"] = s.peak_mapped;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["maps"] = s.maps;
    d["unmaps"] = s.unmaps;
    d["small_requests"] = s.small;
    return d;
  });
}

}  // namespace offload
