#pragma once
// The attention kernels' argument checks (attention.h): everything is checked before any work
// or write; a failed check throws std::invalid_argument naming the argument, its value and
// what was allowed. Internal to the C++ core.
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "attention.h"
#include "attention_tile.h"

namespace tokenlake {
namespace detail {

[[noreturn]] void fail(const std::string& message);

// t has shape `shape` (entries of -1 match any size) and one of `dtypes`.
void check(const char* name, const TensorView& t, std::initializer_list<int64_t> shape,
           std::initializer_list<DType> dtypes);

using Named = std::pair<const char*, const TensorView*>;

// An output must not share memory with another argument (other threads read what it writes),
// except an exact alias listed in may_alias (same data; the caller checked the same shape).
void check_disjoint(const char* name, const TensorView& out, std::initializer_list<Named> others,
                    std::initializer_list<const TensorView*> may_alias = {});

// Natural-log LSE values are finite or -inf (an empty state).
void check_lse(const char* name, const float* lse, int64_t num_states, int64_t H);

// partial_attention's arguments, checked, as the tile kernel reads them (causal not yet set).
PagedProblem validate(const TensorView& q, const TensorView& q_indptr, const TensorView& pool,
                      const TensorView& kv_indptr, const TensorView& kv_indices,
                      const TensorView& last_len, const TensorView& o, const TensorView& lse,
                      double sm_scale, double logit_cap);

}  // namespace detail
}  // namespace tokenlake
