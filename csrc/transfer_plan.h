#pragma once
// An iteration's put runs and segment copies grouped per sub-batch (and per destination
// instance) in one stable counting sort: every transfer plan's arrays are slices.
#include <cstdint>

namespace tokenlake {

struct TransferInput {
  int64_t num_subs;
  int64_t num_instances;
  int64_t num_runs;
  const int64_t* runs;  // [num_runs, 6]: sub, dst_inst, src_row, len, dst_slot, dst_offset
  int64_t num_copies;
  const int64_t* copies;  // [num_copies, 6]: sub, src_inst, src_slot, dst_inst, dst_slot, len
};

// Outputs, caller-allocated (n runs, m copies, U sub-batches).
struct TransferArrays {
  int32_t* run_cols;    // [4, n] src_row, len, dst_slot, dst_offset; sorted by (sub, dst)
  int32_t* dst_ids;     // [n] destination of each (sub, dst) group (num_dsts used)
  int32_t* dst_indptr;  // [n + U] grouped offsets (see page_plan.h) over groups into runs
  int32_t* copy_cols;   // [5, m] src_inst, src_slot, dst_inst, dst_slot, len; sorted by sub
  int64_t* bounds;      // [3 * (U + 1)] first run, destination group, copy of each sub-batch
  int64_t num_dsts = 0;
};

// Stable: runs of one (sub, dst) and copies of one sub keep their order. Throws
// std::invalid_argument on a sub-batch or instance out of range, or a value beyond int32.
void plan_transfers(const TransferInput& in, TransferArrays& out);

}  // namespace tokenlake
