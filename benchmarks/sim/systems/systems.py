"""The simulated systems' names: the base systems, and variants appended to a name (each
advantage shown on its own, ``router-tbt-cascade``)."""

from __future__ import annotations

SYSTEMS = (
    "tokenlake",
    "tokenlake-1p3d",
    "tokenlake-3p1d",
    "router",
    "mooncake-1p3d",
    "mooncake-3p1d",
)
# accepted but not run by default: TokenLake with one cluster-wide iteration at a time (the
# model before asynchronous iterations), for side-by-side comparisons
EXTRA_SYSTEMS = ("tokenlake-sync",)
# variants, appended to a system's name in any order (each advantage shown on its own):
# TokenLake without its shared-page groups; the router with TBT-aware chunks, with the
# successor gateway's least-loaded rule; the baselines with vLLM V1's cascade decode; Mooncake
# without its DRAM store (its cache the prefill GPUs only)
VARIANTS = {"tokenlake": ("no-groups",), "router": ("tbt", "min-load", "cascade")}
VARIANTS["mooncake"] = ("tbt", "cascade", "no-store")
VARIANT_SYSTEMS = (
    "tokenlake-no-groups",
    "router-tbt",
    "router-min-load",
    "router-cascade",
    "router-tbt-cascade",
    "mooncake-1p3d-cascade",
    "mooncake-3p1d-cascade",
    "mooncake-1p3d-no-store",
    "mooncake-3p1d-no-store",
)


def split_system(name: str) -> tuple[str, frozenset[str]]:
    """(base system, variants) of a system name such as ``router-tbt-cascade``; ValueError
    naming what is allowed when it is not one."""
    bases = sorted(SYSTEMS + EXTRA_SYSTEMS, key=len, reverse=True)
    base = next((b for b in bases if name == b or name.startswith(b + "-")), None)
    if base is None:
        raise ValueError(f"system: unknown {name!r}; expected one of {SYSTEMS + EXTRA_SYSTEMS}")
    allowed = VARIANTS.get(base.split("-")[0], ())
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
