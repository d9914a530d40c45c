#include "put_runs.h"

#include <cstring>
#include <stdexcept>
#include <string>

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

}  // namespace

void write_runs(uint8_t* pages, int64_t num_slots, int64_t page_len, int64_t row_bytes,
                const uint8_t* rows, int64_t num_rows, const int32_t* runs, int64_t num_runs) {
  for (int64_t i = 0; i < num_runs; ++i) check_run(runs + 4 * i, i, num_slots, page_len, num_rows);
  const int64_t half = page_len * row_bytes;  // bytes of K (or V) of one slot
  for (int64_t i = 0; i < num_runs; ++i) {
    const int64_t src = runs[4 * i], len = runs[4 * i + 1];
    uint8_t* k_dst = pages + (2 * runs[4 * i + 2]) * half + runs[4 * i + 3] * row_bytes;
    const uint8_t* row = rows + 2 * src * row_bytes;
    for (int64_t r = 0; r < len; ++r, row += 2 * row_bytes, k_dst += row_bytes) {
      std::memcpy(k_dst, row, row_bytes);
      std::memcpy(k_dst + half, row + row_bytes, row_bytes);
    }
  }
}

}  // namespace tokenlake
