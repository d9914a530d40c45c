"""Distributed attention priced layer by layer, on constructed iterations checked against
sums worked out by hand from the roofline: per layer the origin waits for q out, the holder's
part, (o, lse) back; the merge and launches cost; a link carrying two transfers takes twice
as long; a busy holder serves the remote part at its share; the control plane's measured
time and the dispatch RPC delay the iteration."""

from types import SimpleNamespace

import numpy as np
import pytest

from tokenlake.benchmarks.sim.context import SimContext
from tokenlake.benchmarks.sim.events import EventLoop
from tokenlake.benchmarks.sim.job import Job
from tokenlake.benchmarks.sim.metrics import LoadTimeline, RequestRecord
from tokenlake.benchmarks.sim.step_timer import ClusterSpec, make_timer
from tokenlake.benchmarks.sim.systems.layered import PricingConfig
from tokenlake.benchmarks.sim.systems.tokenlake_system import TokenLakeConfig, TokenLakeSystem
from tokenlake.benchmarks.sim.systems.tokenlake_timing import TokenLakeTiming
from tokenlake.benchmarks.workloads.request import SimRequest

SPEC = ClusterSpec(num_instances=4)  # one 8-GPU node: every pair on NVLink
SEG = 512
LAUNCH = 5e-6
NEW, PREFIX_PAGES = 1024, 4  # one prefill chunk over a 2,048-token prefix


def no_puts():
    return SimpleNamespace(dst_ids=[], dst_indptr=np.zeros(1, int), run_len=np.zeros(0, int))


def prefill_plan(origin: int, holder: int):
    """One request: NEW new rows after PREFIX_PAGES full pages, all held by ``holder``."""
    prefix = PREFIX_PAGES * SEG
    qp = SimpleNamespace(
        origin=origin,
        q_indptr=np.array([0, NEW]),
        positions=np.array([prefix]),
        prefix_lens=np.array([prefix]),
        entry_req=np.array([0]),
        holder_ids=np.array([holder]),
        holder_indptr=np.array([0, 1]),
        kv_indptr=np.array([0, PREFIX_PAGES]),
        kv_indices=np.arange(PREFIX_PAGES),
        last_len=np.array([SEG]),
    )
    return SimpleNamespace(query_plans=[qp], transfer_plans=[no_puts()])


def put_plan(origin: int, dst: int, num_tokens: int):
    """A one-token decode on ``origin`` (no prefix) that puts ``num_tokens`` of KV on ``dst``."""
    qp = SimpleNamespace(
        origin=origin,
        q_indptr=np.array([0, 1]),
        positions=np.array([0]),
        prefix_lens=np.array([0]),
        entry_req=np.zeros(0, int),
    )
    tp = SimpleNamespace(dst_ids=[dst], dst_indptr=np.array([0, 1]), run_len=np.array([num_tokens]))
    return SimpleNamespace(query_plans=[qp], transfer_plans=[tp])


def timing(dist_attn="layered", **levers):
    pricing = PricingConfig(dist_attn, **levers)
    return TokenLakeTiming(make_timer(SPEC), SPEC, SEG, pricing=pricing)


def hand_sum(holder_share: float = 1.0) -> float:
    """The iteration by hand: overhead and forward, then per layer q out over NVLink (300
    GB/s each way per GPU, TP 2), the holder's part (a launch and its layer's share of the
    attention, at ``holder_share`` of its GPU), o back, and the merge of one part."""
    timer = make_timer(SPEC)
    cost, hw, mp = timer.cost, timer.hardware, SPEC.mp
    num_layers = mp.num_layers
    row_bytes = mp.num_q_heads * mp.head_dim * 2  # bf16 q or o of one row, one layer
    link = 2 * 300e9
    transfer = NEW * row_bytes / link
    attention = cost.query_time(NEW, PREFIX_PAGES * SEG) / num_layers
    remote = 2 * hw.net_latency_s + 2 * transfer + (LAUNCH + attention) / holder_share
    merge = LAUNCH + NEW * 2 * (row_bytes + 4 * mp.num_q_heads) / hw.mem_bandwidth
    forward = timer.config.prefill_overhead_s + cost.forward_time([(0, NEW)])
    return forward + num_layers * (remote + merge)


def test_one_holder_step_is_the_sum_over_layers():
    t = timing()
    flight, moved = t.start(prefill_plan(origin=0, holder=1), True, 2.0, None, delay=1e-3)
    assert not moved
    assert flight.end == pytest.approx(2.0 + 1e-3 + hand_sum(), rel=1e-9)
    # the older pricing overlaps everything: the origin's forward alone is longer than the
    # holder's attention, so the step is the forward
    old, _ = timing("overlap").start(prefill_plan(0, 1), True, 2.0, None)
    timer = make_timer(SPEC)
    forward = timer.config.prefill_overhead_s + timer.cost.forward_time([(0, NEW)])
    assert old.end == pytest.approx(2.0 + forward)
    assert flight.end - 1e-3 > old.end


def test_a_holder_busy_with_its_own_batch_slows_the_remote_part():
    t = timing()
    own = np.zeros(4)
    own[1] = 10.0  # the holder's own batch, far longer than the iteration
    t.place(own, 0.0, 0.0)
    flight, moved = t.start(prefill_plan(origin=0, holder=1), True, 0.0, None)
    assert flight.end == pytest.approx(hand_sum(holder_share=0.5), rel=1e-9)
    assert len(moved) == 1  # the holder's batch is slowed in turn


def test_holder_priority_serves_the_remote_part_at_full_speed():
    """The lever's ablation: the busy holder runs the origin's part first, so the origin
    waits as if the holder were idle; the holder's own batch still absorbs the part."""
    t = timing(holder_priority=True)
    own = np.zeros(4)
    own[1] = 10.0
    busy, _ = t.place(own, 0.0, 0.0)
    flight, moved = t.start(prefill_plan(origin=0, holder=1), True, 0.0, None)
    assert flight.end == pytest.approx(hand_sum(holder_share=1.0), rel=1e-9)
    assert moved == [busy] and busy.end > 10.0


def test_two_transfers_on_one_link_take_twice_as_long_as_one():
    num_tokens = 200_000  # about 100 GB: the link, not the forward, decides
    link = 2 * 300e9
    seconds = num_tokens * SPEC.kv_bytes_per_token / link
    alone, _ = timing().start(put_plan(0, 1, num_tokens), False, 0.0, None)
    assert alone.end == pytest.approx(seconds, rel=1e-9)
    t = timing()
    a, _ = t.start(put_plan(0, 1, num_tokens), False, 0.0, None)
    b, moved = t.start(put_plan(2, 1, num_tokens), False, 0.0, None)  # same link into 1
    assert moved == [a]
    assert a.end == pytest.approx(2 * seconds, rel=1e-9)
    assert b.end == pytest.approx(2 * seconds, rel=1e-9)
    # different links (into 1 and into 3) do not contend
    t = timing()
    a, _ = t.start(put_plan(0, 1, num_tokens), False, 0.0, None)
    b, moved = t.start(put_plan(2, 3, num_tokens), False, 0.0, None)
    assert not moved and a.end == pytest.approx(seconds) and b.end == pytest.approx(seconds)
    # the older pricing never shares a link (and takes NVLink at the profile's 400 GB/s)
    t = timing("overlap")
    a, _ = t.start(put_plan(0, 1, num_tokens), False, 0.0, None)
    b, _ = t.start(put_plan(2, 1, num_tokens), False, 0.0, None)
    assert a.end == pytest.approx(num_tokens * SPEC.kv_bytes_per_token / (2 * 400e9))


@pytest.mark.parametrize(
    "field,value",
    [("dist_attn", "serial"), ("rpc_s", -1.0), ("launch_s", float("nan"))],
)
def test_bad_pricing_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        PricingConfig(**{field: value})


class TickingClock:
    """A CPU clock that advances ``tick`` seconds per reading: every call measures ``tick``."""

    def __init__(self, tick: float) -> None:
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


def first_token_s(pricing: PricingConfig, tick: float) -> float:
    return token_times(pricing, tick)[0]


def token_times(pricing: PricingConfig, tick: float) -> tuple[float, float]:
    """(first, last) token of one 4-token request on TokenLake, every control-plane call
    measured as ``tick`` seconds."""
    loop, timer = EventLoop(), make_timer(SPEC)
    req = SimRequest(0, 0.0, 600, 4, (1, 2))
    rec = RequestRecord(0, 0.0, 600, 4, 1.0, (0.01, 0.0))
    system = TokenLakeSystem(
        SimContext(loop, timer, SPEC, LoadTimeline(4, 1.0), lambda job, t: None),
        TokenLakeConfig(chunk_len=1024, max_prefill_tokens=1024, pricing=pricing),
        cpu_clock=TickingClock(tick),
    )
    system.submit(Job(req, rec, 512))
    loop.run(until=10.0)
    assert rec.num_tokens == 4 and system.control_cpu_s > 0
    return rec.first_token_s, rec.last_token_s


def test_overlap_scheduling_hides_the_calls_behind_the_running_iteration():
    """Each decode step's complete() and the next step() (1 ms each, measured) run after the
    step ends, or, overlapped, while it runs: the gap between tokens loses exactly them when
    they fit in the step (a decode step here is about 6 ms)."""
    tick = 1e-3
    plain = PricingConfig(rpc_s=50e-6)
    first, last = token_times(plain, tick)
    o_first, o_last = token_times(PricingConfig(rpc_s=50e-6, overlap_scheduling=True), tick)
    assert o_first == pytest.approx(first, rel=1e-9)  # nothing ran before the prompt
    gap, o_gap = (last - first) / 3, (o_last - o_first) / 3
    assert gap - o_gap == pytest.approx(2 * tick, rel=1e-6)
    free_first, free_last = token_times(PricingConfig(rpc_s=50e-6, control_plane_scale=0), tick)
    assert o_gap == pytest.approx((free_last - free_first) / 3, rel=1e-9)  # all hidden


def test_control_plane_time_and_rpc_delay_the_iteration():
    free = first_token_s(PricingConfig(rpc_s=0.0, control_plane_scale=0.0), tick=0.02)
    charged = first_token_s(PricingConfig(rpc_s=50e-6, control_plane_scale=1.0), tick=0.02)
    # the prompt is one iteration: its step() (20 ms measured) and one RPC before it
    assert charged - free == pytest.approx(0.02 + 50e-6, rel=1e-9)
    scaled = first_token_s(PricingConfig(rpc_s=50e-6, control_plane_scale=0.5), tick=0.02)
    assert scaled - free == pytest.approx(0.01 + 50e-6, rel=1e-9)


def test_price_hops_gives_the_scheduler_and_placement_the_hop():
    """The third lever: the hop's seconds (latency both ways and two launches per layer) go
    to the scheduler's latency model, and in NVLink bytes to the dispatcher and placement."""
    hw = make_timer(SPEC).hardware
    hop = SPEC.mp.num_layers * (2 * hw.net_latency_s + 2 * LAUNCH)

    def system(pricing: PricingConfig) -> TokenLakeSystem:
        ctx = SimContext(EventLoop(), make_timer(SPEC), SPEC, LoadTimeline(4, 1.0), lambda j, t: 0)
        return TokenLakeSystem(ctx, TokenLakeConfig(pricing=pricing))

    priced = system(PricingConfig(price_hops=True))
    assert priced.sched.latency_model.hop_s == pytest.approx(hop, rel=1e-12)
    assert priced.pool.balancer.hop_bytes == pytest.approx(hop * 2 * 300e9, rel=1e-12)
    plain = system(PricingConfig())
    assert plain.sched.latency_model.hop_s == 0 and plain.pool.balancer.hop_bytes == 0
