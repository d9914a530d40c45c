"""The life of one launch on a Ray cluster, from the launching process: connect, choose
nodes, place the instances, hand the cluster secret to every node, start the driver actor
(which starts everything else and serves HTTP), and on shutdown remove actors, placement
groups and shared memory — also for a detached launch stopped later by name."""

from __future__ import annotations

import argparse
import logging
import secrets
import time
from dataclasses import dataclass, replace

import ray

from tokenlake.errors import InvalidArgumentError
from tokenlake.serve.cli import config_from_args
from tokenlake.serve.config import ServeConfig
from tokenlake.serve.ray import placement as ray_placement
from tokenlake.serve.ray.config import LaunchLayout

log = logging.getLogger("tokenlake.launch")
NAMESPACE = "tokenlake"


@dataclass(frozen=True)
class LaunchOptions:
    """Everything a launch needs besides the cluster (frozen, validated).

    ``serve`` is the server's configuration (its ``num_instances`` is the layout's);
    ``host`` the API's bind address (``None``: the driver node's cluster address).
    """

    serve: ServeConfig
    layout: LaunchLayout
    address: str | None = None
    name: str = "tokenlake"
    detach: bool = False
    max_restarts: int = 3
    timeout_s: float = 10.0
    startup_timeout_s: float = 300.0
    force_cross_node: bool = False
    host: str | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.serve.num_instances != self.layout.num_instances:
            raise InvalidArgumentError(
                f"serve.num_instances: {self.serve.num_instances} differs from the layout's "
                f"{self.layout.num_instances}"
            )
        if self.detach and self.address is None:
            raise InvalidArgumentError(
                "detach: needs an address (a running Ray cluster); a local Ray started by "
                "this process would end with it"
            )
        if not isinstance(self.name, str) or not self.name.replace("-", "").isalnum():
            raise InvalidArgumentError(f"name: expected letters, digits and '-', got {self.name!r}")
        r = self.max_restarts
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= 1000:
            raise InvalidArgumentError(f"max_restarts: expected 0..1000, got {r!r}")
        for name in ("timeout_s", "startup_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 86400:
                raise InvalidArgumentError(f"{name}: expected seconds in (0, 86400], got {v!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, layout: LaunchLayout) -> LaunchOptions:
        ns = argparse.Namespace(**vars(args))
        ns.num_instances, ns.host, ns.data_plane = layout.num_instances, "127.0.0.1", "local"
        serve = replace(config_from_args(ns), scheduler_mode="colocated")
        return cls(
            serve, layout, args.address, args.name, args.detach, args.max_restarts,
            args.timeout, args.startup_timeout, args.force_cross_node, args.host, args.log_level,
        )  # fmt: skip


def connect(address: str | None) -> bool:
    """Join the Ray cluster at ``address`` or start a local one bound to loopback; returns
    whether a local cluster was started here."""
    if ray.is_initialized():
        return False
    quiet = {"logging_level": logging.WARNING, "log_to_driver": False}
    if address is None:  # a new one even if this machine runs one; loopback: see launch.run
        ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, **quiet)
        return True
    ray.init(address=address, namespace=NAMESPACE, **quiet)
    return False


class Launch:
    """One launch: :meth:`start` returns the API's URL, :meth:`shutdown` undoes all of it."""

    def __init__(self, options: LaunchOptions) -> None:
        self.options = options
        self.launch_id = secrets.token_hex(4)
        self.placement = None
        self.driver = None
        self.node_ids: tuple[str, ...] = ()
        self._started_ray = False
        self.timings: dict[str, float] = {}

    def start(self) -> str:
        from tokenlake.engines.transport.auth import ClusterSecret
        from tokenlake.serve.ray.driver import DriverActor, DriverSpec

        o = self.options
        t0 = time.perf_counter()
        self._started_ray = connect(o.address)
        try:
            nodes = ray_placement.choose_nodes(o.layout, ray_placement.alive_nodes())
            self.placement = ray_placement.place(
                o.layout, self.launch_id, nodes, o.detach, o.startup_timeout_s
            )
            self.timings["placement_s"] = time.perf_counter() - t0
            here = ray.get_runtime_context().get_node_id()
            self.node_ids = tuple(dict.fromkeys((here, *self.placement.node_ids)))
            secret = ClusterSecret.generate()
            paths = ray_placement.write_secrets(
                self.node_ids, self.launch_id, secret.key, o.startup_timeout_s
            )
            log.info(
                "launch %s: %d instances on nodes %s", self.launch_id, o.layout.num_instances,
                [n[:8] for n in self.placement.node_ids],
            )  # fmt: skip
            addresses = {n.node_id: n.address for n in ray_placement.alive_nodes()}
            spec = DriverSpec(
                o, self.launch_id, self.placement.groups, self.placement.node_ids, paths, here,
                {n: addresses[n] for n in self.node_ids},
            )  # fmt: skip
            self.driver = DriverActor.options(
                name=f"{o.name}-driver",
                lifetime="detached" if o.detach else None,
                num_cpus=0,
                max_restarts=0,
                **ray_placement.on_node(here),
            ).remote()
            url = ray.get(self.driver.start.remote(spec), timeout=o.startup_timeout_s)
            self.timings["ready_s"] = time.perf_counter() - t0
            log.info("launch %s: serving at %s after %.1f s", self.launch_id, url,
                     self.timings["ready_s"])  # fmt: skip
            return url
        except BaseException:
            self.shutdown()
            raise

    def wait(self) -> None:
        """Block until the driver actor ends (or the caller is interrupted)."""
        while True:
            try:
                ray.get(self.driver.status.remote(), timeout=30)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayActorError:
                log.error("the driver actor died")
                return
            time.sleep(1.0)

    def shutdown(self) -> list[str]:
        """Stop the driver (which stops the instances), remove the placement groups and every
        node's shared memory and secret files; returns the files removed."""
        removed = _teardown(self.driver, self.placement, self.node_ids, self.launch_id)
        self.driver = self.placement = None
        if self._started_ray:
            log.info("launch %s: stopping the local Ray", self.launch_id)
            ray.shutdown()
        return removed

    def disconnect(self) -> None:
        """Leave a detached launch running and this process's Ray connection closed."""
        ray.shutdown()


def _teardown(driver, placement, node_ids, launch_id: str, timeout_s: float = 60.0) -> list[str]:
    # Each step is logged so that a slow teardown shows where it waits.
    if driver is not None:
        log.info("launch %s: stopping the driver", launch_id)
        try:
            ray.get(driver.shutdown.remote(), timeout=timeout_s)
        except Exception:  # dead already, or stuck: killed below either way
            log.warning("driver shutdown failed", exc_info=True)
        ray.kill(driver, no_restart=True)
    log.info("launch %s: removing placement groups", launch_id)
    ray_placement.remove(placement)
    log.info("launch %s: removing shared memory and secret files", launch_id)
    return ray_placement.remove_files(node_ids, launch_id, timeout_s) if node_ids else []


def stop_detached(address: str | None, name: str) -> list[str]:
    """Stop the detached launch ``name`` on the cluster at ``address``."""
    connect(address or "auto")
    try:
        try:
            driver = ray.get_actor(f"{name}-driver", namespace=NAMESPACE)
        except ValueError:
            raise InvalidArgumentError(f"name: no running launch {name!r}") from None
        record = ray.get(driver.record.remote(), timeout=30)
        placement = ray_placement.Placement(tuple(record["groups"]), tuple(record["node_ids"]))
        return _teardown(driver, placement, tuple(record["all_nodes"]), record["launch_id"])
    finally:
        ray.shutdown()
