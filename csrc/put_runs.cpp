#include "put_runs.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "thread_pool.h"

namespace tokenlake {
namespace {

void check_run(const int32_t* run, int64_t i, int64_t num_slots, int64_t page_len,
               int64_t num_rows) {
  const int64_t src = run[0], len = run[1], slot = run[2], off = run[3];
  const char* bad = nullptr;
  if (len < 0) {
    bad = "length";
  } else if (src < 0 || src + len > num_rows) {
    bad = "src_row";
  } else if (slot < 0 || slot >= num_slots) {
    bad = "dst_slot";
  } else if (off < 0 || off + len > page_len) {
    bad = "dst_offset";
  }
  if (bad != nullptr) {
    throw std::invalid_argument(
        std::string("runs: ") + bad + " out of range in run " + std::to_string(i) +
        " (src_row=" + std::to_string(src) + ", length=" + std::to_string(len) +
        ", dst_slot=" + std::to_string(slot) + ", dst_offset=" + std::to_string(off) +
        "; rows=" + std::to_string(num_rows) + ", slots=" + std::to_string(num_slots) +
        ", page_len=" + std::to_string(page_len) + ")");
  }
}

// Rows first .. last - 1 of one (checked) run, row by row: K, then V.
void copy_run(uint8_t* pages, int64_t page_len, int64_t row_bytes, const uint8_t* rows,
              const int32_t* run, int64_t first, int64_t last) {
  const int64_t half = page_len * row_bytes;  // bytes of K (or V) of one slot
  uint8_t* k_dst = pages + (2 * run[2]) * half + (run[3] + first) * row_bytes;
  const uint8_t* row = rows + 2 * (run[0] + first) * row_bytes;
  for (int64_t r = first; r < last; ++r, row += 2 * row_bytes, k_dst += row_bytes) {
    std::memcpy(k_dst, row, row_bytes);
    std::memcpy(k_dst + half, row + row_bytes, row_bytes);
  }
}

// Whether two runs write the same token of a slot. A valid plan never does; a hostile one may,
// and then the runs are copied in order by one thread, so the last run wins as it always did.
bool overlapping(const int32_t* runs, int64_t num_runs, int64_t page_len) {
  std::vector<std::pair<int64_t, int64_t>> spans;  // [first token, end) over all slots
  spans.reserve(num_runs);
  for (int64_t i = 0; i < num_runs; ++i) {
    const int32_t* run = runs + 4 * i;
    const int64_t first = run[2] * page_len + run[3];
    if (run[1] > 0) spans.emplace_back(first, first + run[1]);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return true;
  }
  return false;
}

}  // namespace

void write_runs(uint8_t* pages, int64_t num_slots, int64_t page_len, int64_t row_bytes,
                const uint8_t* rows, int64_t num_rows, const int32_t* runs, int64_t num_runs,
                int64_t min_parallel_bytes) {
  int64_t total_rows = 0;
  for (int64_t i = 0; i < num_runs; ++i) {
    check_run(runs + 4 * i, i, num_slots, page_len, num_rows);
    total_rows += runs[4 * i + 1];
  }
  const int64_t total_bytes = 2 * total_rows * row_bytes;
  if (total_rows < 2 || total_bytes < min_parallel_bytes ||
      overlapping(runs, num_runs, page_len)) {
    for (int64_t i = 0; i < num_runs; ++i) {
      copy_run(pages, page_len, row_bytes, rows, runs + 4 * i, 0, runs[4 * i + 1]);
    }
    return;
  }
  // Chunks of equal rows, across run boundaries, claimed from both ends: the caller takes
  // them from the front, the other threads from the back. So each thread copies about the
  // same rows put after put (its caches keep them), a thread that comes late (the machine is
  // busy) only takes what is left, and one that never comes holds nothing up.
  const std::shared_ptr<ThreadPool> pool = default_pool();
  std::vector<int64_t> starts(num_runs + 1, 0);  // first row of each run, in run order
  for (int64_t i = 0; i < num_runs; ++i) starts[i + 1] = starts[i] + runs[4 * i + 1];
  const int64_t num_chunks = std::min<int64_t>(
      total_rows, std::max<int64_t>(pool->num_threads(), total_bytes / kPutChunkBytes));
  auto copy_chunk = [&](int64_t c) {
    int64_t lo = total_rows * c / num_chunks;
    const int64_t hi = total_rows * (c + 1) / num_chunks;
    // the run holding row lo: the last run starting at or before it
    int64_t i = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
    for (; lo < hi; ++i) {
      const int64_t last = std::min(hi, starts[i + 1]);
      copy_run(pages, page_len, row_bytes, rows, runs + 4 * i, lo - starts[i], last - starts[i]);
      lo = last;
    }
  };
  std::atomic<uint64_t> ends{static_cast<uint64_t>(num_chunks)};  // front << 32 | back
  const std::thread::id caller = std::this_thread::get_id();
  pool->parallel_for(
      pool->num_threads(),
      [&](int64_t) {
        const bool front = std::this_thread::get_id() == caller;
        uint64_t cur = ends.load(std::memory_order_relaxed);
        for (;;) {
          const uint64_t first = cur >> 32, end = cur & 0xffffffffu;
          if (first >= end) return;
          const uint64_t claimed = front ? cur + (uint64_t{1} << 32) : cur - 1;
          if (!ends.compare_exchange_weak(cur, claimed, std::memory_order_relaxed)) continue;
          copy_chunk(static_cast<int64_t>(front ? first : end - 1));
          cur = ends.load(std::memory_order_relaxed);
        }
      },
      kPutSpinMicros);
}

}  // namespace tokenlake
