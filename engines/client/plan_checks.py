"""The checks an engine client runs on a plan before binding it, against the geometry of the
cluster it writes into: whoever built the plan (the control plane, a compute process, a
hand-built one), nothing is written unless every instance id names a served, live instance,
every slot lies in ``0..num_slots-1``, and every run fits its segment and the rows bound.
Inside one host the client writes puts and segment copies itself, without an engine in
between to check them, so these checks are the only ones on that path."""

from __future__ import annotations

import numpy as np

from tokenlake import plan_wire
from tokenlake.engines.client.driver import Driver
from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import QueryPlan, TransferPlan


def limits(driver: Driver) -> plan_wire.PlanLimits:
    """What a plan may address: the served instances, the slots and segment of the layout."""
    layout = driver.layout
    if layout is None:
        raise InvalidArgumentError("plan: the cluster is not configured yet")
    blocks = driver.tier.num_blocks if driver.tier is not None else 0
    return plan_wire.PlanLimits(driver.num_served, layout.num_slots, layout.segment_len, blocks)


def _check_live(name: str, ids: np.ndarray, driver: Driver) -> None:
    lost = sorted(set(ids.tolist()) & driver.lost)
    if lost:
        live = sorted(set(range(driver.num_served)) - driver.lost)
        raise InvalidArgumentError(
            f"{name}: instance {lost[0]} is lost; allowed: the live instances {live}"
        )


def check_transfer(plan: TransferPlan, driver: Driver) -> None:
    """Every field of ``plan`` within the cluster's geometry (:class:`InvalidArgumentError`
    naming the field, its value and what is allowed, otherwise)."""
    plan_wire.check_transfer_plan("transfer_plan", plan, limits(driver))
    for field in ("dst_ids", "copy_src_instance", "copy_dst_instance", "demote_src_instance",
                  "load_dst_instance"):  # fmt: skip
        _check_live(f"transfer_plan.{field}", getattr(plan, field), driver)


def check_query(plan: QueryPlan, driver: Driver) -> None:
    """Every field of ``plan`` within the cluster's geometry, its holders live."""
    plan_wire.check_query_plan("query_plan", plan, limits(driver))
    _check_live("query_plan.holder_ids", plan.holder_ids, driver)
