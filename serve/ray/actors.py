"""The Ray actors of one instance: its compute engine, query engine and transfer engine, one
process each, every one running the data plane's own entry point
(:func:`tokenlake.engines.clusters.compute_worker.main`, :func:`tokenlake.engines.clusters.engine_process.main`)
with a spec built inside the actor from a :class:`ProcessRecipe` — the buffers of the
instances on its node are mapped there (:mod:`.ray_buffers`) and every socket binds to the
node's cluster address.

``serve`` blocks for the process's whole life (a second actor thread answers ``ping``), so
its object reference fails the moment the process dies: the driver's death signal besides
the dropped connections it watches. Ray restarts a dead actor (``max_restarts``); the driver
then calls ``serve`` again with a new group generation, and the instance rejoins empty.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import ray

from tokenlake.serve.ray import buffers as ray_buffers

ROLES = ("compute", "query", "transfer")


@dataclass(frozen=True)
class ProcessRecipe:
    """What every process of a launch is started with; per-process parts (its instance,
    role, node address, buffers) are filled in inside the actor.

    ``hosts[i]`` is the node of instance ``i`` (instances on one node share memory unless
    ``config.separate_hosts``); ``secret_paths[node]`` the node's 0600 secret file;
    ``group`` the point-to-point group (``None`` when every instance shares one node);
    ``endpoints`` every engine's socket (compute processes connect to them);
    ``addresses[node]`` the node's cluster address (every socket of the node binds there).
    """

    config: object  # DataPlaneConfig
    layout: object  # Layout
    backend: str | None
    hosts: tuple[str, ...]
    secret_paths: dict
    ready_endpoint: str
    group: object | None  # GroupSpec
    endpoints: dict
    lost: frozenset
    make_program: object  # picklable factory of the compute program
    addresses: dict

    def local_instances(self, instance_id: int) -> list[int]:
        """Instances whose buffers a process of ``instance_id`` maps."""
        if self.config.separate_hosts:
            return [instance_id]
        return [j for j, h in enumerate(self.hosts) if h == self.hosts[instance_id]]


@ray.remote(max_concurrency=2)
class InstanceActor:
    """One process of instance ``instance_id``: ``role`` is ``"compute"``, ``"query"`` or
    ``"transfer"``."""

    def __init__(self, role: str, instance_id: int, launch_id: str, recipe: ProcessRecipe):
        if role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
        self.role, self.instance_id, self.launch_id = role, instance_id, launch_id
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = recipe.addresses[self.node_id]
        nbytes = recipe.layout.nbytes()
        self.buffers = {
            j: ray_buffers.map_instance(ray_buffers.buffer_path(launch_id, j), nbytes)
            for j in recipe.local_instances(instance_id)
        }

    def ping(self) -> dict:
        return {"pid": os.getpid(), "node_id": self.node_id, "node_ip": self.node_ip}

    def serve(self, recipe: ProcessRecipe) -> None:
        """Run this process's engine until it is stopped (blocks; ends the process)."""
        from tokenlake.engines.transport.peers import LauncherId

        config = replace(recipe.config, host=self.node_ip)
        group = replace(recipe.group, host=self.node_ip) if recipe.group is not None else None
        secret_path = recipe.secret_paths[self.node_id]
        me = LauncherId.this_process()  # Ray ends this process; nothing else launched it
        if self.role == "compute":
            from tokenlake.engines.clusters import compute_worker

            n = recipe.layout.num_instances
            spec = compute_worker.ComputeSpec(
                (self.instance_id,), config, recipe.layout, recipe.backend,
                tuple(self.buffers.get(j) for j in range(n)), dict(recipe.endpoints),
                frozenset(recipe.lost), secret_path, recipe.make_program,
                recipe.ready_endpoint, me, group=group, hosts=recipe.hosts,
            )  # fmt: skip
            compute_worker.main(spec)
            return
        from tokenlake.engines.clusters import engine_process
        from tokenlake.engines.core.engine_base import EngineHost

        host = EngineHost(
            self.instance_id, recipe.layout.num_instances, dict(self.buffers), config.timeout_s,
            group.backend if group is not None else "gloo",
        )  # fmt: skip
        spec = engine_process.EngineSpec(
            self.role, host, secret_path, recipe.ready_endpoint, self.node_ip, me,
            config.kernel_threads, group,
        )  # fmt: skip
        engine_process.main(spec)
