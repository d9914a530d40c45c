"""TokenLake's distributed attention priced layer by layer (the simulator's default pricing).

Each layer of an iteration runs in order on its origin: the forward up to q, then the
holders' prefix attention over the segments they hold (q sent out, partial ``(o, lse)``
sent back), the merge of the parts, then the rest of the layer. The origin's own part of
the prefix attention runs beside the remote parts, so per layer and decode step the origin
waits ``max(0, remote - local)`` where

    remote = 2 x latency + q bytes / link + (launch + holder's share of attention) + o bytes / link

and every part costs a kernel launch, and the merge (``launch + rows x parts x (o + lse) bytes
/ memory bandwidth``) runs on the origin. The origin's forward, its local part and the merge
are GPU work under processor sharing (:mod:`.tokenlake_timing`); the waits are idle time
added after the origin's work. A holder or link busy with other iterations serves this one
at its share at the start (``load``: flights sharing it, this one included); every link
(each instance's NVLink and NIC, out and in) is itself processor-shared by the bytes of
every iteration on it, so two transfers on one link take twice as long as one. NVLink is
taken at its published per-direction bandwidth.

Decode iterations of several steps wait once per step and layer, for the step's average
share of the rows (the steps of a multi-step iteration differ only in which requests are
still decoding).

``overlap`` is the older pricing, kept for comparison: an iteration ends at the latest of
each GPU's work and its bytes on the wire, no latency, no launches or merge, links unshared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenlake.benchmarks.sim.control_plane_cost import CONTROL_PLANES, MODEL
from tokenlake.benchmarks.sim.step_timer import ClusterSpec
from tokenlake.cluster.profiles import HardwareProfile

LAYERED, OVERLAP = "layered", "overlap"
PRICINGS = (LAYERED, OVERLAP)
# NVLink bandwidth each way per GPU. A100 NVLink 3: 12 links x 50 GB/s bidirectional, 600 GB/s
# in all, 300 GB/s each way (the hardware profile's 400 GB/s is the paper's figure); H100 and
# H200 NVLink 4: 18 links, 900 GB/s in all, 450 GB/s each way.
NVLINK_PER_DIRECTION = {"A100-80G": 300e9, "H100": 450e9, "H200": 450e9}
LSE_BYTES = 4  # one fp32 normalizer per row and query head
NUM_LINKS = 4  # per instance, in this order:
NV_OUT, NV_IN, NIC_OUT, NIC_IN = range(NUM_LINKS)


@dataclass(frozen=True)
class PricingConfig:
    """Args: dist_attn (``layered``, the default, or ``overlap``, the older pricing);
    rpc_s (the control plane's dispatch of one iteration to its instances, charged before
    it starts); launch_s (one kernel launch: each holder's part and the merge, per layer and
    step); control_plane_scale (the control plane's cost, the scheduler's step with
    ``gen_plans`` and its commit, is charged to simulated time times this; 0: not
    charged); control_plane (``model``, the default: the calibrated cost model of
    :mod:`.control_plane_cost`, the same seconds for the same calls on any machine;
    ``live``: each call's measured thread CPU time, which depends on the machine's load).

    Two levers against the wait on busy holders, off by default (what the data plane and
    the server do today), each an ablation: holder_priority (a holder runs the query parts
    of other instances' iterations ahead of its own work, as a high-priority CUDA stream
    would: the origin waits for the part at the holder's full speed, the holder's own
    iteration absorbs the delay); overlap_scheduling (the control plane plans an instance's
    next iteration while its current one runs, as SGLang's overlap scheduler does: a call
    made when an iteration ends is charged from that iteration's dispatch, so only the
    control plane's backlog beyond the GPU work delays the next one). price_hops (a third,
    in the control plane: the scheduler and placement weigh each remote holder's fixed
    per-step cost, :meth:`LayeredPricing.hop_seconds`, as ``tokenlake serve`` weighs the
    hop it measures at start-up: the dispatcher keeps a batch where its pages are, a small
    decode reads the replica on its home, and segments small decodes read remotely are
    replicated beside their reader)."""

    dist_attn: str = LAYERED
    rpc_s: float = 50e-6
    launch_s: float = 5e-6
    control_plane_scale: float = 1.0
    control_plane: str = MODEL
    holder_priority: bool = False
    overlap_scheduling: bool = False
    price_hops: bool = False

    def __post_init__(self) -> None:
        if self.dist_attn not in PRICINGS:
            raise ValueError(
                f"PricingConfig.dist_attn: expected one of {PRICINGS}, got {self.dist_attn!r}"
            )
        if self.control_plane not in CONTROL_PLANES:
            raise ValueError(
                f"PricingConfig.control_plane: expected one of {CONTROL_PLANES}, got "
                f"{self.control_plane!r}"
            )
        for name in ("rpc_s", "launch_s", "control_plane_scale"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ValueError(f"PricingConfig.{name}: expected a number >= 0, got {value!r}")


class LayeredPricing:
    """The per-layer waits, launches and merges of one iteration, and its bytes per link."""

    def __init__(self, spec: ClusterSpec, hardware: HardwareProfile, config: PricingConfig):
        n, shape = spec.num_instances, spec.mp.shape
        self.num_instances, self.num_layers = n, spec.mp.num_layers
        self.o_bytes = shape.q_bytes_per_token_layer  # one row's q or o, one layer
        self.lse_bytes = shape.num_q_heads * LSE_BYTES
        self.latency, self.launch = hardware.net_latency_s, config.launch_s
        self.holder_priority = config.holder_priority
        nvlink = NVLINK_PER_DIRECTION.get(spec.hardware, hardware.intra_node_bandwidth / spec.tp)
        self.bw_near, self.bw_far = nvlink * spec.tp, hardware.inter_node_bandwidth
        self.mem_bw = hardware.mem_bandwidth
        node = np.array([spec.node_of(i) for i in range(n)])
        self.same_node = node[:, None] == node[None, :]

    def hop_seconds(self) -> float:
        """The fixed cost of one remote holder per decode step, all layers, on an idle
        holder: the link latency both ways and the part's and the merge's launches."""
        return self.num_layers * (2 * self.latency + 2 * self.launch)

    def link(self, instance, which: int):
        """Server index of an instance's link (after the instances' own GPUs)."""
        return self.num_instances + NUM_LINKS * np.asarray(instance) + which

    def link_work(self, q_rows: np.ndarray, put_bytes: np.ndarray) -> np.ndarray:
        """Seconds at full speed on every link: ``q_rows[o, h]`` rows of q origin ``o`` sends
        holder ``h`` (all steps; their o comes back), ``put_bytes[s, d]`` of new KV."""
        q = q_rows * (self.num_layers * self.o_bytes)
        sent = q + q.T + put_bytes  # sent[s, d]: bytes from s to d
        np.fill_diagonal(sent, 0.0)
        work = np.zeros(self.num_instances * NUM_LINKS)
        for mask, out, inn, bw in (
            (self.same_node, NV_OUT, NV_IN, self.bw_near),
            (~self.same_node, NIC_OUT, NIC_IN, self.bw_far),
        ):
            part = np.where(mask, sent, 0.0)
            work[out::NUM_LINKS] = part.sum(axis=1) / bw
            work[inn::NUM_LINKS] = part.sum(axis=0) / bw
        return work

    def stalls(
        self, att: np.ndarray, q_rows: np.ndarray, num_steps: int, load: np.ndarray
    ) -> tuple[np.ndarray, dict[int, float]]:
        """``att[o, h]``: seconds (full speed, all layers and steps) of holder ``h``'s prefix
        attention for origin ``o``'s rows; ``q_rows`` as in :meth:`link_work`; ``load[i]``:
        flights sharing server ``i`` at the start, this one included. Returns the launch and
        merge work each instance adds, and each origin's idle wait for its remote parts."""
        n, per = self.num_instances, self.num_layers * max(num_steps, 1)
        extra, stall = np.zeros(n), {}
        for o in np.flatnonzero(att.sum(axis=1) > 0).tolist():
            parts = np.flatnonzero(att[o] > 0)
            extra[parts] += per * self.launch  # one kernel per part, layer and step
            remote = parts[parts != o]
            if not len(remote):
                continue
            local = (self.launch + att[o, o] / per) * load[o] if att[o, o] > 0 else 0.0
            rows = q_rows[o, remote].max() / max(num_steps, 1)  # rows merged per step
            # the merge reads every part's (o, lse) and writes the output
            merge_bytes = rows * (len(parts) + 1) * (self.o_bytes + self.lse_bytes)
            extra[o] += per * (self.launch + merge_bytes / self.mem_bw)
            send = recv = 0.0
            for near, out, inn, bw in (
                (True, NV_OUT, NV_IN, self.bw_near),
                (False, NIC_OUT, NIC_IN, self.bw_far),
            ):
                hs = remote[self.same_node[o, remote] == near]
                if not len(hs):
                    continue
                seconds = q_rows[o, hs].sum() / max(num_steps, 1) * self.o_bytes / bw
                send = max(
                    send, seconds * max(load[self.link(o, out)], load[self.link(hs, inn)].max())
                )
                recv = max(
                    recv, seconds * max(load[self.link(o, inn)], load[self.link(hs, out)].max())
                )
            # a holder serves the part at its share of its GPU, or at once with priority
            compute = max(
                (self.launch + att[o, h] / per) * (1 if self.holder_priority else load[h])
                for h in remote.tolist()
            )
            wait = 2 * self.latency + send + compute + recv - local
            stall[o] = per * max(0.0, wait)
        return extra, stall
