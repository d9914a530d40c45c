"""The wall-clock bench's rate search: each system's P90 goodput by the simulator's bisection
(:func:`tokenlake.benchmarks.sim.metrics.bisect_goodput`), every point a real run; the systems'
searches take turns run by run (one run at a time), so both see the machine in the same state."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence

from tokenlake.benchmarks.sim.metrics import GoodputResult, bisect_goodput

TARGET = 0.9


class TurnTaker:
    """Runs of several named searches, one at a time, the names in rotation; a finished
    search leaves the rotation. ``wait_s`` bounds each wait for a turn."""

    def __init__(self, names: Sequence[str], wait_s: float) -> None:
        self.active = list(names)
        self.turn = 0
        self.wait_s = wait_s
        self.cv = threading.Condition()
        self.cancelled = False

    def run(self, name: str, fn: Callable[[], float]) -> float:
        with self.cv:
            mine = lambda: self.cancelled or self.active[self.turn] == name  # noqa: E731
            if not self.cv.wait_for(mine, self.wait_s):
                raise TimeoutError(f"{name}: no turn within {self.wait_s:g} s")
            if self.cancelled:
                raise RuntimeError(f"{name}: the searches were cancelled")
        try:
            return fn()
        finally:
            with self.cv:
                self.turn = (self.active.index(name) + 1) % len(self.active)
                self.cv.notify_all()

    def cancel(self) -> None:
        """Every later turn raises (another search failed, or Ctrl-C)."""
        with self.cv:
            self.cancelled = True
            self.cv.notify_all()

    def leave(self, name: str) -> None:
        with self.cv:
            i = self.active.index(name)
            current = self.active[self.turn]
            self.active.pop(i)
            if self.active:
                nxt = current if current != name else self.active[i % len(self.active)]
                self.turn = self.active.index(nxt)
            self.cv.notify_all()


def search_all(
    names: Sequence[str],
    attainment_at: Callable[[str, float], float],
    *,
    lo: float,
    hi: float,
    rel_tol: float,
    max_evals: int,
    wait_s: float,
) -> dict[str, GoodputResult]:
    """Each name's goodput search, their runs alternating (``attainment_at(name, rate)``)."""
    turns = TurnTaker(names, wait_s)

    def search(name: str) -> GoodputResult:
        try:
            return bisect_goodput(
                lambda rate: turns.run(name, lambda: attainment_at(name, rate)),
                lo, hi, target=TARGET, rel_tol=rel_tol, max_evals=max_evals,
            )  # fmt: skip
        except BaseException:
            turns.cancel()
            raise
        finally:
            turns.leave(name)

    pool = concurrent.futures.ThreadPoolExecutor(len(names))
    try:
        futures = {name: pool.submit(search, name) for name in names}
        return {name: f.result() for name, f in futures.items()}
    except BaseException:  # Ctrl-C too: no run starts after this; the caller stops processes
        turns.cancel()
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def first_rate_only(names: Sequence[str], attainment_at: Callable[[str, float], float],
                    rate: float) -> dict[str, GoodputResult]:  # fmt: skip
    """``--quick``: one run per system at ``rate``; its goodput is that rate if it passed."""
    out = {}
    for name in names:
        a = attainment_at(name, rate)
        out[name] = GoodputResult(rate if a >= TARGET else 0.0, ((rate, a),))
    return out
