#pragma once
// A put on the CPU: runs of new KV rows copied into one layer's pages of the slot pool.
#include <cstdint>
#include <limits>

namespace tokenlake {

// A put of at least min_parallel_bytes (K and V) is split over the kernels' thread pool. Off
// by default: on the 2 shared cores it was measured on (bench_dataplane, notes/11-put-s3.md)
// the split copied 1.6-1.7x faster from 1 MiB on while a core was idle, but 3-27% slower under
// the machine's usual load, and never faster below 512 KiB (handing work to another thread
// costs about what such a copy does). DataPlaneConfig.put_parallel_min_bytes = 1 MiB turns it
// on for a host with cores to spare.
constexpr int64_t kPutParallelMinBytes = std::numeric_limits<int64_t>::max();
// Bytes per chunk of a split put (at least one chunk per thread).
constexpr int64_t kPutChunkBytes = int64_t{64} << 10;
// A put takes microseconds, about what waking a sleeping thread takes: the pool's threads poll
// this long for the next put (or the caller for the last share) before they sleep.
constexpr int64_t kPutSpinMicros = 100;

// pages: one layer's slot pool, bytes [num_slots, 2, page_len, row_bytes] (K then V per slot);
// rows: new KV rows, bytes [num_rows, 2, row_bytes] (K and V per row);
// runs: int32 [num_runs, 4] of (src_row, length, dst_slot, dst_offset): rows
// src_row .. src_row + length - 1 land at tokens dst_offset .. of slot dst_slot.
// Every run is checked before any byte is written (std::invalid_argument naming the run).
// Copied row by row, K then V, so the rows are read in memory order: copying every K and then
// every V reads them with a stride and takes about 1.6x as long. From min_parallel_bytes on,
// the rows are split into chunks copied by default_pool()'s threads; runs that overlap (never
// in a valid plan) are copied in order by the calling thread, so the last run wins as always.
void write_runs(uint8_t* pages, int64_t num_slots, int64_t page_len, int64_t row_bytes,
                const uint8_t* rows, int64_t num_rows, const int32_t* runs, int64_t num_runs,
                int64_t min_parallel_bytes = kPutParallelMinBytes);

}  // namespace tokenlake
