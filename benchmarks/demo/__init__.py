"""The end-to-end demo (`make demo`): the server it starts and the client that replays the trace. Imports serve and benchmarks.workloads."""
