#pragma once
// A put on the CPU: runs of new KV rows copied into one layer's pages of the slot pool.
#include <cstdint>

namespace tokenlake {

// pages: one layer's slot pool, bytes [num_slots, 2, page_len, row_bytes] (K then V per slot);
// rows: new KV rows, bytes [num_rows, 2, row_bytes] (K and V per row);
// runs: int32 [num_runs, 4] of (src_row, length, dst_slot, dst_offset): rows
// src_row .. src_row + length - 1 land at tokens dst_offset .. of slot dst_slot.
// Every run is checked before any byte is written (std::invalid_argument naming the run).
// Copied row by row, K then V, so the rows are read in memory order: copying every K and then
// every V reads them with a stride and takes about 1.6x as long.
void write_runs(uint8_t* pages, int64_t num_slots, int64_t page_len, int64_t row_bytes,
                const uint8_t* rows, int64_t num_rows, const int32_t* runs, int64_t num_runs);

}  // namespace tokenlake
