"""The ``tokenlake`` console command (ships as ``tokenlake.cli``): the only code that reaches both
the server (``tokenlake.serve``) and the benchmarks (``tokenlake.benchmarks``), lazily, per subcommand."""
