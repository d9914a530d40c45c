"""What ``tokenlake launch`` places where: the layout of instances over Ray nodes (from flags
or a small YAML file), frozen and validated before anything is started.

A layout file (every key optional; flags given on the command line win)::

    instances: 4             # TokenLake instances
    gpus_per_instance: 1     # 0: CPU-only instances (a CPU bundle each)
    cpus_per_instance: 1     # CPUs reserved per instance (its three processes share them)
    nodes: 2                 # use this many nodes, or a list of custom resource names
    placement: spread        # spread | pack | strict-spread
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from tokenlake.errors import InvalidArgumentError

PLACEMENTS = ("spread", "pack", "strict-spread")
_RESOURCE_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.:/")


@dataclass(frozen=True)
class LaunchLayout:
    """Instances and where they go.

    Args:
        num_instances: TokenLake instances (ranks ``0..N-1``), one placement group each.
        gpus_per_instance: GPUs of one instance, one bundle per GPU packed on one node
            (``STRICT_PACK``); 0 makes CPU-only instances with one CPU bundle.
        cpus_per_instance: CPUs reserved per instance for its compute, query and transfer
            processes.
        num_nodes: how many of the cluster's nodes to use (0: every node that fits).
        node_resources: use exactly the nodes that have these custom resources, in this
            order (instead of ``num_nodes``); makes placement explicit and observable.
        placement: ``"spread"`` (instance ``i`` on node ``i mod K``), ``"pack"`` (consecutive
            instances share a node: ``i * K // N``) or ``"strict-spread"`` (every instance on
            a node of its own; refused when there are fewer nodes than instances).
    """

    num_instances: int = 2
    gpus_per_instance: int = 0
    cpus_per_instance: float = 1.0
    num_nodes: int = 0
    node_resources: tuple[str, ...] = ()
    placement: str = "spread"

    def __post_init__(self) -> None:
        _check_int("num_instances", self.num_instances, 1)
        _check_int("gpus_per_instance", self.gpus_per_instance, 0)
        _check_int("num_nodes", self.num_nodes, 0)
        c = self.cpus_per_instance
        if isinstance(c, bool) or not isinstance(c, int | float) or not 0 < c <= 4096:
            raise InvalidArgumentError(
                f"cpus_per_instance: expected a number in (0, 4096], got {c!r}"
            )
        object.__setattr__(self, "cpus_per_instance", float(c))
        if not isinstance(self.node_resources, tuple) or not all(
            isinstance(r, str) and r and set(r) <= _RESOURCE_CHARS for r in self.node_resources
        ):
            raise InvalidArgumentError(
                f"node_resources: expected resource names ([A-Za-z0-9_.:/-]), "
                f"got {self.node_resources!r}"
            )
        if len(set(self.node_resources)) != len(self.node_resources):
            raise InvalidArgumentError(f"node_resources: repeated names {self.node_resources!r}")
        if self.node_resources and self.num_nodes:
            raise InvalidArgumentError(
                "nodes: give a node count or a list of node resources, not both"
            )
        if self.placement not in PLACEMENTS:
            raise InvalidArgumentError(
                f"placement: expected one of {PLACEMENTS}, got {self.placement!r}"
            )
        k = len(self.node_resources) or self.num_nodes
        if self.placement == "strict-spread" and k and k < self.num_instances:
            raise InvalidArgumentError(
                f"placement: strict-spread needs a node per instance, got {k} nodes for "
                f"{self.num_instances} instances"
            )

    def bundles(self) -> list[dict[str, float]]:
        """The placement-group bundles of one instance: one per GPU (its share of the
        CPUs alongside), or a single CPU bundle."""
        g = self.gpus_per_instance
        if g == 0:
            return [{"CPU": self.cpus_per_instance}]
        return [{"GPU": 1.0, "CPU": self.cpus_per_instance / g} for _ in range(g)]

    def assign(self, num_nodes: int) -> list[int]:
        """Node index (into the ``num_nodes`` chosen nodes) of every instance."""
        n, k = self.num_instances, num_nodes
        if k < 1:
            raise InvalidArgumentError("nodes: no node of the cluster can hold an instance")
        if self.placement == "strict-spread" and k < n:
            raise InvalidArgumentError(
                f"placement: strict-spread needs {n} nodes, the cluster has {k} that fit"
            )
        if self.placement == "pack":
            return [i * k // n for i in range(n)] if n >= k else list(range(n))
        return [i % k for i in range(n)]


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1 << 20:
        raise InvalidArgumentError(f"{name}: expected an int in [{low}, {1 << 20}], got {value!r}")


def parse_nodes(text: str) -> tuple[int, tuple[str, ...]]:
    """``--nodes``: a count (``"2"``) or comma-separated custom resource names
    (``"node0,node1"``); returns ``(num_nodes, node_resources)``."""
    text = text.strip()
    if text.isdigit():
        return int(text), ()
    names = tuple(s.strip() for s in text.split(","))
    if not text or not all(names):
        raise InvalidArgumentError(
            f"nodes: expected a count or comma-separated resource names, got {text!r}"
        )
    return 0, names


_FILE_KEYS = {
    "instances": "num_instances",
    "gpus_per_instance": "gpus_per_instance",
    "cpus_per_instance": "cpus_per_instance",
    "placement": "placement",
}


def read_layout_file(path: str | Path) -> dict:
    """The layout keys of a YAML file as :class:`LaunchLayout` field values (``nodes`` may be
    a count or a list of resource names). Unknown keys are an error naming them."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InvalidArgumentError(f"layout: cannot read {str(path)!r}: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidArgumentError(f"layout: {str(path)!r} must hold a mapping of keys")
    unknown = sorted(set(map(str, raw)) - set(_FILE_KEYS) - {"nodes"})
    if unknown:
        allowed = sorted([*_FILE_KEYS, "nodes"])
        raise InvalidArgumentError(f"layout: unknown keys {unknown} (allowed: {allowed})")
    out = {_FILE_KEYS[k]: v for k, v in raw.items() if k in _FILE_KEYS}
    nodes = raw.get("nodes")
    if isinstance(nodes, list):
        out["node_resources"] = tuple(nodes)
    elif nodes is not None:
        out["num_nodes"] = nodes
    return out


def layout_from(file_values: dict, overrides: dict) -> LaunchLayout:
    """A layout from a file's values with the command line's explicit values on top."""
    names = {f.name for f in fields(LaunchLayout)}
    values = {k: v for k, v in {**file_values, **overrides}.items() if k in names}
    if "num_nodes" in overrides or "node_resources" in overrides:  # one spelling wins whole
        values["num_nodes"] = overrides.get("num_nodes", 0)
        values["node_resources"] = overrides.get("node_resources", ())
    return LaunchLayout(**values)
