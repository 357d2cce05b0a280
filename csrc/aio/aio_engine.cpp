// Batches, the shared work queue and the Engine that cuts requests into pieces and owns the workers.
#include "aio/aio_engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <chrono>
#include <stdexcept>
#include <system_error>

namespace offload {
namespace aio {

// ---------------------------------------------------------------------------------------------
// Batch

Batch::Batch(std::vector<Request> reqs, uint64_t pieces) : reqs_(std::move(reqs)), pending_(pieces) {}

bool Batch::wait(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto pred = [this] { return pending_.load(std::memory_order_acquire) == 0; };
  // The caller needs the bytes (or the error) before it may touch the buffer again.
  // Non-finite or very long timeouts mean "forever": wait_for() converts to the clock's integer ticks,
  // which overflow (e.g. inf, 1e300) and then return at once, reporting a spurious timeout.
  if (timeout_s < 0 || !std::isfinite(timeout_s) || timeout_s > kForeverSeconds) {
    cv_.wait(lk, pred);
    return true;
  }
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), pred);
}

IoError Batch::error() const {
  std::lock_guard<std::mutex> lk(mu_);
  return err_;
}

uint64_t Batch::bytes() const {
  uint64_t n = 0;
  for (const auto& r : reqs_) n += r.len;
  return n;
}

void Batch::piece_finished(int err, uint32_t req_index, uint64_t offset, uint64_t len, const std::string& detail,
                           bool abandoned) {
  if (abandoned) abandoned_.store(true, std::memory_order_release);  // visible before done() turns true
  if (err != 0) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failed_.load(std::memory_order_relaxed)) {  // keep the first failure: later ones are fallout
      const Request& r = reqs_[req_index];
      err_.err = err;
      err_.write = r.write;
      err_.path = r.path;
      err_.req_offset = r.offset;
      err_.req_len = r.len;
      err_.piece_offset = offset;
      err_.piece_len = len;
      err_.detail = detail;
      failed_.store(true, std::memory_order_release);
    }
  }
  if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    // Taking the lock orders this notify after a waiter's predicate check, so no wakeup is lost.
    std::lock_guard<std::mutex> lk(mu_);
    cv_.notify_all();
  }
}

void finish_piece(Piece& p, int err, const std::string& detail, bool abandoned) {
  std::shared_ptr<Batch> b = std::move(p.batch);
  b->piece_finished(err, p.req_index, p.offset + p.done, p.len - p.done, detail, abandoned);
}

std::string eof_detail(const Piece& p) {
  struct stat st;
  std::string size = "?";
  if (fstat(p.fd, &st) == 0) size = std::to_string(static_cast<long long>(st.st_size));
  return "unexpected end of file: the file holds " + size + " bytes but the read needs bytes up to " +
         std::to_string(p.offset + p.len) + " (truncated file?)";
}

// ---------------------------------------------------------------------------------------------
// WorkQueue

void WorkQueue::push(std::vector<Piece>&& pieces) {
  if (pieces.empty()) return;
  bool cancelled = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) {
      cancelled = true;
    } else {
      for (auto& p : pieces) q_.push_back(std::move(p));
    }
  }
  if (cancelled) {  // raced with close(): fail the pieces rather than leave the batch pending forever
    for (auto& p : pieces) finish_piece(p, ECANCELED, "the engine was closed before this block started");
    return;
  }
  if (pieces.size() == 1) {
    cv_.notify_one();
  } else {
    cv_.notify_all();
  }
}

bool WorkQueue::take(std::vector<Piece>& out, size_t max, bool block) {
  std::unique_lock<std::mutex> lk(mu_);
  // An idle worker sleeps here until there is a piece to start or the engine closes.
  if (block) cv_.wait(lk, [this] { return !q_.empty() || stop_; });
  if (q_.empty()) return !stop_;
  while (!q_.empty() && out.size() < max) {
    out.push_back(std::move(q_.front()));
    q_.pop_front();
  }
  return true;
}

void WorkQueue::stop_and_cancel() {
  std::deque<Piece> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    left.swap(q_);
  }
  cv_.notify_all();
  for (auto& p : left) finish_piece(p, ECANCELED, "the engine was closed before this block started");
}

bool WorkQueue::stopped() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stop_;
}

// ---------------------------------------------------------------------------------------------
// Engine

Engine::Engine(const std::string& backend, uint64_t block_size, int queue_depth, int workers)
    : block_size_(block_size), queue_depth_(queue_depth), pid_(static_cast<int>(getpid())) {
  if (backend != "auto" && backend != "io_uring" && backend != "threads")
    throw std::invalid_argument("offload aio: backend must be 'auto', 'io_uring' or 'threads', got '" + backend + "'");
  if (block_size == 0 || block_size > (1ull << 30))
    throw std::invalid_argument("offload aio: block_size must be between 1 byte and 1 GiB, got " +
                                std::to_string(block_size));
  if (queue_depth < 1 || queue_depth > 4096)
    throw std::invalid_argument("offload aio: queue_depth must be between 1 and 4096, got " + std::to_string(queue_depth));
  if (workers < 1 || workers > 256)
    throw std::invalid_argument("offload aio: workers must be between 1 and 256, got " + std::to_string(workers));

  if (backend != "threads") {
    std::string why;
    if (!uring_compiled()) {
      why = "offload was built without liburing (install liburing-dev and rebuild)";
    } else {
      // Split the depth over the rings so the engine never has more than queue_depth pieces in flight.
      int n = std::min(workers, queue_depth);
      rings_.reserve(n);  // so that no push_back can throw with a ring just created (it would leak)
      for (int i = 0; i < n; ++i) {
        unsigned share = static_cast<unsigned>(queue_depth / n + (i < queue_depth % n ? 1 : 0));
        UringRing* r = uring_create(share, why);
        if (r == nullptr) break;
        rings_.push_back(r);
      }
      if (static_cast<int>(rings_.size()) != n) {
        for (UringRing* r : rings_) uring_destroy(r);
        rings_.clear();
      }
    }
    if (rings_.empty()) {
      if (backend == "io_uring") throw std::runtime_error("offload aio: io_uring backend unavailable: " + why);
      fallback_reason_ = why;
    } else {
      backend_ = Backend::kUring;
    }
  }

  try {
    if (backend_ == Backend::kUring) {
      int n = static_cast<int>(rings_.size());
      for (int i = 0; i < n; ++i) {
        unsigned share = static_cast<unsigned>(queue_depth / n + (i < queue_depth % n ? 1 : 0));
        UringRing* r = rings_[i];
        threads_.emplace_back([this, r, share] { uring_worker_loop(queue_, r, share); });
      }
    } else {
      for (int i = 0; i < queue_depth; ++i) threads_.emplace_back([this] { threads_worker_loop(queue_); });
    }
  } catch (...) {
    // Out of threads (system_error) or of memory: stop the ones already running, so the half-built engine
    // leaves no ring and no joinable thread behind (destroying one would terminate the process).
    close();
    try {
      throw;
    } catch (const std::system_error& e) {
      throw std::runtime_error(std::string("offload aio: cannot start worker threads: ") + e.what());
    }
  }
}

Engine::~Engine() { close(); }

std::shared_ptr<Batch> Engine::submit(std::vector<Request> reqs) {
  if (closed_) throw std::invalid_argument("offload aio: submit on a closed engine");
  if (static_cast<int>(getpid()) != pid_)
    throw std::runtime_error("offload aio: engine created in pid " + std::to_string(pid_) +
                             " cannot be used after fork (this is pid " + std::to_string(getpid()) +
                             ", where its worker threads do not exist); create a new AioEngine in the child");
  uint64_t pieces = 0;
  for (const auto& r : reqs) pieces += (r.len + block_size_ - 1) / block_size_;
  auto batch = std::make_shared<Batch>(reqs, pieces);
  std::vector<Piece> work;
  work.reserve(pieces);
  for (uint32_t i = 0; i < reqs.size(); ++i) {
    const Request& r = reqs[i];
    for (uint64_t o = 0; o < r.len; o += block_size_) {
      Piece p;
      p.batch = batch;
      p.req_index = i;
      p.fd = r.fd;
      p.write = r.write;
      p.buf = r.buf + o;
      p.offset = r.offset + o;
      p.len = std::min<uint64_t>(block_size_, r.len - o);
      work.push_back(std::move(p));
    }
  }
  queue_.push(std::move(work));
  return batch;
}

void Engine::close() {
  std::lock_guard<std::mutex> lk(close_mu_);
  if (closed_) return;
  closed_ = true;
  if (static_cast<int>(getpid()) != pid_) {
    // Forked child: the workers and the queue's lock holders live only in the parent. Destroying a
    // joinable std::thread aborts and joining would hang, so the handles (and rings) are leaked.
    new std::vector<std::thread>(std::move(threads_));
    threads_.clear();
    rings_.clear();
    return;
  }
  queue_.stop_and_cancel();
  // Workers exit once their in-flight pieces have completed, so no buffer is touched after this.
  for (auto& t : threads_) t.join();
  threads_.clear();
  for (UringRing* r : rings_) uring_destroy(r);
  rings_.clear();
}

std::vector<std::string> backends_available(std::string& uring_why) {
  std::vector<std::string> out{"threads"};
  if (!uring_compiled()) {
    uring_why = "not compiled (offload was built without liburing)";
    return out;
  }
  UringRing* r = uring_create(4, uring_why);
  if (r != nullptr) {
    uring_destroy(r);
    out.push_back("io_uring");
  }
  return out;
}

uint64_t dio_alignment(int fd) {
  uint64_t align = 4096;
#if defined(STATX_DIOALIGN)
  struct statx stx;
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN)) {
    align = std::max<uint64_t>(align, stx.stx_dio_mem_align);
    align = std::max<uint64_t>(align, stx.stx_dio_offset_align);
  }
#else
  (void)fd;
#endif
  return align;
}

}  // namespace aio
}  // namespace offload
