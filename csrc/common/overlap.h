// Byte-range aliasing checks for kernels that read some buffers and write others: a written range
// that overlaps any other range makes the result depend on chunk order and thread timing, so the
// bindings refuse it (torch refuses partial overlap in copy_ too). Header-only, plain C++.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace offload {

struct ByteRange {
  uintptr_t begin = 0, end = 0;  // [begin, end); empty ranges never overlap
  std::string name;              // the argument as the caller knows it, e.g. "dsts[3]"
  bool written = false;
};

inline ByteRange byte_range(const void* p, int64_t nbytes, std::string name, bool written) {
  auto b = reinterpret_cast<uintptr_t>(p);
  return ByteRange{b, b + static_cast<uintptr_t>(nbytes > 0 ? nbytes : 0), std::move(name), written};
}

// The bytes of any tensor-like with data_ptr() and nbytes() (at::Tensor); a template, so this header
// needs no torch include.
template <class TensorLike>
ByteRange bytes_of(const TensorLike& t, std::string name, bool written) {
  return byte_range(t.data_ptr(), static_cast<int64_t>(t.nbytes()), std::move(name), written);
}

// "" when no written range overlaps another range, else "<a> and <b> overlap in memory".
// Sort-and-sweep, O(n log n): after sorting by start, an earlier range overlaps the current one
// exactly when its end lies past the current start, so keeping the furthest-reaching earlier
// written range and earlier read range finds every conflict the current range can have.
inline std::string first_overlap(std::vector<ByteRange> rs) {
  rs.erase(std::remove_if(rs.begin(), rs.end(), [](const ByteRange& r) { return r.end <= r.begin; }), rs.end());
  std::sort(rs.begin(), rs.end(), [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  const ByteRange* far_w = nullptr;  // earlier written range reaching furthest
  const ByteRange* far_r = nullptr;  // earlier read-only range reaching furthest
  for (const ByteRange& r : rs) {
    const ByteRange* hit = nullptr;
    if (far_w && far_w->end > r.begin) hit = far_w;
    else if (r.written && far_r && far_r->end > r.begin) hit = far_r;
    if (hit) return (hit->written ? hit->name + " and " + r.name : r.name + " and " + hit->name) + " overlap in memory";
    const ByteRange*& far = r.written ? far_w : far_r;
    if (!far || r.end > far->end) far = &r;
  }
  return "";
}

}  // namespace offload
