"""Benchmarks, the goodput harness and the demo, shipped as ``tokenlake.benchmarks``: run them as
``tokenlake bench <name>`` / ``tokenlake goodput`` / ``tokenlake demo`` or
``python -m tokenlake.benchmarks.<module>``. Product code (tokenlake/, engines/, scheduler/, serve/)
never imports this package; only the ``tokenlake`` command (``tokenlake.cli``) does."""

if (
    __name__ != "tokenlake.benchmarks"
):  # one import name per module (docs/architecture.md, "Layout")
    raise ImportError(
        f"the folder benchmarks/ is the package tokenlake.benchmarks: import tokenlake.benchmarks, not {__name__}"
    )
