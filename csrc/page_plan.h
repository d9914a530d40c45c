#pragma once
// One pass over an iteration's prefix pages: every page access of every piece, a replica for
// each (power of two choices, replica_choice.h), one stable counting sort by (sub-batch,
// holder) and the CSR arrays of every query plan as slices of a few global arrays.
#include <cstdint>

namespace tokenlake {

// The segment table's replica columns, row-major [num_rows, max_replicas].
struct ReplicaTable {
  const int32_t* rep_inst;
  const int32_t* rep_slot;
  const int32_t* num_replicas;  // [num_rows]
  int64_t num_rows;
  int64_t max_replicas;
};

// One iteration's pieces (a sub-batch's share of one chunk), sorted by sub-batch. Piece p
// reads, in this order: the full pages page_idx[page_ptr[p]:page_ptr[p+1]] (table rows), then
// its shared partial source page (table row source_idx[p] >= 0, source_len[p] tokens), then
// its private open tail (tail_len[p] > 0 tokens at tail_inst[p]/tail_slot[p]).
struct PagePieces {
  int64_t num_pieces;
  int64_t num_subs;
  int64_t num_instances;
  int64_t segment_len;
  const int64_t* sub;        // [P] non-decreasing, in [0, num_subs)
  const int64_t* rows;       // [P] query rows
  const int64_t* page_ptr;   // [P + 1]
  const int64_t* page_idx;   // [page_ptr[P]]
  const int64_t* source_idx; // [P]
  const int64_t* source_len; // [P]
  const int64_t* tail_inst;  // [P]
  const int64_t* tail_slot;  // [P]
  const int64_t* tail_len;   // [P]
};

// Outputs, caller-allocated. A = accesses (full pages + sources + tails), U = sub-batches,
// N = instances, P = pieces. "Grouped" CSR offsets hold every sub-batch's offsets in one
// array: sub-batch u's elements [lo, hi) have offsets out[lo + u : hi + u + 1], relative to
// its first element, its end appended.
struct PagePlan {
  int32_t* kv_indices;     // [A] slot of every access, sorted by (sub, holder, piece)
  int32_t* kv_indptr;      // [A + U] grouped over entries (one per sub, holder, piece)
  int32_t* entry_req;      // [A] piece of each entry, relative to its sub-batch's first
  int32_t* last_len;       // [A] tokens in each entry's last page
  int32_t* holder_ids;     // [A] instance of each holder (one per sub, instance)
  int32_t* holder_indptr;  // [A + U] grouped over holders, offsets into entries
  int32_t* q_indptr;       // [P + U] grouped over pieces, offsets into query rows
  int64_t* bounds;         // [4 * (U + 1)]: first access, entry, holder, piece per sub-batch
  double* load;            // [N] tokens × rows read on each instance
  double* query_rows;      // [U * N] query rows each sub-batch sends to each instance
  int64_t* read_rows;      // [A] distinct table rows read, first occurrence first
  int32_t* read_count;     // [A] how many accesses read each
  double* read_qrows;      // [A] query rows reading each
  int64_t* chosen;         // [A] distinct row * N + instance chosen among several, ascending
  // filled in: entries, holders, distinct read rows, chosen pairs; sum of rows × tokens
  // over table pages
  int64_t num_entries = 0;
  int64_t num_holders = 0;
  int64_t num_read_rows = 0;
  int64_t num_chosen = 0;
  double access_tokens = 0.0;
};

// Number of accesses A the pieces make (the outputs' size); checks the pieces' shape.
int64_t count_page_accesses(const PagePieces& pieces);

// Plans every page access. Replicas are chosen sequentially in access order on base_load
// [N] plus the load of the accesses with one replica (replica_choice.h, seeded by seed).
// Throws std::invalid_argument on an out-of-range row, instance, sub-batch or length.
void plan_pages(const ReplicaTable& table, const PagePieces& pieces, const double* base_load,
                uint64_t seed, PagePlan& out);

}  // namespace tokenlake
