"""Local launcher of the multi-process data plane: N instances on one machine, each a query
engine and a transfer engine process beside the compute-engine clients (this process).

    with MPCluster(pool.config, DataPlaneConfig()) as cluster:
        run_iteration(cluster, plans, chunks, model)     # same API as LocalCluster
        cluster.retire(plans.epoch)                      # after pool.commit / pool.abort

Start-up: shared buffers are allocated here, engines are spawned with them
(:mod:`tokenlake.engines.clusters.launcher`), and the cluster waits until every engine reported ready.
Shut-down (``close``, the end of a ``with`` block, garbage collection or interpreter exit)
stops every engine, kills any that do not stop, and releases the buffers; nothing is left
running.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import zmq

from tokenlake import wire
from tokenlake.engines.client.driver import Driver
from tokenlake.engines.clusters.base import ClusterBase, host_tier, layout_for, pool_config
from tokenlake.engines.clusters.launcher import EngineProcesses
from tokenlake.engines.core.engine_base import ROLES
from tokenlake.engines.core.shared_buffers import InstanceBuffers, Layout
from tokenlake.engines.dataplane_config import DataPlaneConfig
from tokenlake.engines.transport import doorbell, messages, process_group
from tokenlake.engines.transport.auth import ClusterSecret, FrameAuth
from tokenlake.engines.transport.auth_store import StoreServer
from tokenlake.engines.transport.sockets import Requester
from tokenlake.errors import InvalidArgumentError
from tokenlake.validate import check_int


class MPCluster(ClusterBase):
    """``config.num_instances`` instances, each two engine processes sharing buffers
    (``config``: a ``PoolConfig``, or a ``Pool`` whose config is read).

    ``engine(i)`` returns instance ``i``'s :class:`EngineClient`; ``backend`` is the kernel
    backend every engine uses (``None``: by device). :meth:`reset` re-lays the running
    cluster for another pool (at most as many instances; the rest idle); :meth:`mark_lost`
    stops using a failed instance; :meth:`restart` brings it back with fresh engines.
    With ``doorbells`` (on one host), a query's per-layer request to another instance of
    the host is a doorbell in shared memory (:mod:`tokenlake.engines.transport.doorbell`) instead of
    a message; ``doorbells=False`` keeps the messages (for comparison).
    """

    def __init__(
        self,
        pool,
        config: DataPlaneConfig | None = None,
        backend: str | None = None,
        secret: ClusterSecret | None = None,
        doorbells: bool = True,
        named_buffers: bool = False,
    ) -> None:
        """``named_buffers`` (CPU): the instances' buffers in named shared memory, so that
        processes this cluster did not spawn can map them (SGLang workers joining a host)."""
        config = config if config is not None else DataPlaneConfig()
        if not isinstance(config, DataPlaneConfig):
            raise InvalidArgumentError(
                f"config: expected a DataPlaneConfig, got {type(config).__name__}"
            )
        self.config = config
        self._use_doorbells = doorbells
        if named_buffers and config.device != "cpu":
            raise InvalidArgumentError(
                "named_buffers: CPU only (a GPU's buffers travel as CUDA IPC handles)"
            )
        self._named = named_buffers
        self._num_launched = pool_config(pool).num_instances
        self._ctx = zmq.Context()
        self._procs: EngineProcesses | None = None
        self._store = self._group = self._mps = None
        self._closed = False
        # the cluster secret: given, named by TOKENLAKE_SECRET_FILE, or made here; engines
        # read it from a 0600 file in a private directory, removed at close
        self.secret = secret or ClusterSecret.from_env() or ClusterSecret.generate()
        self._secret_dir = tempfile.mkdtemp(prefix="tokenlake-")
        self.secret_path = os.path.join(self._secret_dir, "secret")
        self.secret.write(self.secret_path)
        self._auth = FrameAuth(self.secret)
        try:
            self._launch(pool)
            self.reset(pool, backend)
        except BaseException:
            self.close()
            raise

    # ---- lifecycle -----------------------------------------------------------------------
    def _launch(self, pool) -> None:
        cfg, n = self.config, self._num_launched
        layout = self._layout(pool)
        if cfg.use_mps:  # not run on a GPU; before any CUDA context, so all join the daemon
            from tokenlake.engines.transport.gpu import MpsDaemon

            self._mps = MpsDaemon()
            self._mps.start()
        # per-layer queries inside one host ring doorbells in shared memory (no message)
        use = self._use_doorbells and not cfg.separate_hosts and doorbell.supported()
        bells = doorbell.nbytes(n) if use else 0
        if self._named:
            self._buffers = [InstanceBuffers.create_named(layout.nbytes(), bells) for _ in range(n)]
        else:
            self._buffers = [
                InstanceBuffers.allocate(layout.nbytes(), cfg.device, doorbell_bytes=bells)
                for _ in range(n)
            ]
        events = None
        if cfg.device == "cuda":  # not run on a GPU
            from tokenlake.engines.transport.gpu import ClientEvents

            events = ClientEvents(n, self._buffers[0].raw["pool"].device)
        spec_group = None
        if cfg.separate_hosts:
            backend = "nccl" if cfg.device == "cuda" else "gloo"
            self._store = StoreServer(self.secret, cfg.host)
            spec_group = process_group.GroupSpec(
                backend, cfg.host, self._store.endpoint, n, cfg.startup_timeout_s
            )
        handles = events.handles if events is not None else None
        self._procs = EngineProcesses(
            cfg, self._ctx, self._buffers, spec_group, handles, self._auth, self.secret_path
        )
        endpoints = self._procs.spawn([(role, i) for role in ROLES for i in range(n)])
        self._endpoints = dict(endpoints)
        if spec_group is not None:
            store = process_group.make_store(spec_group, self.secret)
            self._group = process_group.connect(spec_group, store, process_group.DRIVER_RANK)
        requester = Requester(
            self._ctx, cfg.timeout_s, cfg.poll_interval_s, self._is_alive, self._auth
        )
        for key, ep in endpoints.items():
            requester.connect(key, ep)
        self._driver = Driver(cfg, n, requester, self._group, events)
        if bells:
            areas = {i: doorbell.DoorbellArea(b.doorbells, n) for i, b in enumerate(self._buffers)}
            self._driver.doorbells = doorbell.DoorbellClient(
                areas, lambda h: self._is_alive(("query", h)), cfg.timeout_s
            )

    def close(self) -> None:
        """Stop every engine and release sockets, group and buffers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        driver = getattr(self, "_driver", None)
        if driver is not None:
            for key in driver.channel.keys:
                if self._is_alive(key):
                    with contextlib.suppress(zmq.ZMQError):
                        driver.channel.request(key, messages.Stop)
        if self._procs is not None:
            self._procs.stop_all(5.0)
        if driver is not None:
            driver.channel.close()
        process_group.shutdown(self._group)
        if self._store is not None:
            self._store.close()
        self._group = self._store = self._driver = None
        shutil.rmtree(self._secret_dir, ignore_errors=True)
        self._ctx.destroy(linger=0)  # closes any socket a failed start-up left open
        for b in self._buffers:
            b.unlink()
        self._buffers = []
        if self._mps is not None:
            self._mps.stop()

    def __enter__(self) -> MPCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the cluster API ------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return self._driver.layout

    @property
    def buffers(self) -> list[InstanceBuffers]:
        """Every instance's shared storage (for compute processes on this host)."""
        return list(self._buffers)

    @property
    def endpoints(self) -> dict[tuple[str, int], str]:
        """Every engine's socket, by ``(role, instance_id)``."""
        return dict(self._endpoints)

    def engine_stats(self) -> dict[tuple[str, int], dict[str, int]]:
        """Every live engine's counters (calls, bytes, errors, rejected and unauthenticated
        frames, peer failures), by ``(role, instance_id)``, plus this process's clients'
        under ``("client", -1)``."""
        d = self._driver
        keys = [k for k in d.channel.keys if self._is_alive(k)]
        tickets = [d.channel.request(k, messages.Stats) for k in keys]
        payloads = d.channel.wait(tickets, "stats")
        out = {k: wire.unpackb(p, 1 << 20) for k, p in zip(keys, payloads, strict=True)}
        out[("client", -1)] = {**d.channel.stats, **d.stats}
        return out

    @property
    def pids(self) -> dict[tuple[str, int], int]:
        """Process id of every engine, by ``(role, instance_id)`` (for tests and tools)."""
        return self._procs.pids

    def reset(self, config, backend: str | None = None) -> MPCluster:
        """Serve a new pool (``config``: its ``PoolConfig`` or the ``Pool``; at most as many
        instances as launched, its layout must fit the buffers allocated at launch) with
        kernel ``backend``. Drops every binding; lost instances stay lost (the control plane
        must not place data on them: ``Pool.drop_instance``)."""
        cfg = pool_config(config)
        if cfg.num_instances > self._num_launched:
            raise InvalidArgumentError(
                f"config: has {cfg.num_instances} instances, the cluster only {self._num_launched}"
            )
        layout = self._layout(cfg)
        problem = self._buffers[0].fits(layout)
        if problem is not None:
            raise InvalidArgumentError(f"config: {problem}")
        d = self._driver
        d.quiesce("reset")
        d.configure(d.channel.keys, layout, backend)
        d.views = {i: b.views(layout) for i, b in enumerate(self._buffers)}
        d.tier = host_tier(cfg, self.config.device)  # in this process: its clients move it
        self._make_clients(cfg.num_instances)
        return self

    # ---- failures ------------------------------------------------------------------------
    def mark_lost(self, instance_id: int) -> None:
        """Stop using an instance: kill its engines, forget work addressed to them, and wait
        until the surviving engines finished everything already sent to them."""
        check_int("instance_id", instance_id, low=0, high=self._num_launched)
        d = self._driver
        d.lost.add(instance_id)
        self._procs.kill([(role, instance_id) for role in ROLES])
        for role in ROLES:
            d.channel.disconnect((role, instance_id))
        d.forget(instance_id)
        d.quiesce("fail-over")

    def failures(self) -> list[int]:
        """Instances still in use one of whose engine processes died (killed, crashed): read
        from ``/proc`` per call, so a death is seen also while no iteration runs, and at the
        next call after it, whichever role it was. The caller drops them (:meth:`mark_lost`)."""
        if self._procs is None:
            return []
        lost = self._driver.lost
        served = self._driver.num_served
        return sorted({i for _, i in self._procs.failures() if i < served and i not in lost})

    def membership_changes(self) -> list[tuple[int, bool]]:
        """``(instance_id, False)`` for each instance found dead and not yet marked lost (a
        restarted one rejoins through :meth:`restart`, not here)."""
        return [(i, False) for i in self.failures()]

    @property
    def lost(self) -> frozenset[int]:
        """Instances marked lost (their engines are gone)."""
        return frozenset(self._driver.lost)

    def restart(self, instance_id: int) -> None:
        """Start fresh engines for a lost instance and configure them for the current pool;
        the next :meth:`reset` serves it again (its old slots are empty for the new pool).
        On one host only: a process group cannot admit new ranks."""
        check_int("instance_id", instance_id, low=0, high=self._num_launched)
        d = self._driver
        if instance_id not in d.lost:
            raise InvalidArgumentError(f"instance_id: {instance_id} is not lost")
        if self.config.separate_hosts:
            raise InvalidArgumentError("instance_id: cannot restart with separate_hosts=True")
        keys = [(role, instance_id) for role in ROLES]
        for key, ep in self._procs.spawn(keys).items():
            d.channel.connect(key, ep)
            self._endpoints[key] = ep
        d.lost.discard(instance_id)
        d.configure(keys, d.layout, d.backend)

    # ---- internals -----------------------------------------------------------------------
    def _layout(self, config) -> Layout:
        return layout_for(pool_config(config), self.config, self._num_launched)

    def _is_alive(self, key: tuple[str, int]) -> bool:
        return self._procs is not None and self._procs.is_alive(key)
