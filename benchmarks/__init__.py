"""Benchmarks, the goodput harness and the demo, shipped as ``tokenlake.benchmarks``: run them as
``tokenlake bench <name>`` / ``tokenlake goodput`` / ``tokenlake demo`` or
``python -m tokenlake.benchmarks.<module>``. Product code (tokenlake/, engines/, scheduler/, serve/)
never imports this package; only the ``tokenlake`` command (``tokenlake.cli``) does."""
