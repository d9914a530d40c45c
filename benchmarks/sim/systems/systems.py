"""The simulated systems' names: the base systems, a fixed prefill:decode split
(``mooncake-2p2d``), and variants appended to a name (each advantage shown on its own,
``router-tbt-cascade``).

``mooncake`` without a split is Mooncake at its best split: the harness sweeps every split
of the cluster (1PnD to nP1D) as one of its knobs. A split in a name keeps its ratio at any
cluster size (``mooncake-1p3d`` is 2P6D on 8 instances, as the paper scales it).
"""

from __future__ import annotations

import re

# the default --systems: TokenLake (elastic and its fixed splits) and every baseline with each
# of its tuned variants, so a default run compares against the best baseline
SYSTEMS = (
    "tokenlake",
    "tokenlake-1p3d",
    "tokenlake-3p1d",
    "router",
    "router-tbt",
    "router-min-load",
    "router-tbt-min-load",
    "mooncake",
    "mooncake-tbt",
)
# accepted but not run by default: TokenLake with one cluster-wide iteration at a time (the
# model before asynchronous iterations), for side-by-side comparisons
EXTRA_SYSTEMS = ("tokenlake-sync",)
BASES = ("tokenlake-sync", "tokenlake", "router", "mooncake")  # longest prefix first
SPLIT_BASES = ("tokenlake", "mooncake")  # take a ``-XpYd`` split
_SPLIT = re.compile(r"-(\d+)p(\d+)d")
# variants, appended to a system's name in any order (each advantage shown on its own):
# TokenLake without its shared-page groups, TokenLake with a host tier below its pool (sized
# and priced as Mooncake's store, :mod:`.tokenlake_tier`); the router with TBT-aware chunks, with the
# successor gateway's least-loaded rule; the baselines with vLLM V1's cascade decode; Mooncake
# without its DRAM store (its cache the prefill GPUs only)
VARIANTS = {
    "tokenlake": ("no-groups", "tier"),
    "router": ("tbt", "min-load", "cascade"),
    "mooncake": ("tbt", "cascade", "no-store"),
}
VARIANT_SYSTEMS = (
    "tokenlake-no-groups",
    "tokenlake-tier",
    "router-cascade",
    "router-tbt-cascade",
    "mooncake-2p2d",
    "mooncake-1p3d",
    "mooncake-3p1d",
    "mooncake-cascade",
    "mooncake-no-store",
)


def split_system(name: str) -> tuple[str, frozenset[str]]:
    """(base system, variants) of a system name such as ``router-tbt-cascade`` (the base of
    ``mooncake-1p3d-tbt`` is ``mooncake-1p3d``); ValueError naming what is allowed when it
    is not one."""
    family = next((b for b in BASES if name == b or name.startswith(b + "-")), None)
    if family is None:
        raise ValueError(
            f"system: unknown {name!r}; expected one of {BASES}, a split of {SPLIT_BASES} "
            "such as mooncake-2p2d, and variants"
        )
    base = family
    split = _SPLIT.match(name, len(family)) if family in SPLIT_BASES else None
    if split is not None:
        if int(split[1]) < 1 or int(split[2]) < 1:
            raise ValueError(f"system {name!r}: a split needs P, D >= 1, got {split[0][1:]!r}")
        base = name[: split.end()]
    allowed = VARIANTS.get(family.split("-")[0], ())
    rest, found = name[len(base) :], set()
    while rest:
        v = next((v for v in allowed if rest.startswith("-" + v) and v not in found), None)
        if v is None or (rest[len(v) + 1 :] and not rest[len(v) + 1 :].startswith("-")):
            raise ValueError(
                f"system {name!r}: unknown variant {rest!r} of {base!r}; allowed: {allowed}"
            )
        found.add(v)
        rest = rest[len(v) + 1 :]
    return base, frozenset(found)


def split_of(base: str) -> tuple[int, int] | None:
    """(P, D) named by a base such as ``mooncake-1p3d``; None without a split."""
    m = _SPLIT.search(base)
    return (int(m[1]), int(m[2])) if m else None


def num_prefill(base: str, num_instances: int, split: tuple[int, int] | None = None) -> int:
    """Prefill instances of ``base`` on ``num_instances``: ``split`` (P, D) when given (P + D
    must be the cluster), else the name's ratio scaled to the cluster (at least one of each),
    else half the cluster for ``mooncake`` and 0 (no fixed roles) for the others."""
    if split is not None:
        p, d = split
        if p < 1 or d < 1 or p + d != num_instances:
            raise ValueError(
                f"split: expected P, D >= 1 with P + D = {num_instances} instances, got {p}P{d}D"
            )
        return p
    ratio = split_of(base)
    if ratio is not None:
        p, d = ratio
        return min(num_instances - 1, max(1, round(num_instances * p / (p + d))))
    return num_instances // 2 if base == "mooncake" else 0


def every_split(num_instances: int) -> list[tuple[int, int]]:
    """Every prefill:decode split of a cluster, 1P(n-1)D to (n-1)P1D."""
    return [(p, num_instances - p) for p in range(1, num_instances)]
