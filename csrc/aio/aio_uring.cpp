// io_uring backend: each worker thread owns one ring and keeps up to its share of the queue depth
// in flight, submitting new pieces and resubmitting remainders in one syscall with the wait.
// Compiled only when liburing is present (OFFLOAD_HAVE_LIBURING, set by offload/_build_spec.py).
#include "aio/aio_engine.h"

#include <cerrno>
#include <cstring>

#if defined(OFFLOAD_HAVE_LIBURING)
#include <liburing.h>
#include <unistd.h>

#include <unordered_set>
#endif

namespace offload {
namespace aio {

#if defined(OFFLOAD_HAVE_LIBURING)

struct UringRing {
  struct io_uring ring;
};

bool uring_compiled() { return true; }

UringRing* uring_create(unsigned depth, std::string& why) {
  auto* r = new UringRing;
  // Completion queue is twice the submission queue by default, and we never have more than
  // `depth` pieces in flight, so completions cannot overflow.
  int rc = io_uring_queue_init(depth, &r->ring, 0);
  if (rc < 0) {
    why = std::string("io_uring_queue_init(") + std::to_string(depth) + ") failed: " + strerror(-rc) +
          " (kernel without io_uring, or disabled by sysctl kernel.io_uring_disabled / seccomp)";
    delete r;
    return nullptr;
  }
  return r;
}

void uring_destroy(UringRing* r) {
  if (r == nullptr) return;
  io_uring_queue_exit(&r->ring);
  delete r;
}

namespace {

// Queues the (remainder of the) piece; the caller guarantees a free submission slot.
void prep(struct io_uring* ring, Piece* p) {
  struct io_uring_sqe* sqe = io_uring_get_sqe(ring);
  char* buf = p->buf + p->done;
  unsigned n = static_cast<unsigned>(p->len - p->done);
  uint64_t off = p->offset + p->done;
  if (p->write) {
    io_uring_prep_write(sqe, p->fd, buf, n, off);
  } else {
    io_uring_prep_read(sqe, p->fd, buf, n, off);
  }
  io_uring_sqe_set_data(sqe, p);
}

}  // namespace

void uring_worker_loop(WorkQueue& q, UringRing* r, unsigned depth) {
  struct io_uring* ring = &r->ring;
  std::unordered_set<Piece*> inflight;  // pieces the kernel may still be reading or writing
  std::vector<Piece> fresh;
  bool alive = true;
  for (;;) {
    if (alive && inflight.size() < depth) {
      fresh.clear();
      alive = q.take(fresh, depth - inflight.size(), /*block=*/inflight.empty());
      for (Piece& p : fresh) {
        if (skip_if_failed(p)) continue;
        Piece* h = new Piece(std::move(p));
        prep(ring, h);
        inflight.insert(h);
      }
    }
    if (inflight.empty()) {
      if (!alive) return;
      continue;
    }
    // Submit what was queued and sleep until at least one piece completes.
    int rc = io_uring_submit_and_wait(ring, 1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && rc != -ETIME) {
      // The ring itself failed (should not happen). Every piece in `inflight` may be in the kernel,
      // which reads or writes its buffer until it posts the completion, so none may be retired as
      // over before that: wait as long as the ring can still report completions (a slow device is
      // not a broken ring). Only if it cannot are the rest given up as abandoned: their batches fail
      // and the Python handles keep the buffers allocated for good instead of freeing them.
      std::string why = std::string("io_uring_submit_and_wait failed: ") + strerror(-rc);
      int wrc = 0;
      while (!inflight.empty()) {
        struct io_uring_cqe* cqe = nullptr;
        struct __kernel_timespec ts = {1, 0};
        wrc = io_uring_wait_cqe_timeout(ring, &cqe, &ts);  // the kernel still holds these buffers
        if (wrc == -ETIME || wrc == -EINTR || wrc == -EAGAIN) continue;
        if (wrc < 0 || cqe == nullptr) break;
        auto* p = static_cast<Piece*>(io_uring_cqe_get_data(cqe));
        io_uring_cqe_seen(ring, cqe);
        inflight.erase(p);
        finish_piece(*p, -rc, why);
        delete p;
      }
      for (Piece* p : inflight) {
        finish_piece(*p, -rc,
                     why + "; waiting for the kernel to return this block failed too (" + strerror(-wrc) +
                         "), so the kernel may still own its buffer: it is kept allocated (leaked), never reused",
                     /*abandoned=*/true);
        delete p;
      }
      inflight.clear();
      threads_worker_loop(q);
      return;
    }
    unsigned head;
    unsigned seen = 0;
    struct io_uring_cqe* cqe;
    std::vector<Piece*> again;
    io_uring_for_each_cqe(ring, head, cqe) {
      ++seen;
      auto* p = static_cast<Piece*>(io_uring_cqe_get_data(cqe));
      if (apply_result(*p, cqe->res) == Step::kResubmit) {
        again.push_back(p);
      } else {
        inflight.erase(p);
        delete p;
      }
    }
    io_uring_cq_advance(ring, seen);
    // Remainders of short transfers and EAGAIN go back in; each holds one slot it already had.
    for (Piece* p : again) prep(ring, p);
  }
}

#else  // no liburing: the engine uses the thread backend

struct UringRing {};
bool uring_compiled() { return false; }
UringRing* uring_create(unsigned, std::string& why) {
  why = "not compiled (offload was built without liburing)";
  return nullptr;
}
void uring_destroy(UringRing*) {}
void uring_worker_loop(WorkQueue& q, UringRing*, unsigned) { threads_worker_loop(q); }

#endif

}  // namespace aio
}  // namespace offload
