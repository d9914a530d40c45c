"""The prefix tree: the global index of sealed segments, its match, eviction and checks."""
