"""The wall-clock bench's CPU setups in the simulator, priced by a measured CPU profile.

What runs for real (``tokenlake bench wallclock``): one ``tokenlake serve --num-instances N``
(``pool``: one pool over N instances, its in-process data plane, one runtime thread that runs
one iteration at a time, ``SchedulerConfig``'s defaults) against N ``tokenlake serve
--num-instances 1`` behind the cache-aware router (``router``), all on one host of a few
cores, driven by a streaming client that sends a session's next turn once the previous one
has answered and its own arrival time has come.

Here both run through the simulator's own parts: the real pool and elastic scheduler
(:class:`.tokenlake_system.TokenLakeSystem`, priced by :mod:`.tokenlake_timing`) and the router
model (:class:`.router.CacheAwareRouter`). The costs a GPU cluster does not have are the
profile's (:mod:`.cpu_profile`): every server's iterations are one thread's work, the whole
pool's included (:class:`.tokenlake_timing.SharedHost`), and all servers' threads share the
host's cores. The serving path's measured CPU (the profile's) is paid per request before it
reaches the scheduler, per streamed token and per iteration by the server's thread; ``request_overhead_s``
adds to the first, ``background_threads`` are other programs' busy threads on the same
cores (a shared machine).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tokenlake.benchmarks.sim.context import SimContext
from tokenlake.benchmarks.sim.control_plane_cost import load_control_plane_cost
from tokenlake.benchmarks.sim.cpu_profile import CpuProfile
from tokenlake.benchmarks.sim.events import EventLoop
from tokenlake.benchmarks.sim.job import Job
from tokenlake.benchmarks.sim.metrics import LoadTimeline, RequestRecord
from tokenlake.benchmarks.sim.systems.layered import PricingConfig
from tokenlake.benchmarks.sim.systems.router import CacheAwareRouter
from tokenlake.benchmarks.sim.systems.shared_servers import SharedHost
from tokenlake.benchmarks.sim.systems.tokenlake_system import TokenLakeConfig, TokenLakeSystem
from tokenlake.benchmarks.workloads.request import SimRequest

SYSTEMS = ("tokenlake", "router")


@dataclass(frozen=True)
class ServedSettings:
    """The real runs' server flags (``tokenlake bench wallclock``'s defaults), the batches
    a server computes at once (``compute_lanes``: 1 as ``tokenlake serve`` sets it, one
    process computing every instance; 0: one per instance, as it did before), and the
    serving path's extra cost per request and the background load."""

    num_instances: int = 4
    segment_len: int = 32
    num_slots: int = 96
    chunk_len: int = 256
    request_overhead_s: float = 0.0
    background_threads: float = 0.0
    compute_lanes: int = 1

    def __post_init__(self) -> None:
        for name in ("num_instances", "segment_len", "num_slots", "chunk_len", "compute_lanes"):
            value, low = getattr(self, name), 0 if name == "compute_lanes" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ServedSettings.{name}: expected an int >= {low}, got {value!r}")
        for name in ("request_overhead_s", "background_threads"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(
                    f"ServedSettings.{name}: expected >= 0, got {getattr(self, name)!r}"
                )


@dataclass(frozen=True)
class Arrival:
    """One request of a run: sent at ``send_s`` or once its session's previous turn ended."""

    req: SimRequest
    send_s: float
    session: str | None


def to_requests(
    prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], block_size: int
) -> list[SimRequest]:
    """Token prompts as the simulator's requests: chained block ids, equal id = equal prefix
    up to and including that block (a last partial block is keyed by its tokens too)."""
    ids: dict[tuple, int] = {}
    out = []
    for rid, (prompt, n_out) in enumerate(zip(prompts, max_tokens, strict=True)):
        parent, chain = -1, []
        for i in range(0, len(prompt), block_size):
            key = (parent, tuple(prompt[i : i + block_size]))
            parent = ids.setdefault(key, len(ids))
            chain.append(parent)
        out.append(SimRequest(rid, 0.0, len(prompt), int(n_out), tuple(chain)))
    return out


class _Pool:
    def __init__(self, loop, profile, settings, load, on_done, host) -> None:
        n, seg = settings.num_instances, settings.segment_len
        timer = profile.step_timer(n, settings.num_slots * seg)
        ctx = SimContext(loop, timer, timer.spec, load, on_done)
        self.system = TokenLakeSystem(ctx, _config(settings, profile, n), host=host)

    def submit(self, job: Job) -> None:
        self.system.submit(job)

    def done(self, job: Job) -> None:
        pass


class _Router:
    """N one-instance servers behind the cache-aware router, their threads on one host."""

    def __init__(self, loop, profile, settings, load, on_done, host) -> None:
        n, seg = settings.num_instances, settings.segment_len
        timer = profile.step_timer(1, settings.num_slots * seg)
        self.router = CacheAwareRouter(n)
        self.loop, self.worker_of = loop, {}
        self.workers = [
            TokenLakeSystem(
                SimContext(loop, timer, timer.spec, load, on_done),
                _config(settings, profile, 1),
                host=host,
                load_offset=i,
            )
            for i in range(n)
        ]

    def submit(self, job: Job) -> None:
        keys, lengths = job.prompt_keys()
        worker = self.router.select(keys, lengths, self.loop.now)
        self.worker_of[job.rid] = worker
        self.workers[worker].submit(job)

    def done(self, job: Job) -> None:
        self.router.finished(self.worker_of.pop(job.rid))


def _config(settings: ServedSettings, profile: CpuProfile, num_instances: int) -> TokenLakeConfig:
    # tokenlake serve's SchedulerConfig: its defaults but the chunk, and the latency model
    # it profiles at start-up; the control plane's cost charged as it is (it runs in the
    # runtime thread), by the host's cost model; no RPC or kernel launch apart from what the
    # hop holds
    return TokenLakeConfig(
        segment_len=settings.segment_len,
        chunk_len=settings.chunk_len,
        sync_iterations=True,
        pricing=PricingConfig(rpc_s=0.0, launch_s=0.0, control_plane_scale=1.0),
        latency=profile.latency_model(min(num_instances, 4)),
        token_overhead_s=profile.serving_cost(num_instances).token_s,
        iteration_overhead_s=profile.serving_cost(num_instances).iteration_s,
        compute_lanes=settings.compute_lanes,
        control_plane_cost=profile.control_plane or load_control_plane_cost(),
    )


def simulate_served(
    system: str,
    profile: CpuProfile,
    settings: ServedSettings,
    arrivals: Sequence[Arrival],
    limit_s: float,
    block_size: int,
) -> tuple[list[RequestRecord], LoadTimeline]:
    """Run ``arrivals`` through ``system`` (one of :data:`SYSTEMS`) until every request has
    finished or ``limit_s`` (the real run's cap: later tokens do not count). Each record's
    ``arrival_s`` is its send time, as the client measures TTFT from it."""
    if system not in SYSTEMS:
        raise ValueError(f"system: expected one of {SYSTEMS}, got {system!r}")
    loop = EventLoop()
    load = LoadTimeline(settings.num_instances)
    speedup = min(profile.thread_speedup, profile.host_cores)
    host = SharedHost(profile.host_cores, speedup, settings.background_threads)
    records: dict[int, RequestRecord] = {}
    waiting: dict[str, list[Arrival]] = {}  # session -> its turns not sent yet, in order
    busy: set[str] = set()  # sessions with a turn in flight

    def on_done(job: Job, t: float) -> None:
        served.done(job)
        session = session_of.get(job.rid)
        if session is not None:
            busy.discard(session)
            if waiting.get(session):
                nxt = waiting[session].pop(0)
                loop.at(max(t, nxt.send_s), lambda a=nxt: send(a))

    make = _Pool if system == "tokenlake" else _Router
    shape = settings.num_instances if system == "tokenlake" else 1
    request_s = profile.serving_cost(shape).request_s
    served = make(loop, profile, settings, load, on_done, host)
    session_of = {a.req.rid: a.session for a in arrivals}

    def send(a: Arrival) -> None:
        if a.session is not None:
            busy.add(a.session)
        rec = RequestRecord(a.req.rid, loop.now, a.req.input_len, a.req.output_len, 1.0, (1.0, 0))
        records[a.req.rid] = rec
        job = Job(a.req, rec, block_size)
        overhead = request_s + settings.request_overhead_s
        loop.at(loop.now + overhead, lambda: served.submit(job))

    def arrive(a: Arrival) -> None:
        if a.session is not None and (a.session in busy or waiting.get(a.session)):
            waiting.setdefault(a.session, []).append(a)
        else:
            send(a)

    for a in sorted(arrivals, key=lambda a: (a.send_s, a.req.rid)):
        loop.at(a.send_s, lambda a=a: arrive(a))
    loop.run(until=limit_s)
    out = []
    for a in arrivals:
        rec = records.get(a.req.rid)
        if rec is None:  # never sent: its session's previous turn did not end in time
            rec = RequestRecord(a.req.rid, math.nan, a.req.input_len, a.req.output_len, 1.0, (1, 0))
        out.append(rec)
    return out, load


def meets(rec: RequestRecord, ttft_s: float, tpot_s: float) -> bool:
    """The wall-clock bench's rule: finished, the first token within ``ttft_s`` of sending
    and every later token within ``tpot_s`` of the one before."""
    return rec.finished and rec.first_token_s - rec.arrival_s <= ttft_s and rec.max_tbt_s <= tpot_s


def attainment(records: Sequence[RequestRecord], ttft_s: float, tpot_s: float) -> float:
    return sum(meets(r, ttft_s, tpot_s) for r in records) / len(records) if records else 0.0


def solo_latency(
    profile: CpuProfile, settings: ServedSettings, req: SimRequest, block_size: int
) -> tuple[float, float]:
    """(TTFT, TPOT) of ``req`` alone on an idle one-instance server: what the wall-clock
    bench's SLO is a multiple of."""
    one = dataclasses.replace(settings, num_instances=1)
    (rec,), _ = simulate_served("router", profile, one, [Arrival(req, 0.0, None)], 1e9, block_size)
    if not rec.finished or rec.num_tokens < 2:
        raise ValueError(f"solo request {req.rid}: expected 2+ tokens, got {rec.num_tokens}")
    tpot = (rec.last_token_s - rec.first_token_s) / (rec.num_tokens - 1)
    return rec.first_token_s - rec.arrival_s, tpot


SLO_SCALE = 10.0  # the wall-clock bench's: 10x the batch-size-1 latencies


def probe(timed, block_size: int) -> SimRequest:
    """The wall-clock bench's batch-size-1 request: the median-length prompt, 2+ tokens."""
    probe = sorted(timed, key=lambda t: len(t.prompt_ids))[len(timed) // 2]
    (req,) = to_requests([probe.prompt_ids], [max(2, probe.max_tokens)], block_size)
    return req


def sim_slo(profile, settings, timed, block_size) -> dict:
    """The wall-clock bench's rule on the simulated server: :data:`SLO_SCALE` times the
    batch-size-1 TTFT and TPOT of its probe request."""
    ttft, tpot = solo_latency(profile, settings, probe(timed, block_size), block_size)
    return {"ttft_s": round(SLO_SCALE * ttft, 6), "tpot_s": round(SLO_SCALE * tpot, 6)}


def idle_costs(profile, settings, timed, real_slo, block_size) -> ServedSettings:
    """``settings`` with the two costs the real run's idle figures show beyond the profile
    (its thresholds over :data:`SLO_SCALE`: the batch-size-1 TTFT and TPOT it measured):
    other programs' busy threads on the host (``background_threads``, from how much slower
    the real decode step was than the profile's) and the serving path's fixed cost per
    request (``request_overhead_s``, what the real TTFT has beyond the simulated one)."""
    req = probe(timed, block_size)
    bare = dataclasses.replace(settings, background_threads=0.0, request_overhead_s=0.0)
    _, tpot = solo_latency(profile, bare, req, block_size)
    cores = profile.host_cores
    speed = min(profile.thread_speedup, cores)
    target = real_slo["tpot_s"] / SLO_SCALE
    rate = tpot / target  # the share of a core the real decode got, first guess
    for _ in range(3):  # the control plane's time is not slowed: a few corrections
        background = 0.0 if rate >= speed else cores / rate - 1
        loaded = dataclasses.replace(bare, background_threads=round(background, 3))
        if background == 0:
            break
        rate *= solo_latency(profile, loaded, req, block_size)[1] / target
    ttft, _ = solo_latency(profile, loaded, req, block_size)
    overhead = max(0.0, real_slo["ttft_s"] / SLO_SCALE - ttft)
    return dataclasses.replace(loaded, request_overhead_s=round(overhead, 6))
