"""The elastic scheduler (docs/architecture.md#the-floors, paper §6): a client of the pool that decides batches and
degrees of parallelism each iteration and never manages cache placement.

Modules: :mod:`.config` (``SchedulerConfig``), :mod:`.request` (lifecycle), :mod:`.policy`
(pure decisions), :mod:`.lanes` (asynchronous decode lanes), :mod:`.memory` (admission and
preemption), :mod:`.deciding` (requests → planned batches), :mod:`.dp` / :mod:`.dp_reference`
(the §6.2 DP, C++ and Python),
:mod:`.latency_model` (fitted ``T(batch, k)``), :mod:`.cost_model` (roofline for simulated
hardware), :mod:`.profiler` (measured rows on a CPU engine), :mod:`.scheduler` (the facade).
"""

from tokenlake.scheduler.config import COLOCATED, ELASTIC, MODES, XPYD, SchedulerConfig
from tokenlake.scheduler.cost_model import CostModel
from tokenlake.scheduler.dp import DPProblem, DPResult, solve
from tokenlake.scheduler.dp_reference import solve_reference
from tokenlake.scheduler.latency_model import (
    DECODE,
    PREFILL,
    Coeffs,
    LatencyModel,
    ProfileRow,
    fit_coeffs,
    fit_latency_model,
)
from tokenlake.scheduler.planned import IterationPlan
from tokenlake.scheduler.policy import (
    MIXED,
    Decision,
    InstanceLimits,
    WorkItem,
    build_problem,
    plan_batches,
    select_work,
)
from tokenlake.scheduler.profiler import default_cases, measure_hop_seconds, measure_rows
from tokenlake.scheduler.request import Phase, Request, chunk_end
from tokenlake.scheduler.scheduler import ElasticScheduler

__all__ = [
    "COLOCATED",
    "DECODE",
    "ELASTIC",
    "MIXED",
    "MODES",
    "PREFILL",
    "XPYD",
    "Coeffs",
    "CostModel",
    "DPProblem",
    "DPResult",
    "Decision",
    "ElasticScheduler",
    "InstanceLimits",
    "IterationPlan",
    "LatencyModel",
    "Phase",
    "ProfileRow",
    "Request",
    "SchedulerConfig",
    "WorkItem",
    "build_problem",
    "chunk_end",
    "default_cases",
    "fit_coeffs",
    "fit_latency_model",
    "measure_hop_seconds",
    "measure_rows",
    "plan_batches",
    "select_work",
    "solve",
    "solve_reference",
]

if __name__ != "tokenlake.scheduler":  # one import name per module (docs/architecture.md, "Layout")
    raise ImportError(
        f"the folder scheduler/ is the package tokenlake.scheduler: import tokenlake.scheduler, not {__name__}"
    )
