"""``tokenlake launch`` (``python -m tokenlake.serve.ray.cli``): TokenLake on a Ray cluster.

Connects to a running Ray cluster (``--address auto`` or ``HOST:PORT``) or starts a local
one, places every instance in a placement group of its own on the nodes the layout names,
starts each instance's compute, query and transfer processes as Ray actors, and runs the
control plane, the scheduler and the OpenAI-compatible HTTP API in one driver actor:

    ray up deploy/ray-cluster.yaml
    ray attach deploy/ray-cluster.yaml
    python -m tokenlake.serve.ray.cli --address auto --instances 4 --nodes 2 --model tiny-random
    curl http://<head>:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "Hello", "max_tokens": 16}'

Ctrl-C stops everything it started (actors, placement groups, shared memory). With
``--detach`` (on a running cluster: it needs ``--address``) the launch keeps running after
the command returns; stop it with ``--stop --address ... [--name ...]``. The layout can
come from a YAML file (``--layout``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from tokenlake.errors import InvalidArgumentError
from tokenlake.logs import setup_logging
from tokenlake.serve import cli as serve_cli
from tokenlake.serve.ray.config import PLACEMENTS, layout_from, parse_nodes, read_layout_file

log = logging.getLogger("tokenlake.launch")


def build_parser() -> argparse.ArgumentParser:
    """The launch's options: the server's (model, pool, HTTP) plus Ray and layout ones."""
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[serve_cli.build_parser(add_help=False)],
        conflict_handler="resolve",
    )
    r = p.add_argument_group("Ray cluster")
    r.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join: 'auto' (the one started on this machine by 'ray start' or "
        "'ray up') or HOST:PORT; omitted: start a local single-node Ray cluster",
    )
    r.add_argument(
        "--name",
        default="tokenlake",
        help="name of this launch in the cluster (actors are named after it; default: %(default)s)",
    )
    r.add_argument(
        "--detach",
        action="store_true",
        help="return once serving; the launch keeps running until 'launch --stop' "
        "(needs --address: a local Ray started here would end with this command)",
    )
    r.add_argument(
        "--stop", action="store_true", help="stop the detached launch --name on --address"
    )
    r.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="times Ray restarts a dead instance process (default: %(default)s)",
    )
    r.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds a data-plane peer may stay silent before it is failed (default: %(default)s)",
    )
    r.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for placement groups and actors (default: %(default)s)",
    )
    r.add_argument(
        "--force-cross-node",
        action="store_true",
        help="move every bulk transfer over torch.distributed as if each instance had a node "
        "of its own (tests the cross-node path on one machine)",
    )
    lay = p.add_argument_group("layout (a --layout file, overridden by these flags)")
    lay.add_argument("--layout", default=None, help="YAML file with the layout keys below")
    lay.add_argument(
        "--instances",
        "--num-instances",
        dest="num_instances",
        type=int,
        default=None,
        help="TokenLake instances, one placement group each (default: 2)",
    )
    lay.add_argument(
        "--gpus-per-instance",
        type=int,
        default=None,
        help="GPUs (bundles) per instance; 0 = CPU instances (default: 0)",
    )
    lay.add_argument(
        "--cpus-per-instance",
        type=float,
        default=None,
        help="CPUs reserved per instance (default: 1)",
    )
    lay.add_argument(
        "--nodes",
        default=None,
        help="how many nodes to use, or comma-separated custom resource names naming them "
        "(default: every node that fits)",
    )
    lay.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default=None,
        help="spread: instance i on node i mod K; pack: consecutive instances share a node; "
        "strict-spread: a node per instance (default: spread)",
    )
    h = p.add_argument_group("HTTP API (launch)")
    h.add_argument(
        "--host",
        default=None,
        help="address the API binds to (default: the driver node's cluster address)",
    )
    p.add_argument("--data-plane", default="ray", help=argparse.SUPPRESS)
    return p


def layout_of(args: argparse.Namespace):
    """The :class:`LaunchLayout` of the parsed options (file values, flags on top)."""
    file_values = read_layout_file(args.layout) if args.layout else {}
    overrides = {
        k: getattr(args, k)
        for k in ("num_instances", "gpus_per_instance", "cpus_per_instance", "placement")
        if getattr(args, k) is not None
    }
    if args.nodes is not None:
        overrides["num_nodes"], overrides["node_resources"] = parse_nodes(args.nodes)
    return layout_from(file_values, overrides)


DETACH_NEEDS_ADDRESS = (
    "--detach: needs --address (a running Ray cluster: 'auto' for the one 'ray start' or "
    "'ray up' started on this machine, or HOST:PORT); without it the launch starts a local "
    "Ray that ends with this command. Start one with 'ray start --head' and pass "
    "--address auto, or leave out --detach to serve in the foreground"
)


def run(args: argparse.Namespace) -> int:
    """Run a parsed launch command; returns the exit code (2: refused, nothing started)."""
    if args.detach and args.address is None and not args.stop:
        print(f"error: {DETACH_NEEDS_ADDRESS}", file=sys.stderr)
        return 2
    if args.address is None and not args.stop:
        # A local cluster stays on loopback: Ray binds a node to its outward address unless
        # it treats this machine as non-clustered (read when ray is imported).
        if "ray" in sys.modules:
            log.warning("ray was imported already: the local cluster may bind a public address")
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from tokenlake.serve.ray import launch as ray_launch

    try:
        if args.stop:
            removed = ray_launch.stop_detached(args.address, args.name)
            print(f"stopped launch {args.name!r} ({len(removed)} files removed)")
            return 0
        layout = layout_of(args)
        options = ray_launch.LaunchOptions.from_args(args, layout)
        launch = ray_launch.Launch(options)
        url = launch.start()
    except (InvalidArgumentError, OSError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"TokenLake serving {options.serve.model_name} at {url}", flush=True)
    if args.detach:
        print(f"detached; stop with: tokenlake launch --stop --address {args.address} "
              f"--name {args.name}")  # fmt: skip
        launch.disconnect()
        return 0
    # A process started with SIGINT ignored (by a shell's `&`, nohup, or a parent that ignores
    # it) inherits that, and Python then never raises KeyboardInterrupt: Ctrl-C must still stop
    # a foreground launch and remove what it created.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        launch.wait()
    except KeyboardInterrupt:
        log.info("interrupted; shutting down")
    finally:
        launch.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.detach and args.address is None and not args.stop:
        parser.error(DETACH_NEEDS_ADDRESS)  # exit 2 with the usage, before anything starts
    setup_logging(args.log_level)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
