"""Real clusters on this machine: the CPU mini-cluster, `tokenlake serve` N vs 1, SGLang end to end. Imports product code, benchmarks.workloads and benchmarks.sim."""
