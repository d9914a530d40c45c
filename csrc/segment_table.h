#pragma once
// Reader counts of segment-table rows and each row's share of the evictable replicas
// (tokenlake/segment_table.py), updated for many rows in one pass.
#include <cstdint>

namespace tokenlake {

// The table's per-row columns (length num_rows each).
struct SegmentColumns {
  int32_t* readers;
  int32_t* evictable;  // replicas eviction may take now: 0 while read or outside the tree,
                       // else num_replicas minus one if pinned
  const int32_t* pins;
  const int32_t* num_replicas;
  const bool* in_tree;
  int64_t num_rows;
};

// Adds delta readers to each of the distinct rows idx[0..n) and refreshes their evictable
// share. Returns the change of the total evictable count. Throws std::invalid_argument on a
// row out of range (before changing anything).
int64_t add_readers(SegmentColumns& table, const int64_t* idx, int64_t n, int32_t delta);

}  // namespace tokenlake
