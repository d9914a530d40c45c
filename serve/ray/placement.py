"""Where a launch's instances go on a Ray cluster: the nodes chosen for a
:class:`~tokenlake.serve.ray.config.LaunchLayout`, one placement group per instance
(its bundles ``STRICT_PACK``ed on its node), and tasks pinned to a node (the secret file,
cleanup of shared memory).

Each instance's placement group is pinned to the node the layout assigns it (a bundle
label selector on the node id): placement is exactly what was asked, and an instance whose
node is lost stays lost instead of silently moving to a node whose memory others cannot map.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tokenlake.errors import InvalidArgumentError
from tokenlake.serve.ray import buffers as ray_buffers
from tokenlake.serve.ray.config import LaunchLayout

log = logging.getLogger(__name__)
NODE_ID_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class NodeInfo:
    """An alive Ray node: its id, address and total resources."""

    node_id: str
    address: str
    resources: dict

    def fits(self, layout: LaunchLayout) -> bool:
        r = self.resources
        return (
            r.get("CPU", 0.0) >= layout.cpus_per_instance
            and r.get("GPU", 0.0) >= layout.gpus_per_instance
        )


def alive_nodes() -> list[NodeInfo]:
    """Every alive node of the connected cluster, this process's node first, then by id."""
    here = ray.get_runtime_context().get_node_id()
    nodes = [
        NodeInfo(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources", {})))
        for n in ray.nodes()
        if n.get("Alive")
    ]
    return sorted(nodes, key=lambda n: (n.node_id != here, n.node_id))


def choose_nodes(layout: LaunchLayout, nodes: list[NodeInfo]) -> list[NodeInfo]:
    """The nodes a launch uses, in order: those holding ``layout.node_resources`` (one per
    name), else the first ``layout.num_nodes`` that fit an instance (all of them for 0)."""
    if layout.node_resources:
        chosen = []
        for name in layout.node_resources:
            found = [n for n in nodes if n.resources.get(name, 0) > 0 and n not in chosen]
            if not found:
                raise InvalidArgumentError(f"nodes: no alive node has the resource {name!r}")
            if not found[0].fits(layout):
                raise InvalidArgumentError(
                    f"nodes: node {found[0].node_id[:12]} ({name}) has {found[0].resources} "
                    f"and cannot hold an instance ({layout.bundles()})"
                )
            chosen.append(found[0])
        return chosen
    fitting = [n for n in nodes if n.fits(layout)]
    if layout.num_nodes > len(fitting):
        raise InvalidArgumentError(
            f"nodes: asked for {layout.num_nodes}, the cluster has {len(fitting)} alive nodes "
            f"with {layout.cpus_per_instance:g} CPUs and {layout.gpus_per_instance} GPUs free"
        )
    return fitting[: layout.num_nodes] if layout.num_nodes else fitting


@dataclass(frozen=True)
class Placement:
    """Instance ``i`` runs in ``groups[i]`` on node ``node_ids[i]``."""

    groups: tuple  # ray PlacementGroup per instance
    node_ids: tuple[str, ...]

    @property
    def num_instances(self) -> int:
        return len(self.groups)

    @property
    def nodes(self) -> tuple[str, ...]:
        """The distinct nodes, in first-use order."""
        return tuple(dict.fromkeys(self.node_ids))


def place(
    layout: LaunchLayout,
    launch_id: str,
    nodes: list[NodeInfo],
    detached: bool,
    timeout_s: float,
) -> Placement:
    """Create one ``STRICT_PACK`` placement group per instance on its assigned node and wait
    until all are ready (at most ``timeout_s``); on failure removes the ones created."""
    assignment = layout.assign(len(nodes))
    bundles = layout.bundles()
    groups = []
    try:
        for i, k in enumerate(assignment):
            groups.append(
                placement_group(
                    bundles,
                    strategy="STRICT_PACK",
                    name=f"tokenlake-{launch_id}-instance{i}",
                    lifetime="detached" if detached else None,
                    bundle_label_selector=[{NODE_ID_LABEL: nodes[k].node_id}] * len(bundles),
                )
            )
        deadline = time.monotonic() + timeout_s
        for i, pg in enumerate(groups):
            left = max(0.1, deadline - time.monotonic())
            ready, _ = ray.wait([pg.ready()], timeout=left)
            if not ready:
                raise InvalidArgumentError(
                    f"placement: instance {i} ({bundles}) found no room on node "
                    f"{nodes[assignment[i]].node_id[:12]} within {timeout_s:g} s"
                )
    except BaseException:
        for pg in groups:
            remove_placement_group(pg)
        raise
    return Placement(tuple(groups), tuple(nodes[k].node_id for k in assignment))


def remove(placement: Placement | None) -> None:
    if placement is None:
        return
    for pg in placement.groups:
        try:
            remove_placement_group(pg)
        except Exception:  # already gone (a detached launch stopped twice)
            log.debug("placement group already removed", exc_info=True)


def on_node(node_id: str):
    """Scheduling options that run a task or actor on ``node_id`` only."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


@ray.remote(num_cpus=0)
def _write_secret(launch_id: str, key: bytes) -> str:
    return ray_buffers.write_secret(launch_id, key)


@ray.remote(num_cpus=0)
def _remove_files(launch_id: str) -> list[str]:
    return ray_buffers.remove_launch_files(launch_id)


def write_secrets(node_ids, launch_id: str, key: bytes, timeout_s: float) -> dict[str, str]:
    """The cluster secret written to a 0600 file on every node; returns each node's path."""
    refs = {n: _write_secret.options(**on_node(n)).remote(launch_id, key) for n in node_ids}
    return dict(zip(refs, ray.get(list(refs.values()), timeout=timeout_s), strict=True))


def remove_files(node_ids, launch_id: str, timeout_s: float) -> list[str]:
    """Remove the launch's shared memory and secret files on every node still alive."""
    alive = {n.node_id for n in alive_nodes()}
    refs = [_remove_files.options(**on_node(n)).remote(launch_id) for n in node_ids if n in alive]
    removed = []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        try:
            removed += ray.get(ref)
        except Exception:  # a node lost meanwhile: its memory went with it
            log.warning("launch cleanup failed on a node", exc_info=True)
    return removed
