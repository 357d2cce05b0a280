// The backend that always works: blocking pread/pwrite on a pool of threads, one piece per thread,
// plus the completion rules both backends share (short transfers, EAGAIN, end of file).
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "aio/aio_engine.h"

namespace offload {
namespace aio {

namespace {
constexpr uint32_t kMaxRetries = 10000;  // ~1 s of EAGAIN at 100 us per retry, then give up loudly
}

Step apply_result(Piece& p, long long res) {
  if (res < 0) {
    int e = static_cast<int>(-res);
    if (e == EINTR || e == EAGAIN) {
      if (++p.retries <= kMaxRetries) {
        if (p.retries > 16) usleep(100);  // persistent EAGAIN: back off instead of spinning
        return Step::kResubmit;
      }
      finish_piece(p, e, "still failing after " + std::to_string(kMaxRetries) + " retries");
      return Step::kRetired;
    }
    finish_piece(p, e, p.done ? "after a short transfer of " + std::to_string(p.done) + " bytes" : "");
    return Step::kRetired;
  }
  if (res == 0) {
    if (p.write) {
      finish_piece(p, EIO, "the write made no progress (0 bytes written)");
    } else {
      finish_piece(p, ENODATA, eof_detail(p));
    }
    return Step::kRetired;
  }
  p.done += static_cast<uint64_t>(res);
  if (p.done >= p.len) {
    finish_piece(p, 0);
    return Step::kRetired;
  }
  if (!p.write) {
    // A short read is either the end of the file or an interrupted transfer; only the size tells.
    // (With O_DIRECT, retrying at an unaligned end-of-file position would report EINVAL instead.)
    struct stat st;
    if (fstat(p.fd, &st) == 0 && static_cast<uint64_t>(st.st_size) <= p.offset + p.done) {
      finish_piece(p, ENODATA, eof_detail(p));
      return Step::kRetired;
    }
  }
  return Step::kResubmit;
}

bool skip_if_failed(Piece& p) {
  if (!p.batch->failed()) return false;
  finish_piece(p, ECANCELED, "skipped: an earlier block of this batch failed");
  return true;
}

void threads_worker_loop(WorkQueue& q) {
  std::vector<Piece> got;
  for (;;) {
    got.clear();
    if (!q.take(got, 1, /*block=*/true)) return;
    for (Piece& p : got) {
      if (skip_if_failed(p)) continue;
      for (;;) {
        char* buf = p.buf + p.done;
        size_t n = static_cast<size_t>(p.len - p.done);
        off_t off = static_cast<off_t>(p.offset + p.done);
        ssize_t rc = p.write ? pwrite(p.fd, buf, n, off) : pread(p.fd, buf, n, off);
        if (apply_result(p, rc >= 0 ? static_cast<long long>(rc) : -static_cast<long long>(errno)) == Step::kRetired)
          break;
      }
    }
  }
}

}  // namespace aio
}  // namespace offload
