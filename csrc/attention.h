// Prefix attention over a paged KV pool on the CPU, and the exact merge of two partial states.
// Pure C++17 (no Python headers); bindings.cpp only unpacks arrays into TensorView.
#pragma once

#include <cstdint>

namespace tokenlake {

enum class DType { kFloat32, kBFloat16, kInt32, kOther };

constexpr int kMaxDims = 5;

// A borrowed, C-contiguous CPU tensor; the caller keeps the memory alive during the call.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kOther;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
};

// Attention of each request's query rows over its pages of one layer's pool, written into the
// caller's o and lse. Semantics match tokenlake.kernels.reference.partial_attention:
//   q          [num_rows, H_q, D]              float32 or bfloat16 (same dtype as pool_layer)
//   q_indptr   [batch_size + 1]                int32, request b owns rows q_indptr[b]:q_indptr[b+1]
//   pool_layer [num_slots, 2, C, H_kv, D]      index 0 of dim 1 is K, 1 is V
//   kv_indptr  [batch_size + 1]                int32, request b owns kv_indices[kv_indptr[b]:...]
//   kv_indices [nnz_pages]                     int32 slot ids in key order
//   last_len   [batch_size]                    int32 in 1..C, ignored for a request without pages
//   o          [num_rows, H_q, D]              float32 output
//   lse        [num_rows, H_q]                 float32 output, natural log; -inf (o = 0) for a
//                                              row that sees no keys
// causal masks bottom-right aligned (row i of n sees keys j <= kv_len - n + i). logit_cap > 0
// soft-caps every score s = sm_scale * q.k to logit_cap * tanh(s / logit_cap) before the
// softmax (SGLang's RadixAttention.logit_cap, FlashInfer's logits_soft_cap); 0 means no cap.
// Accumulates in fp32 and runs on default_pool(). Everything is checked before anything is
// written (shapes, dtypes, check_paged_indices, sm_scale a float32 in [FLT_MIN, FLT_MAX],
// logit_cap 0 or in [kMinLogitCap, kMaxLogitCap], o and lse overlapping no other argument); a
// failed check throws std::invalid_argument naming the argument, its value and what was allowed.
void partial_attention(const TensorView& q, const TensorView& q_indptr,
                       const TensorView& pool_layer, const TensorView& kv_indptr,
                       const TensorView& kv_indices, const TensorView& last_len,
                       const TensorView& o, const TensorView& lse, bool causal, double sm_scale,
                       double logit_cap);

// The soft caps partial_attention accepts besides 0 (no cap); tokenlake.config.LOGIT_CAP_RANGE.
constexpr double kMinLogitCap = 1e-6;
constexpr double kMaxLogitCap = 1e6;

// Throws std::invalid_argument unless indptr, int32 [n >= 1], starts at 0, never decreases and
// ends at total; name is the argument's, total_name says what total counts ("the rows of q").
void check_indptr(const char* name, const TensorView& indptr, int64_t total,
                  const char* total_name);

// The index arrays of partial_attention against the geometry they address: q_indptr covers the
// num_rows rows of q, kv_indptr covers all of kv_indices, every slot id is in [0, num_slots) and
// last_len is in [1, page_len] for each request with pages. One pass; throws like check_indptr.
void check_paged_indices(const TensorView& q_indptr, const TensorView& kv_indptr,
                         const TensorView& kv_indices, const TensorView& last_len,
                         int64_t num_rows, int64_t num_slots, int64_t page_len);

// Merges two partial states over disjoint key sets into o, lse (which may alias o_a, lse_a or
// o_b, lse_b): o_* [n, H, D] float32, lse_* [n, H] float32 natural log. A side with lse = -inf
// contributes nothing (the other side is copied exactly); two such sides give o = 0, lse = -inf.
// An lse of NaN or +inf is rejected (std::invalid_argument) before anything is written, as is
// an o or lse that overlaps an input other than by aliasing it exactly.
void merge(const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
           const TensorView& lse_b, const TensorView& o, const TensorView& lse);

}  // namespace tokenlake
