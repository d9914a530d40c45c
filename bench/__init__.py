"""Benchmarks, the goodput harness and the demo, shipped as ``tokenlake.bench``: run them as
``tokenlake bench <name>`` / ``tokenlake goodput`` / ``tokenlake demo`` or
``python -m tokenlake.bench.<module>``. Product code (tokenlake/, engines/, scheduler/, serve/)
never imports this package; only the ``tokenlake`` command (``tokenlake.cli``) does."""
