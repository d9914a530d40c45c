#include "replica_choice.h"

#include <stdexcept>
#include <string>

namespace tokenlake {
namespace {

// splitmix64: small, fast and good enough to draw replica pairs.
uint64_t next_random(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace

void choose_replicas(const int32_t* rep_inst, int64_t max_replicas, const int32_t* num_replicas,
                     const double* weight, int64_t num_accesses, double* load,
                     int64_t num_instances, uint64_t seed, int32_t* chosen) {
  uint64_t state = seed;
  for (int64_t i = 0; i < num_accesses; ++i) {
    const int32_t n = num_replicas[i];
    if (n < 1 || n > max_replicas) {
      throw std::invalid_argument("num_replicas: expected 1.." + std::to_string(max_replicas) +
                                  ", got " + std::to_string(n) + " at access " +
                                  std::to_string(i));
    }
    const int32_t* row = rep_inst + i * max_replicas;
    int32_t pick = 0;
    if (n > 1) {
      const int32_t a = static_cast<int32_t>(next_random(state) % n);
      int32_t b = static_cast<int32_t>(next_random(state) % (n - 1));
      if (b >= a) ++b;  // a distinct second candidate
      pick = load[row[b]] < load[row[a]] ? b : a;
    }
    const int32_t instance = row[pick];
    if (instance < 0 || instance >= num_instances) {
      throw std::invalid_argument("rep_inst: instance " + std::to_string(instance) +
                                  " out of range at access " + std::to_string(i));
    }
    load[instance] += weight[i];
    chosen[i] = pick;
  }
}

}  // namespace tokenlake
