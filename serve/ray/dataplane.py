"""The driver's side of a launch's data plane: the instances' actors (three per instance, in
the instance's placement group), their authenticated sockets, the point-to-point group, and
membership — a dead process is noticed, its instance marked lost, and the instance rejoins
empty once Ray has restarted its actors.

Start-up: the actors are created, the engines report their sockets, the compute processes
get every engine's, all of them and this process join the group (:mod:`.ray_rendezvous`).

Death is seen two ways: the connection this process keeps to every process drops at once
when the process dies (:class:`~tokenlake.engines.transport.peers.LinkMonitor`), and the actor's
``serve`` call fails when Ray notices (also a lost node). A lost instance's other processes
are killed too, so its three actors restart together; rejoining forms a new generation of
the group (``Regroup``) with every live process.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import ray
import zmq
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenlake import wire
from tokenlake.engines.client.driver import Driver
from tokenlake.engines.clusters import compute_process
from tokenlake.engines.core.shared_buffers import Layout
from tokenlake.engines.dataplane_config import DataPlaneConfig, PeerFailedError, RemoteEngineError
from tokenlake.engines.transport import messages, process_group
from tokenlake.engines.transport.auth import ClusterSecret, FrameAuth
from tokenlake.engines.transport.peers import LinkMonitor
from tokenlake.engines.transport.sockets import Requester
from tokenlake.serve.ray.actors import ROLES, InstanceActor, ProcessRecipe
from tokenlake.serve.ray.rendezvous import GroupJoiner, ReadyInbox, error_of, regroup_message

log = logging.getLogger(__name__)
ENGINE_ROLES = ("query", "transfer")


@dataclass(frozen=True)
class DataPlaneSetup:
    """What the driver starts: instance ``i`` in placement group ``groups[i]`` on node
    ``hosts[i]``; ``config.host`` is the driver node's address."""

    launch_id: str
    groups: tuple
    hosts: tuple[str, ...]
    secret_path: str  # this node's
    secret_paths: dict
    layout: Layout
    config: DataPlaneConfig
    backend: str | None
    make_program: object
    addresses: dict  # node id -> the node's cluster address
    max_restarts: int
    cpus_per_instance: float
    gpus_per_instance: int
    step_timeout_s: float


class RayDataPlane:
    """Owns the instances' actors and the sockets to them; every method runs on one thread
    (the serving runtime's)."""

    def __init__(self, setup: DataPlaneSetup) -> None:
        self.setup = setup
        self.num_instances = len(setup.hosts)
        self.lost: set[int] = set()
        self.dead_for_good: set[int] = set()
        self.lost_at: dict[int, float] = {}
        self.pids: dict[tuple[str, int], int] = {}
        self.nodes: dict[tuple[str, int], str] = {}  # each process's node, as Ray placed it
        self.actors: dict[tuple[str, int], object] = {}
        self._serving: dict[tuple[str, int], object] = {}  # serve() refs: fail on death
        self._pings: dict[int, list] = {}
        self._endpoint_of: dict[tuple[str, int], str] = {}
        self._ctx = zmq.Context()
        secret = ClusterSecret.from_file(setup.secret_path)
        self._auth = FrameAuth(secret)
        self._secret = secret
        self._store = self._group = None
        self._generation = 0
        self._closed = False
        self.monitor = LinkMonitor(self._ctx, self._auth)
        cfg = setup.config
        self.engines = Requester(
            self._ctx, cfg.timeout_s, cfg.poll_interval_s, self._alive, self._auth
        )
        self.compute = Requester(
            self._ctx, setup.step_timeout_s, cfg.poll_interval_s, self._alive, self._auth
        )
        self._ready = ReadyInbox(self._ctx, cfg.host, self._auth)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # ---- start-up -------------------------------------------------------------------------
    @property
    def group_spec(self):
        if self._store is None:
            return None
        cfg = self.setup.config
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        return process_group.GroupSpec(
            backend, cfg.host, self._store.endpoint, self.num_instances, cfg.startup_timeout_s,
            compute_clients=True, generation=self._generation,
        )  # fmt: skip

    def _recipe(self, endpoints: dict) -> ProcessRecipe:
        s = self.setup
        return ProcessRecipe(
            s.config, s.layout, s.backend, s.hosts, dict(s.secret_paths), self._ready.endpoint,
            self.group_spec, endpoints, frozenset(self.lost), s.make_program, dict(s.addresses),
        )  # fmt: skip

    def _start(self) -> None:
        s = self.setup
        if s.config.separate_hosts or len(set(s.hosts)) > 1:
            from tokenlake.engines.transport.auth_store import StoreServer

            self._store = StoreServer(self._secret, s.config.host)
        recipe = self._recipe({})
        for i in range(self.num_instances):
            for role in ROLES:
                self.actors[(role, i)] = self._create(role, i, recipe)
        self._bring_up(list(range(self.num_instances)), regroup=False)

    def _create(self, role: str, i: int, recipe: ProcessRecipe):
        s = self.setup
        share = {"num_cpus": s.cpus_per_instance / len(ROLES)}
        if s.gpus_per_instance:  # co-processes on the instance's first GPU (MPS; not run here)
            share["num_gpus"] = 1.0 / len(ROLES)
        return InstanceActor.options(
            name=f"tokenlake-{s.launch_id}-{role}{i}",
            max_restarts=s.max_restarts,
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(s.groups[i], 0),
            **share,
        ).remote(role, i, s.launch_id, recipe)

    def _bring_up(self, instances: list[int], regroup: bool) -> None:
        """Serve ``instances``' processes, collect their sockets, join (or re-form) the
        group with them, configure their engines. Bounded by the start-up timeout."""
        cfg = self.setup.config
        deadline = time.monotonic() + cfg.startup_timeout_s
        for i in instances:
            pings = [self.actors[(role, i)].ping.remote() for role in ROLES]
            infos = ray.get(pings, timeout=cfg.startup_timeout_s)
            for role, info in zip(ROLES, infos, strict=True):
                self.pids[(role, i)] = info["pid"]
                self.nodes[(role, i)] = info["node_id"]
        recipe = self._recipe({})
        keys = [(role, i) for i in instances for role in ENGINE_ROLES]
        for key in keys:
            self._serving[key] = self.actors[key].serve.remote(recipe)
        endpoints = self._ready.collect(keys, self._serving, deadline)
        everything = {**self.endpoints, **endpoints}
        recipe = self._recipe(everything)
        for i in instances:
            self._serving[("compute", i)] = self.actors[("compute", i)].serve.remote(recipe)
        joiner = GroupJoiner(self.group_spec, self._secret) if self._store is not None else None
        tickets = []
        if regroup:  # every live process of the others re-forms the group with them
            for key in self._live_keys():
                if key[1] in instances:
                    continue
                channel = self._channel(key)
                tickets.append((channel, channel.request(key, lambda seq: regroup_message(
                    seq, self._generation, endpoints, instances))))  # fmt: skip
        compute = self._ready.collect([("compute", i) for i in instances], self._serving, deadline)
        for channel, ticket in tickets:
            channel.wait([ticket], "regroup")
        if joiner is not None:
            joiner.join(max(0.1, deadline - time.monotonic()))
            if joiner.error is not None or joiner.group is None:
                raise PeerFailedError(instances[0], "compute", f"group: {joiner.error}")
            old, self._group = self._group, joiner.group
            process_group.shutdown(old)
        for key, ep in {**endpoints, **compute}.items():
            channel = self._channel(key)
            channel.connect(key, ep)
            self.monitor.watch(key, ep)
            self._endpoint_of[key] = ep
        Driver(cfg, self.num_instances, self.engines).configure(
            keys, self.setup.layout, self.setup.backend
        )

    @property
    def endpoints(self) -> dict[tuple[str, int], str]:
        """Every live process's socket by ``(role, instance_id)`` (bound to its node's cluster
        address)."""
        return {k: ep for k, ep in self._endpoint_of.items() if k[1] not in self.lost}

    def _channel(self, key) -> Requester:
        return self.compute if key[0] == "compute" else self.engines

    # ---- iterations -----------------------------------------------------------------------
    def run_step(self, plans, chunks) -> list:
        """Send every compute process its sub-batches of ``plans`` (a batch runs on the
        process of its instance) and return each process's decoded result, by instance
        (``None`` without work). A dead process raises :class:`PeerFailedError` naming its
        instance, also when it made a peer fail first."""
        owner = {i: i for i in range(self.num_instances)}
        try:
            return compute_process.run_steps(self.compute, plans, chunks, owner, self.num_instances)
        except (PeerFailedError, RemoteEngineError) as e:
            dead = self.failures()
            if dead:
                raise PeerFailedError(dead[0], "instance", f"died during iteration: {e}") from e
            raise

    def retire(self, epoch: int) -> None:
        """Tell every live compute process the control plane committed or aborted ``epoch``
        (a dead one is reported by :meth:`failures` instead)."""
        keys = [("compute", i) for i in range(self.num_instances) if i not in self.lost]
        tickets = [self.compute.request(k, lambda seq: messages.Retire(seq, epoch)) for k in keys]
        try:
            self.compute.wait(tickets, f"retire {epoch}")
        except PeerFailedError:
            log.warning("retire %d: a compute process is gone", epoch)

    def engine_stats(self) -> dict[tuple[str, int], dict[str, int]]:
        """Every live process's counters by ``(role, instance_id)`` (engines: calls, bytes,
        errors, rejected and unauthenticated frames; compute processes: their clients'),
        plus this process's sockets' under ``("client", -1)`` — for ``/metrics``."""
        keys = [k for k in self._live_keys() if self.monitor.is_alive(k)]
        channels = [self._channel(k) for k in keys]
        tickets = [c.request(k, messages.Stats) for c, k in zip(channels, keys, strict=True)]
        out = {}
        for key, channel, ticket in zip(keys, channels, tickets, strict=True):
            (payload,) = channel.wait([ticket], "stats")
            out[key] = wire.unpackb(payload, 1 << 20)
        out[("client", -1)] = dict(self.engines.stats + self.compute.stats)
        return out

    # ---- membership -----------------------------------------------------------------------
    def _live_keys(self) -> list:
        return [k for k in self.actors if k[1] not in self.lost]

    def _alive(self, key) -> bool:
        return key[1] not in self.lost and self.monitor.is_alive(key)

    def failures(self) -> list[int]:
        """Live instances one of whose processes is gone (connection dropped, or Ray says
        the actor died), in order of instance id."""
        dead = set()
        for key in self._live_keys():
            if not self.monitor.is_alive(key):
                dead.add(key[1])
        refs = {ref: key for key, ref in self._serving.items() if key[1] not in self.lost}
        if refs:
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            dead.update(refs[r][1] for r in done)
        return sorted(dead)

    def mark_lost(self, instance_id: int) -> None:
        """Stop using an instance; its surviving processes are killed so that Ray restarts
        all three, and the other processes finish what the failure left in flight."""
        if instance_id in self.lost:
            return
        self.lost.add(instance_id)
        self.lost_at[instance_id] = time.time()
        for role in ROLES:
            key = (role, instance_id)
            channel = self._channel(key)
            channel.disconnect(key)
            running = self.monitor.is_alive(key)
            self.monitor.forget(key)
            ref = self._serving.pop(key, None)
            if running and ref is not None and not ray.wait([ref], timeout=0)[0]:
                with contextlib.suppress(Exception):  # restarted by Ray with the others
                    ray.kill(self.actors[key], no_restart=False)
        self._pings.pop(instance_id, None)
        self._barrier()

    def _barrier(self) -> None:
        """Wait until every live process answered what it was sent before (a process that
        waited for the dead one ends that wait at its own timeout)."""
        for _ in range(3):
            pending = []
            for key in self._live_keys():
                channel = self._channel(key)
                pending.append((channel, channel.request(key, messages.Stats)))
            try:
                for channel, ticket in pending:
                    channel.wait([ticket], "barrier after a failure")
                return
            except PeerFailedError as e:
                if not self.monitor.is_alive((e.role, e.instance_id)):
                    return  # another death: the caller sees it in failures()
        log.warning("barrier: a live process did not answer after a failure")

    def rejoined(self) -> list[int]:
        """Lost instances whose three actors Ray has restarted, brought back empty (returns
        their ids; the control plane restores them). Instances Ray gave up on stay lost."""
        back = []
        for i in sorted(self.lost - self.dead_for_good):
            pings = self._pings.setdefault(
                i, [self.actors[(role, i)].ping.remote() for role in ROLES]
            )
            done, _ = ray.wait(pings, num_returns=len(pings), timeout=0)
            if len(done) < len(pings):
                continue
            errors = [error_of(r) for r in pings]
            del self._pings[i]
            if any(isinstance(e, ray.exceptions.ActorDiedError) for e in errors):
                log.error("instance %d: Ray will not restart it (max_restarts spent)", i)
                self.dead_for_good.add(i)
                continue
            if any(e is not None for e in errors):
                continue  # still restarting: ping again next time
            self._generation += 1
            self.lost.discard(i)
            try:
                self._bring_up([i], regroup=True)
            except Exception:
                log.exception("instance %d: rejoining failed", i)
                self.mark_lost(i)
                continue
            log.info("instance %d rejoined (group generation %d)", i, self._generation)
            back.append(i)
        return back

    # ---- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every actor (no restarts), release sockets, the group and the store."""
        if self._closed:
            return
        self._closed = True
        for actor in self.actors.values():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        for channel in (self.engines, self.compute):
            channel.close()
        self.monitor.close()
        process_group.shutdown(self._group)
        if self._store is not None:
            self._store.close()
        self._ready.close()
        self._ctx.destroy(linger=0)
