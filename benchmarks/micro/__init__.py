"""Micro-benchmarks (`tokenlake bench NAME`): kernels, data plane, model engine, plans, scheduler. Imports product code only."""
