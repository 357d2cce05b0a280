// Async file I/O engine behind offload.store.aio: requests are cut into block-size pieces, queued,
// and carried out by worker threads that either drive an io_uring each (Linux, liburing) or make
// blocking pread/pwrite calls (always available). Plain C++: no torch, no Python; the bindings
// pass raw pointers and the Python side keeps the buffers alive until the batch completes.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace offload {
namespace aio {

// One caller request: the whole (file, offset, buffer, length), before it is cut into pieces.
struct Request {
  int fd = -1;
  bool write = false;
  std::string path;  // for error messages only
  uint64_t offset = 0;
  char* buf = nullptr;
  uint64_t len = 0;
};

// The first failure of a batch, structured so Python can build an OSError with errno/filename.
struct IoError {
  int err = 0;           // errno value (ENODATA for an unexpected end of file)
  bool write = false;
  std::string path;
  uint64_t req_offset = 0, req_len = 0;      // the caller's request
  uint64_t piece_offset = 0, piece_len = 0;  // the block that failed (remaining bytes of it)
  std::string detail;                        // extra words, e.g. the file size on a truncated read
};

// Completion state of one submit() call; shared by the handle and every in-flight piece.
class Batch {
 public:
  Batch(std::vector<Request> reqs, uint64_t pieces);
  bool done() const { return pending_.load(std::memory_order_acquire) == 0; }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // True when a piece was given up while the kernel may still own its buffer (an io_uring ring that
  // broke mid-flight): the caller must never free or reuse this batch's buffers.
  bool abandoned() const { return abandoned_.load(std::memory_order_acquire); }
  // Longer timeouts (about 3 years), and non-finite ones, wait forever.
  static constexpr double kForeverSeconds = 1e8;
  // Blocks until every piece has finished or `timeout_s` passed (< 0: forever); true when done.
  bool wait(double timeout_s);
  IoError error() const;  // valid when failed()
  const Request& request(uint32_t i) const { return reqs_[i]; }
  uint64_t bytes() const;
  // Called once per piece by the worker that retired it; err == 0 for success. `abandoned`: see above.
  void piece_finished(int err, uint32_t req_index, uint64_t offset, uint64_t len, const std::string& detail,
                      bool abandoned = false);

 private:
  std::vector<Request> reqs_;
  std::atomic<uint64_t> pending_;
  std::atomic<bool> failed_{false};
  std::atomic<bool> abandoned_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  IoError err_;
};

// A block-size slice of one request; `done` bytes of it are already transferred (short I/O).
struct Piece {
  std::shared_ptr<Batch> batch;
  uint32_t req_index = 0;
  uint32_t retries = 0;  // EAGAIN/EINTR resubmissions so far (bounded: never spin forever)
  int fd = -1;
  bool write = false;
  char* buf = nullptr;
  uint64_t offset = 0;
  uint64_t len = 0;
  uint64_t done = 0;
};

// FIFO of pieces shared by the workers; close() cancels what no worker has taken yet.
class WorkQueue {
 public:
  void push(std::vector<Piece>&& pieces);
  // Moves up to `max` pieces into `out`. With `block`, waits until there is work or the queue is
  // stopped. Returns false once the queue is stopped and empty (the worker should exit).
  bool take(std::vector<Piece>& out, size_t max, bool block);
  void stop_and_cancel();  // fails every queued piece with ECANCELED, then wakes every worker
  bool stopped() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Piece> q_;
  bool stop_ = false;
};

// Retires a piece: success, or the errno with a readable detail.
// `abandoned`: the kernel may still own the piece's buffer (see Batch::abandoned).
void finish_piece(Piece& p, int err, const std::string& detail = "", bool abandoned = false);
// Builds the "unexpected end of file" detail (file size vs. the byte the read needed).
std::string eof_detail(const Piece& p);

// Worker loops, one per thread. The uring loop owns its ring (created by uring_create()).
void threads_worker_loop(WorkQueue& q);
struct UringRing;  // opaque: defined only when built with liburing
bool uring_compiled();
// Creates a ring with `depth` entries; nullptr with the reason in `why` when the kernel refuses.
UringRing* uring_create(unsigned depth, std::string& why);
void uring_destroy(UringRing* r);
void uring_worker_loop(WorkQueue& q, UringRing* r, unsigned depth);

enum class Backend { kThreads, kUring };

class Engine {
 public:
  // backend: "io_uring", "threads" or "auto". queue_depth: most pieces in flight engine-wide.
  // workers: io_uring submitting threads, each owning a ring with its share of the depth
  // (the threads backend runs queue_depth blocking threads, one piece each).
  Engine(const std::string& backend, uint64_t block_size, int queue_depth, int workers);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Throws std::runtime_error in a process forked after the engine was created (no workers there).
  std::shared_ptr<Batch> submit(std::vector<Request> reqs);
  // Cancels queued pieces, waits for the ones in the kernel, joins the workers. Idempotent.
  // In a forked child: marks the engine closed and leaks its thread handles and rings (they belong to
  // the parent's threads; joining them would wait forever).
  void close();
  bool closed() const { return closed_.load(); }
  std::string backend_name() const { return backend_ == Backend::kUring ? "io_uring" : "threads"; }
  std::string fallback_reason() const { return fallback_reason_; }  // why "auto" chose threads
  uint64_t block_size() const { return block_size_; }
  int queue_depth() const { return queue_depth_; }
  int num_threads() const { return static_cast<int>(threads_.size()); }

 private:
  Backend backend_ = Backend::kThreads;
  std::string fallback_reason_;
  uint64_t block_size_;
  int queue_depth_;
  WorkQueue queue_;
  std::vector<std::thread> threads_;
  std::vector<UringRing*> rings_;
  std::mutex close_mu_;
  std::atomic<bool> closed_{false};
  // The process that started the workers. fork() copies none of them, so in a child the engine can
  // neither run I/O nor join its threads: submit refuses, close() just lets go.
  int pid_;
};

// Shared by both backends: applies one transfer result (bytes moved, or -errno) to a piece.
// kResubmit: issue the remainder again (short transfer, EAGAIN/EINTR); kRetired: the piece is
// finished (success or error recorded in its batch) and must not be touched again.
enum class Step { kRetired, kResubmit };
Step apply_result(Piece& p, long long res);
// Retires a piece whose batch already failed, without doing its I/O. True when it did so.
bool skip_if_failed(Piece& p);
// Engine-independent facts for `offload env`: which backends this build has and can use now.
std::vector<std::string> backends_available(std::string& uring_why);
// O_DIRECT alignment of an open file: max of 4096 and what statx(STATX_DIOALIGN) reports.
uint64_t dio_alignment(int fd);

}  // namespace aio
}  // namespace offload
