"""``python -m tokenlake.serve``: N TokenLake instances, the elastic scheduler and an
OpenAI-compatible HTTP API, on 127.0.0.1 by default.

    python -m tokenlake.serve --model tiny-random --num-instances 4
    python -m tokenlake.serve --model /path/to/Llama-3.2-1B --dtype bfloat16 --port 8000

Then e.g. ``curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json'
-d '{"prompt": "Hello", "max_tokens": 16}'`` (completions and chat stream with
"stream": true).
"""

from __future__ import annotations

import argparse
import logging
import sys

from tokenlake.errors import InvalidArgumentError
from tokenlake.logs import LOG_LEVELS, setup_logging
from tokenlake.serve.cli_flags import add_config_flags, config_from_namespace, group_of
from tokenlake.serve.config import HTTP, ServeConfig


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The server's flags: one per :class:`ServeConfig` field, plus ``--log-level``."""
    from tokenlake.serve.api.app import endpoints

    p = argparse.ArgumentParser(
        prog="python -m tokenlake.serve",
        description=f"{__doc__}\nEndpoints: {', '.join(endpoints())}.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=add_help,
    )
    add_config_flags(p, ServeConfig)
    group_of(p, HTTP).add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="log level (default: %(default)s)"
    )
    return p


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return config_from_namespace(ServeConfig, args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    log = logging.getLogger("tokenlake.serve")
    try:
        config = config_from_args(args)
        from tokenlake.engines.clusters.launcher import stop_helper_processes
        from tokenlake.serve.api.http_server import HTTPServer
        from tokenlake.serve.build import build

        log.info("loading %s on %d instances", config.model, config.num_instances)
        served = build(config)
        server = HTTPServer(served, config.host, config.port, args.log_level)
    except (InvalidArgumentError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info(
        "serving %s at %s (max_model_len %d)", config.model_name, server.url,
        served.runtime.max_model_len,
    )  # fmt: skip
    try:
        server.run()
    finally:
        server.close()
        stop_helper_processes()  # nothing this server started outlives it
    return 0
