"""The host of one pool shared by N SGLang workers: ``tokenlake sglang-host``.

It runs the control plane (``Pool`` behind a
:class:`tokenlake.engines.sglang.control_service.ControlService` on a
loopback port) and every instance's query and transfer engines (``MPCluster``; on CPU their
buffers in named shared memory), then waits. Each SGLang worker joins it with three keys in
its ``--tokenlake-config`` (``control_endpoint``, ``secret_file``, ``instance_id``: see
docs/sglang.md); everything else comes from the service
(:mod:`tokenlake.engines.sglang.attach`).

    tokenlake sglang-host --model-path DIR --config tokenlake.json --port 7600 \\
        --secret-file /run/tokenlake/secret [--one-copy] [--metrics-port 9400]

The cluster secret is read from ``--secret-file`` (made there, mode 0600, if it does not
exist): the workers read the same file; it never appears on a command line. Beside it the
host keeps a run record of its shared memory segments, so that a host killed with ``-9`` leaves
nothing behind once one is started again (or ``--cleanup`` is run): :mod:`.sglang_host_runs`.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from dataclasses import dataclass

from tokenlake.config import PoolConfig
from tokenlake.engines.dataplane_config import DataPlaneConfig
from tokenlake.engines.model.config import ModelConfig
from tokenlake.engines.sglang.config import SGLangPoolConfig, load_config
from tokenlake.engines.transport.auth import ClusterSecret
from tokenlake.errors import InvalidArgumentError
from tokenlake.pool import Pool
from tokenlake.serve import sglang_host_runs as runs


@dataclass
class Host:
    """A running host: its pool, engines and control service (:meth:`close` stops all)."""

    pool: Pool
    cluster: object
    service: object

    @classmethod
    def start(
        cls, model_path: str, config: SGLangPoolConfig, secret: ClusterSecret, port: int = 0,
        one_copy: bool = False, device: str = "cpu",
    ) -> Host:  # fmt: skip
        """Build and start a host for ``config.num_instances`` workers of the model at
        ``model_path`` (its ``config.json``: the attention shape the workers must have)."""
        from tokenlake.engines.clusters.mp import MPCluster
        from tokenlake.engines.sglang.control_service import ControlService

        model = ModelConfig.from_dir(model_path)
        shape = model.shape(model.auto_dtype if device == "cpu" else None)
        pool_config = PoolConfig(
            shape, config.num_instances, config.num_slots, config.segment_len,
            config.namespace or str(model_path), device,
        )  # fmt: skip
        pool = Pool(pool_config, engine_slots=one_copy)
        rows = config.max_forward_rows
        dataplane = DataPlaneConfig(max_q_rows=rows, max_kv_rows=rows, device=device)
        cluster = MPCluster(pool, dataplane, config.kernel_backend, secret,
                            named_buffers=device == "cpu")  # fmt: skip
        try:
            service = ControlService(pool, cluster, port=port)
        except BaseException:
            cluster.close()
            raise
        return cls(pool, cluster, service)

    def close(self) -> None:
        self.service.close()
        self.cluster.close()


def secret_at(path: str) -> ClusterSecret:
    """The cluster secret in ``path``, made there (0600) if the file does not exist."""
    if not os.path.exists(path):
        ClusterSecret.generate().write(path)
    return ClusterSecret.from_file(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tokenlake sglang-host",
        description="Host one TokenLake pool shared by N SGLang workers (see docs/sglang.md).",
    )
    p.add_argument("--model-path", help="the served checkpoint's directory (required)")
    p.add_argument("--config",
                   help="the tokenlake JSON config (num_instances = number of workers; required)")  # fmt: skip
    p.add_argument("--port", type=int, default=7600, help="control service port on 127.0.0.1")
    p.add_argument("--secret-file", required=True,
                   help="cluster secret file, shared with the workers (made 0600 if missing)")  # fmt: skip
    p.add_argument("--one-copy", action="store_true",
                   help="workers' SGLang KV caches are the pool's slots (engine-allocated)")  # fmt: skip
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the instances' KV lives (cuda: not run on a GPU)")  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve the pool's Prometheus metrics on 127.0.0.1 (0: off)")  # fmt: skip
    p.add_argument("--cleanup", action="store_true",
                   help="only remove the shared memory of hosts that were killed (their run "
                   "records beside --secret-file), then exit")  # fmt: skip
    args = p.parse_args(argv)
    if not args.cleanup:
        for flag in ("model_path", "config"):
            if getattr(args, flag) is None:
                p.error(f"--{flag.replace('_', '-')} is required (unless --cleanup)")
    if not 0 < args.port < 65536:
        p.error(f"--port: expected 1..65535, got {args.port}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stale = runs.remove_stale_runs(runs.run_record_path(args.secret_file, args.port).parent)
    if stale or args.cleanup:
        print(f"tokenlake sglang-host: removed {len(stale)} shared memory segments of hosts "
              "that were killed", flush=True)  # fmt: skip
    if args.cleanup:
        return 0
    config = load_config(args.config)
    try:
        host = Host.start(args.model_path, config, secret_at(args.secret_file), args.port,
                          args.one_copy, args.device)  # fmt: skip
    except InvalidArgumentError as e:
        print(f"tokenlake sglang-host: {e}")
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    record = runs.run_record_path(args.secret_file, args.port)
    try:
        runs.write_run_record(record, runs.segment_names(host.cluster))
        if args.metrics_port:
            from prometheus_client import start_http_server

            from tokenlake.serve.metrics.sglang import shared_pool_registry

            start_http_server(args.metrics_port, addr="127.0.0.1",
                              registry=shared_pool_registry(host.service))  # fmt: skip
        print(f"tokenlake sglang-host: {config.num_instances} instances, control service at "
              f"{host.service.endpoint}; ready", flush=True)  # fmt: skip
        while not stop.wait(1.0):
            pass
    finally:
        host.close()
        record.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
