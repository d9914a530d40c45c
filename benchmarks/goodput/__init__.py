"""The goodput harness (`tokenlake goodput`): its options, runs, reports and plots. Imports benchmarks.sim and benchmarks.workloads."""
