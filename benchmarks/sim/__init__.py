"""Discrete-event cluster simulator for the goodput harness (docs/goodput.md).

TokenLake runs through the real control plane (:class:`tokenlake.Pool`); the baselines
(SGLang-Router with local radix caches, Mooncake-style xPyD) run in the same event loop with
the same step timer, workloads and metrics.
"""
