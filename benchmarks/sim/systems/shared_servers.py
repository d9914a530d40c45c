"""The servers TokenLake's iterations share in the simulator: a :class:`Flight` (one
iteration in flight), a device under processor sharing (:class:`SharedGPU`) and a CPU host
whose cores several executors share (:class:`SharedHost`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

_EPS = 1e-12


@dataclass(eq=False)
class Flight:
    """One iteration in flight: the predicted end of its work on each server (instances,
    then links), when its bytes are on the wire, what it read per instance (KV tokens, for
    the load timeline), each origin's idle wait for remote parts after its own work
    (``stall``) and the control plane's time before it started (``delay``)."""

    payload: object
    start: float
    net_end: float
    reads: np.ndarray
    work_end: dict[int, float] = field(default_factory=dict)
    version: int = 0  # bumped whenever the end moves (stale completion events are skipped)
    id: int = field(default_factory=itertools.count().__next__)
    stall: dict[int, float] = field(default_factory=dict)
    delay: float = 0.0
    owner: object = None  # the system that completes it (a shared host moves others' flights)

    @property
    def end(self) -> float:
        end = max(max(self.work_end.values(), default=self.start), self.net_end)
        for origin, wait in self.stall.items():
            end = max(end, self.work_end.get(origin, self.start) + wait)
        return float(end + self.delay)


class SharedGPU:
    """Work on one instance under processor sharing: ``tasks[flight] = remaining seconds``
    (at full speed), every task served at ``1/len(tasks)`` of the GPU."""

    def __init__(self) -> None:
        self.tasks: dict[Flight, float] = {}
        self.t = 0.0

    def advance(self, now: float) -> None:
        elapsed, self.t = now - self.t, now
        while elapsed > _EPS and self.tasks:
            k, low = len(self.tasks), min(self.tasks.values())
            step = min(low, elapsed / k)
            self.tasks = {f: r - step for f, r in self.tasks.items() if r - step > _EPS}
            elapsed -= step * k

    def add(self, flight: Flight, work: float) -> None:
        self.tasks[flight] = self.tasks.get(flight, 0.0) + work

    def finishes(self) -> dict[Flight, float]:
        """When each task ends if nothing else arrives (a task leaving speeds up the rest)."""
        out, t, done, prev = {}, self.t, 0, 0.0
        order = sorted(self.tasks.items(), key=lambda fr: fr[1])
        for flight, rem in order:
            t += (rem - prev) * (len(order) - done)
            out[flight], prev, done = t, rem, done + 1
        return out


class SharedHost(SharedGPU):
    """A CPU host: ``cores`` cores shared by the tasks on it, work in seconds of one core;
    a task alone runs ``speedup`` times faster (its threads on several cores), and
    ``background`` busy threads of other programs share the cores all the time: every task
    is served at ``min(speedup, cores / (len(tasks) + background))``. The executors of
    several simulated systems (a router's worker processes) may share one host."""

    def __init__(self, cores: float, speedup: float = 1.0, background: float = 0.0) -> None:
        super().__init__()
        if not cores > 0:
            raise ValueError(f"SharedHost.cores: expected > 0, got {cores!r}")
        if not 1 <= speedup <= cores:
            raise ValueError(f"SharedHost.speedup: expected 1..{cores}, got {speedup!r}")
        if not 0 <= background < float("inf"):
            raise ValueError(f"SharedHost.background: expected >= 0, got {background!r}")
        self.cores, self.speedup, self.background = float(cores), float(speedup), background

    def _rate(self, num_tasks: int) -> float:
        return min(self.speedup, self.cores / (num_tasks + self.background))

    def advance(self, now: float) -> None:
        elapsed, self.t = now - self.t, now
        while elapsed > _EPS and self.tasks:
            rate, low = self._rate(len(self.tasks)), min(self.tasks.values())
            step = min(low, elapsed * rate)  # work done by each task
            self.tasks = {f: r - step for f, r in self.tasks.items() if r - step > _EPS}
            elapsed -= step / rate

    def finishes(self) -> dict[Flight, float]:
        out, t, done, prev = {}, self.t, 0, 0.0
        order = sorted(self.tasks.items(), key=lambda fr: fr[1])
        for flight, rem in order:
            t += (rem - prev) / self._rate(len(order) - done)
            out[flight], prev, done = t, rem, done + 1
        return out


HOST = -1  # a flight's work_end key for its work on a shared host
