"""``python -m tokenlake.serve``: N TokenLake instances, the elastic scheduler and an
OpenAI-compatible HTTP API, on 127.0.0.1 by default.

    python -m tokenlake.serve --model tiny-random --num-instances 4
    python -m tokenlake.serve --model /path/to/Llama-3.2-1B --dtype bfloat16 --port 8000

Then e.g. ``curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json'
-d '{"prompt": "Hello", "max_tokens": 16}'``. Endpoints: /v1/completions,
/v1/chat/completions (both with "stream": true), /v1/models, /health, /metrics.
"""

from __future__ import annotations

import argparse
import logging
import sys

from tokenlake.errors import InvalidArgumentError
from tokenlake.logs import setup_logging
from tokenlake.serve.config import DATA_PLANES, ServeConfig

LOG_LEVELS = ("debug", "info", "warning", "error")


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    d = ServeConfig()
    p = argparse.ArgumentParser(
        prog="python -m tokenlake.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=add_help,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=d.model,
        help="Hugging Face checkpoint directory (config.json + *.safetensors, "
        "tokenizer.json), or 'tiny-random' for a seeded small Llama made locally "
        "(default: %(default)s)",
    )
    m.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as 'model' (default: --model)",
    )
    m.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default=d.dtype,
        help="weights and KV dtype; auto keeps the checkpoint's (default: %(default)s)",
    )
    m.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="longest prompt + output in tokens; 0 = the model's, capped by the pool",
    )
    m.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of tiny-random and of unseeded sampling (default: %(default)s)",
    )
    c = p.add_argument_group("pool and scheduler")
    c.add_argument(
        "--num-instances",
        type=int,
        default=d.num_instances,
        help="TokenLake instances (default: %(default)s)",
    )
    c.add_argument(
        "--segment-len",
        type=int,
        default=d.segment_len,
        help="tokens per KV segment (default: %(default)s)",
    )
    c.add_argument(
        "--num-slots",
        type=int,
        default=d.num_slots,
        help="segment slots per instance (default: %(default)s)",
    )
    c.add_argument(
        "--chunk-len",
        type=int,
        default=d.chunk_len,
        help="most tokens of one prefill chunk, a multiple of --segment-len (default: %(default)s)",
    )
    c.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="most requests running at once (default: %(default)s)",
    )
    c.add_argument(
        "--data-plane",
        choices=DATA_PLANES,
        default=d.data_plane,
        help="local: engines in this process; mp: query/transfer engine processes "
        "per instance (default: %(default)s)",
    )
    c.add_argument(
        "--kernel-backend",
        choices=("cpu", "torch", "flashinfer"),
        default=None,
        help="attention kernels (default: by device)",
    )
    c.add_argument(
        "--torch-threads",
        type=int,
        default=d.torch_threads,
        help="threads for the model's torch ops; 0 = torch's default (default: %(default)s)",
    )
    c.add_argument(
        "--no-profile",
        action="store_true",
        help="skip measuring the scheduler's latency model at start-up",
    )
    s = p.add_argument_group("HTTP")
    s.add_argument("--host", default=d.host, help="address to bind (default: %(default)s)")
    s.add_argument("--port", type=int, default=d.port, help="port (default: %(default)s)")
    s.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="log level (default: %(default)s)"
    )
    return p  # fmt: skip


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        num_instances=args.num_instances,
        segment_len=args.segment_len,
        num_slots=args.num_slots,
        max_model_len=args.max_model_len,
        chunk_len=args.chunk_len,
        max_num_seqs=args.max_num_seqs,
        data_plane=args.data_plane,
        kernel_backend=args.kernel_backend,
        host=args.host,
        port=args.port,
        seed=args.seed,
        profile=not args.no_profile,
        torch_threads=args.torch_threads,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    log = logging.getLogger("tokenlake.serve")
    try:
        config = config_from_args(args)
        from tokenlake.serve.build import build
        from tokenlake.serve.http_server import HTTPServer

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
    return 0
