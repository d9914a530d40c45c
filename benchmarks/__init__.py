"""Benchmarks and the demo: scripts run as ``python -m benchmarks.<name>`` from the repo root."""
