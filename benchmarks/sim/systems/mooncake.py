"""Mooncake-style cache-centric PD disaggregation (xPyD) baseline.

P prefill instances keep local prefix caches (LRU); D decode instances hold only their running
requests. Each request is placed by the Conductor (:class:`Conductor`), following the Mooncake
paper (seed 000: Qin et al., "Mooncake: A KVCache-centric Disaggregated Architecture for LLM
Serving", §3.1 workflow, §4.1 Algorithm 1, §4.2 cache load balancing, §4.3.2 early rejection):

- prefill selection (Algorithm 1, lines 3-16): for every prefill instance, TTFT = T_transfer +
  T_queue + T_prefill. If the best prefix held anywhere is more than
  ``kvcache_balancing_threshold`` times the instance's own (line 5; a zero local prefix
  counts as infinitely smaller), the instance prefills from the best prefix after fetching
  the difference from its holder (T_transfer), else from its own. T_queue is the prefill time
  of the instance's queued work, T_prefill of this request; the smallest TTFT wins (the
  first on ties). The paper fits these times with a regression on offline data; the
  simulator uses its own step-time model, i.e. a perfect predictor.
- the fetch (lines 20-21, §4.2 "hot-spot migration"): the prefix KV goes from its holder to
  the chosen instance before the prefill and stays cached there (automatic replication).
- decode selection (line 17, §3.1 step 4): the decode instance with the lowest predicted TBT
  (its assigned requests' contexts plus this one), chosen up front.
- early rejection (lines 18-19, §4.3.2): if the predicted TTFT or TBT exceeds the request's
  SLO (the harness's: ``slo_scale`` x its batch-size-1 latencies), the request is rejected
  (HTTP 429) before any work; a request no instance could ever hold is rejected too.
- KV transfer (§3.1 step 3): the prompt's KV streams to the decode instance layer by layer
  while the prefill runs, so it arrives at the later of the prefill's end and its transfer
  time after the prefill started; each NIC carries one transfer at a time; instances on one
  8-GPU node use NVLink (the transfer engine's ``intranode_nvlink_transport``), others RDMA.
- decode admission (§3.1 step 4): the KV lands in the decode node's CPU memory and the request
  joins the decode batch, FCFS, once the instance can reserve its context and output.

- Mooncake Store (§3.2, :mod:`.mooncake_store`, on by default): every prefilled prompt's KV
  is stored in the nodes' pooled DRAM too, and so is a finished request's whole sequence
  (its prompt and its decode output, written from the decode node, as Mooncake's decode
  instances offload theirs); the prefix the store holds is one more source in line 5 (the
  longest prefix anywhere, GPU or DRAM, loaded from DRAM over PCIe/RDMA), so a prefix
  evicted from every GPU is loaded instead of recomputed.

Not modelled: the SSD tier, chunked pipeline parallelism across prefill nodes,
prediction-based early rejection (§4.3.4; it needs output-length prediction).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from tokenlake.benchmarks.sim.context import SimContext
from tokenlake.benchmarks.sim.engine import Engine, EngineConfig
from tokenlake.benchmarks.sim.job import Job
from tokenlake.benchmarks.sim.step_timer import StepTimer
from tokenlake.benchmarks.sim.systems.mooncake_store import MooncakeStore, MooncakeStoreConfig
from tokenlake.benchmarks.sim.systems.radix_cache import LocalPrefixCache


@dataclass(frozen=True)
class ConductorConfig:
    """Args: kvcache_balancing_threshold (Algorithm 1 line 5; the paper sets it by hand and
    publishes no value: 1.0 lets the TTFT estimate weigh every longer remote prefix);
    early_rejection (lines 18-19); slo_scale (the SLO multiple of batch-size-1 latency)."""

    kvcache_balancing_threshold: float = 1.0
    early_rejection: bool = True
    slo_scale: float = 10.0


class PrefillChoice(NamedTuple):
    instance: int  # index into the prefill instances
    ttft: float  # predicted seconds to the first token
    prefix_len: int  # cached prompt tokens the prefill starts from
    fetch_from: int  # prefill instance holding the longer prefix, or -1 (no fetch)
    fetch_tokens: int  # prefix tokens to fetch
    from_store: bool = False  # the prefix is loaded from Mooncake Store's DRAM


class Conductor:
    """Algorithm 1's decisions over ``prefill`` / ``decode`` engines; no side effects."""

    def __init__(
        self,
        prefill: Sequence[Engine],
        decode: Sequence[Engine],
        timer: StepTimer,
        fetch_time: Callable[[int, int, int], float],
        config: ConductorConfig | None = None,
        store: MooncakeStore | None = None,
    ) -> None:
        self.prefill, self.decode, self.timer = prefill, decode, timer
        self.store = store
        self.fetch_time = fetch_time  # (tokens, src instance, dst instance) -> seconds
        self.config = config or ConductorConfig()
        self.assigned: list[set[Job]] = [set() for _ in decode]

    def queue_time(self, e: Engine) -> float:
        news, prefixes = e.queued_prefill()
        return self.timer.prefill_time(news, prefixes) if news else 0.0

    def select_prefill(self, keys: Sequence[Hashable], input_len: int) -> PrefillChoice:
        cap = input_len - 1  # at least one token is computed
        local = [min(e.cache.match(keys, touch=False).num_tokens, cap) for e in self.prefill]
        best_len = max(local)
        best_instance = local.index(best_len)
        stored = min(self.store.match(keys), cap) if self.store else 0
        threshold = self.config.kvcache_balancing_threshold
        choice = None
        for i, e in enumerate(self.prefill):
            fetch = best_len > 0 and (local[i] == 0 or best_len / local[i] > threshold)
            prefix = best_len if fetch else local[i]
            t_fetch = self.fetch_time(best_len - local[i], best_instance, i) if fetch else 0.0
            src, from_store = best_instance if fetch else -1, False
            if stored > local[i] and (local[i] == 0 or stored / local[i] > threshold):
                t_load = self.store.load_time(keys, local[i], stored, e.index)
                if stored > prefix or t_load < t_fetch:  # the longest, then the fastest
                    prefix, t_fetch, src, from_store = stored, t_load, -1, True
            ttft = (
                t_fetch
                + self.queue_time(e)
                + self.timer.prefill_time([input_len - prefix], [prefix])
            )
            if choice is None or ttft < choice.ttft:
                fetched = prefix - local[i] if src >= 0 or from_store else 0
                choice = PrefillChoice(i, ttft, prefix, src, fetched, from_store)
        return choice

    def select_decode(self, job: Job) -> tuple[int, float]:
        """(decode instance, predicted TBT) among those that can hold the request; (-1, inf)
        if none can."""
        best, best_tbt = -1, float("inf")
        for d, e in enumerate(self.decode):
            if e.too_large_to_decode(job):
                continue
            ctx = [j.context_len for j in self.assigned[d]] + [job.input_len]
            tbt = self.timer.decode_time(ctx)
            if tbt < best_tbt:
                best, best_tbt = d, tbt
        return best, best_tbt

    def rejects(self, job: Job, ttft: float, tbt: float) -> bool:
        """Early rejection: the predicted TTFT or TBT misses the request's SLO."""
        if not self.config.early_rejection:
            return False
        scale, rec = self.config.slo_scale, job.rec
        solo_tbt = rec.solo_decode[0] + rec.solo_decode[1] * job.input_len
        return ttft > scale * rec.solo_prefill_s or tbt > scale * solo_tbt


class MooncakeSystem:
    def __init__(
        self,
        ctx: SimContext,
        num_prefill: int,
        engine_config: EngineConfig | None = None,
        conductor_config: ConductorConfig | None = None,
        store_config: MooncakeStoreConfig | None = None,
    ) -> None:
        """``store_config``: Mooncake Store's DRAM pool (default: on, 1 TiB per node; 0 GB:
        none, the cache is the prefill GPUs only)."""
        loop, timer, spec, load = ctx.loop, ctx.timer, ctx.spec, ctx.load
        if not 0 < num_prefill < spec.num_instances:
            raise ValueError(
                f"num_prefill: expected 1..{spec.num_instances - 1}, got {num_prefill}"
            )
        self.loop, self.timer, self.spec = loop, timer, spec
        self.on_finished_cb, self.on_rejected_cb = ctx.on_finished, ctx.on_rejected
        base = engine_config or EngineConfig()

        def make(i: int, role: str) -> Engine:
            cfg = replace(base, role=role, mixed_chunk=False)
            cache = LocalPrefixCache(spec.capacity_tokens, cfg.radix_eviction)
            return Engine(
                i, loop, timer, cache, cfg, load, self._finished, self._prefilled, self._rejected
            )

        n = spec.num_instances
        self.prefill = [make(i, "prefill") for i in range(num_prefill)]
        self.decode = [make(i, "decode") for i in range(num_prefill, n)]
        store_config = store_config or MooncakeStoreConfig()
        self.store = MooncakeStore(spec, store_config) if store_config.gb_per_node > 0 else None
        self.conductor = Conductor(
            self.prefill, self.decode, timer, self._fetch_time, conductor_config, self.store
        )
        self.nic_free_at = [0.0] * n
        self.pending = [deque() for _ in self.decode]  # KV arrived, waiting for decode memory
        self.num_fetches = 0

    def stats(self) -> dict:
        engines = self.prefill + self.decode
        return {
            "evicted_tokens": sum(e.cache.num_evicted_tokens for e in engines),
            "prefix_fetches": self.num_fetches,
            **(self.store.stats() if self.store else {}),
        }

    # ---- placement -----------------------------------------------------------------------
    def _kv_time(self, tokens: int, src: int, dst: int) -> float:
        same = self.spec.node_of(src) == self.spec.node_of(dst)
        return self.timer.transfer_time(tokens * self.spec.kv_bytes_per_token, same_node=same)

    def _fetch_time(self, tokens: int, src: int, dst: int) -> float:
        return self._kv_time(tokens, self.prefill[src].index, self.prefill[dst].index)

    def _reserve_nics(self, src: int, dst: int, earliest: float, seconds: float) -> float:
        """Book both NICs for one transfer starting no earlier than ``earliest``; its end."""
        start = max(earliest, self.nic_free_at[src], self.nic_free_at[dst])
        self.nic_free_at[src] = self.nic_free_at[dst] = start + seconds
        return start + seconds

    def submit(self, job: Job) -> None:
        keys, lengths = job.prompt_keys()
        cap = self.spec.capacity_tokens
        d, tbt = self.conductor.select_decode(job)
        if d < 0 or job.input_len > cap:
            self._rejected(job, self.loop.now, "too_large")
            return
        choice = self.conductor.select_prefill(keys, job.input_len)
        if self.conductor.rejects(job, choice.ttft, tbt):
            self._rejected(job, self.loop.now, "slo")
            return
        job.extra["decode"] = d
        self.conductor.assigned[d].add(job)
        p = self.prefill[choice.instance]
        if choice.from_store:  # loaded over the instance's own PCIe/NIC
            seconds = self.store.load_time(
                keys, choice.prefix_len - choice.fetch_tokens, choice.prefix_len, p.index
            )
            self.store.match(keys, touch=True)
            self.store.num_loads += 1
            end = self._reserve_nics(p.index, p.index, self.loop.now, seconds)
        elif choice.fetch_from < 0:
            p.submit(job)
            return
        else:
            src = self.prefill[choice.fetch_from]
            seconds = self._fetch_time(choice.fetch_tokens, choice.fetch_from, choice.instance)
            end = self._reserve_nics(src.index, p.index, self.loop.now, seconds)
            self.num_fetches += 1

        def fetched() -> None:
            # the fetched prefix stays cached on p (hot-spot replication), room permitting
            k = sum(1 for _ in _prefix_blocks(lengths, choice.prefix_len))
            if p.cache.reserve(choice.fetch_tokens):
                p.cache.insert(keys[:k], lengths[:k], lock=False)
                p.cache.release(choice.fetch_tokens)
                p.cache.trim()
            p.submit(job)

        self.loop.at(end, fetched)

    # ---- prefill -> decode ---------------------------------------------------------------
    def _prefilled(self, job: Job, t: float) -> None:
        if self.store is not None:  # the new KV is stored in the node's DRAM as well
            self.store.put(*job.prompt_keys(), job.instance)
        d = job.extra["decode"]
        dst, src = self.decode[d], job.instance
        seconds = self._kv_time(job.input_len, src, dst.index)
        end = max(t, self._reserve_nics(src, dst.index, job.prefill_start_s, seconds))
        self.loop.at(end, lambda: self._arrived(job, d, src))

    def _arrived(self, job: Job, d: int, src: int) -> None:
        self.prefill[src].release_prefilled(job)
        job.generated = 1
        job.rec.emit(self.loop.now)
        if job.req.output_len == 1:
            self.conductor.assigned[d].discard(job)
            self.on_finished_cb(job, self.loop.now)
            return
        self.pending[d].append(job)
        self._admit_decodes(d)

    def _admit_decodes(self, d: int) -> None:
        dst, queue = self.decode[d], self.pending[d]
        while queue and dst.can_accept_decode(queue[0]):
            dst.add_decode(queue.popleft())

    def _finished(self, job: Job, t: float) -> None:
        d = job.extra["decode"]
        if self.store is not None:  # the whole sequence, output included, from the D node
            keys, lengths = job.prompt_keys()
            okeys, olengths = job.output_keys()
            self.store.put(keys + okeys, lengths + olengths, self.decode[d].index)
        self.conductor.assigned[d].discard(job)
        self.on_finished_cb(job, t)
        self._admit_decodes(d)

    def _rejected(self, job: Job, t: float, reason: str) -> None:
        d = job.extra.pop("decode", None)
        if d is not None:
            self.conductor.assigned[d].discard(job)
        if self.on_rejected_cb is not None:
            self.on_rejected_cb(job, t, reason)


def _prefix_blocks(lengths: Sequence[int], num_tokens: int):
    """The leading blocks that lie entirely within the first ``num_tokens`` tokens."""
    total = 0
    for n in lengths:
        if total + n > num_tokens:
            return
        total += n
        yield n
