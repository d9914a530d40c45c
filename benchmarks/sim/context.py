"""What every simulated system is built with: one context instead of the same five leading
constructor arguments in each (:class:`~.systems.tokenlake_system.TokenLakeSystem`,
:class:`~.systems.router.RouterSystem`, :class:`~.systems.mooncake.MooncakeSystem`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenlake.benchmarks.sim.events import EventLoop
from tokenlake.benchmarks.sim.job import Job
from tokenlake.benchmarks.sim.metrics import LoadTimeline
from tokenlake.benchmarks.sim.step_timer import ClusterSpec


@dataclass(frozen=True)
class SimContext:
    """``loop``: the event loop; ``timer``: step prices (a ``CostModelTimer`` or any timer
    with its methods); ``spec``: the cluster; ``load``: the per-instance load timeline;
    ``on_finished(job, t)`` / ``on_rejected(job, t, why)``: the run's callbacks."""

    loop: EventLoop
    timer: Any
    spec: ClusterSpec
    load: LoadTimeline
    on_finished: Callable[[Job, float], None]
    on_rejected: Callable[[Job, float, str], None] | None = None
