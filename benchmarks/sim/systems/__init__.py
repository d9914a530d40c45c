"""The simulated systems: TokenLake, the cache-aware router, Mooncake and their caches. Imports benchmarks.sim's core modules only."""
