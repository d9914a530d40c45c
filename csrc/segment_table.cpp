#include "segment_table.h"

#include <stdexcept>
#include <string>

namespace tokenlake {

int64_t add_readers(SegmentColumns& t, const int64_t* idx, int64_t n, int32_t delta) {
  for (int64_t k = 0; k < n; ++k) {
    if (idx[k] < 0 || idx[k] >= t.num_rows) {
      throw std::invalid_argument("idx: row " + std::to_string(idx[k]) + " out of range [0, " +
                                  std::to_string(t.num_rows) + ")");
    }
  }
  int64_t change = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t r = idx[k];
    const int32_t readers = (t.readers[r] += delta);
    int32_t share = 0;
    if (t.in_tree[r] && readers == 0) {
      share = t.num_replicas[r] - (t.pins[r] > 0 ? 1 : 0);
      if (share < 0) share = 0;
    }
    change += share - t.evictable[r];
    t.evictable[r] = share;
  }
  return change;
}

}  // namespace tokenlake
