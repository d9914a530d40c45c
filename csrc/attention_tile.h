// One work item of partial_attention: some query rows of one request, a range of its KV heads
// and a range of its pages. Internal to the kernel (attention.cpp plans and schedules items).
#pragma once

#include <cstdint>

namespace tokenlake {

// Validated inputs with raw pointers; shapes as in attention.h.
struct PagedProblem {
  const void* q = nullptr;  // [num_rows, H_q, D], float32 or bfloat16 (bf16_)
  const int32_t* q_indptr = nullptr;
  const void* pool = nullptr;  // [num_slots, 2, C, H_kv, D], same dtype as q
  const int32_t* kv_indptr = nullptr;
  const int32_t* kv_indices = nullptr;
  const int32_t* last_len = nullptr;
  bool bf16 = false;
  bool causal = false;
  float sm_scale = 1.0f;
  // Soft cap in the tile's log2 units (logit_cap * log2(e)) and its reciprocal; 0: no cap.
  float cap_log2 = 0.0f;
  float cap_log2_rcp = 0.0f;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t page_len = 0;

  int64_t num_pages(int64_t req) const { return kv_indptr[req + 1] - kv_indptr[req]; }
  int64_t kv_len(int64_t req) const {
    const int64_t pages = num_pages(req);
    return pages == 0 ? 0 : (pages - 1) * page_len + last_len[req];
  }
};

struct WorkItem {
  int32_t req = 0;
  int32_t row_begin = 0;  // absolute rows of q, within the request
  int32_t row_end = 0;
  int32_t head_begin = 0;  // KV heads; each brings its H_q / H_kv query heads
  int32_t head_end = 0;
  int32_t page_begin = 0;  // pages of the request, relative to kv_indptr[req]
  int32_t page_end = 0;
  // Output for row r, query head h: o[((r - dst_row0) * H_q + h) * D], lse[(r - dst_row0) * H_q
  // + h]; normalised o and natural-log lse, so split items merge like any partial states.
  float* o = nullptr;
  float* lse = nullptr;
  int64_t dst_row0 = 0;
};

// Query vectors (rows x heads sharing one KV head) at or above this count use the Q-transposed
// score kernel that reuses each K element across 16 query lanes; fewer use per-key dot products.
constexpr int kWideTileMin = 16;
// Keys per block between online-softmax rescales.
constexpr int kKeyBlock = 32;

void run_tile(const PagedProblem& problem, const WorkItem& item);

}  // namespace tokenlake
