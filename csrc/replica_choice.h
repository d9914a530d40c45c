#pragma once
// Power-of-two-choices replica selection (TokenLake paper §4.4), sequential so every choice
// sees the load the earlier choices of the same iteration added.
#include <cstdint>

namespace tokenlake {

// For access i, replicas are rep_inst[i * max_replicas + r] for r < num_replicas[i] (>= 1).
// Two distinct replicas are drawn at random and the one whose instance has the lower load
// wins (ties: the first drawn); weight[i] is then added to load[instance]. Writes the chosen
// replica index r into chosen[i]. Deterministic for a given seed.
void choose_replicas(const int32_t* rep_inst, int64_t max_replicas, const int32_t* num_replicas,
                     const double* weight, int64_t num_accesses, double* load,
                     int64_t num_instances, uint64_t seed, int32_t* chosen);

}  // namespace tokenlake
