"""The ``tokenlake`` console command (ships as ``tokenlake.cli``): the only code that reaches both
the server (``tokenlake.serve``) and the benchmarks (``tokenlake.benchmarks``), lazily, per subcommand."""

if __name__ != "tokenlake.cli":  # one import name per module (docs/architecture.md, "Layout")
    raise ImportError(
        f"the folder cli/ is the package tokenlake.cli: import tokenlake.cli, not {__name__}"
    )
