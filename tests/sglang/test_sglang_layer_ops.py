"""One layer of ``TokenLakeAttnBackend`` as a GPU would run it: a fixed number of kernels
whatever the batch, and no host read of a tensor's value (which would stall the stream).

Counted with :class:`~tokenlake.engines.kernels.op_count.OpCounter` (a ``TorchDispatchMode``)
around the backend's forward of a steady-state layer (the second: the first of a batch also
runs the CPU kernel's one-time argument check). The in-process cluster runs the holders'
query engines on this thread, so their work is counted too; it is counted apart as well
(a nested counter around each engine's ``RunQuery`` handler) to give the origin's own count.
The numbers held here are those named in docs/benchmarks.md.
"""

from __future__ import annotations

import pytest

sgl_world = pytest.importorskip("sgl_world", reason="sglang is not installed")

from tokenlake.engines.kernels.op_count import HostReadCounter, OpCounter  # noqa: E402
from tokenlake.engines.sglang.config import SGLangPoolConfig  # noqa: E402
from tokenlake.engines.transport import messages  # noqa: E402

PROMPT_LEN = 40
SEGMENT_LEN = 4


def layer_counts(num_instances: int, batch_size: int, new_len: int):
    """``(whole layer, holders' query engines, holder ids)`` counters for one steady layer of
    a batch of ``batch_size`` requests computing ``new_len`` tokens each after a prefill."""
    config = SGLangPoolConfig(num_instances=num_instances, num_slots=4096, segment_len=SEGMENT_LEN)
    w = sgl_world.World(config, max_reqs=80, kv_size=8192)
    for i in range(batch_size):
        w.add(f"r{i}", sgl_world.tokens(100 + i, PROMPT_LEN))
    w.step({f"r{i}": PROMPT_LEN // 2 for i in range(batch_size)})
    backend = w.tokenlake
    counted = {}
    forward = backend._forward
    for engine in backend.runtime.cluster._engines.values():
        run = engine.handlers[messages.RunQuery]

        def run_counted(m, run=run):
            if "peers" not in counted:  # not the counted layer
                return run(m)
            with counted["peers"]:
                return run(m)

        engine.handlers[messages.RunQuery] = run_counted

    def forward_counted(q, k, v, layer, fb, save):
        if layer.layer_id != 1:
            return forward(q, k, v, layer, fb, save)
        counted["peers"] = OpCounter()
        with OpCounter() as c:
            out = forward(q, k, v, layer, fb, save)
        counted["layer"] = c
        return out

    backend._forward = forward_counted
    holders = None

    def keep_holders():
        nonlocal holders
        holders = {p.instance_id for p in backend.forward_metadata.it.query_plan.parts}

    init = backend.init_forward_metadata

    def init_and_keep(fb):
        init(fb)
        keep_holders()

    backend.init_forward_metadata = init_and_keep
    w.step({f"r{i}": new_len for i in range(batch_size)})
    assert w.max_err <= sgl_world.TOLERANCE
    return counted["layer"], counted["peers"], holders


# kernels of one layer on the origin (the backend's own, SGLang's KV write included), by
# (decode or extend, one holder or several); docs/benchmarks.md names them
ORIGIN_KERNELS = {
    ("decode", False): 18,
    ("extend", False): 31,
    ("decode", True): 47,
    ("extend", True): 60,
}
PER_REMOTE_HOLDER = 3  # its gather of q rows, its copies of o and lse (+ its attention call)


@pytest.mark.parametrize("new_len", [1, 5], ids=["decode", "extend"])
@pytest.mark.parametrize("num_instances", [1, 2, 4])
def test_layer_kernels_do_not_grow_with_the_batch_and_read_nothing(num_instances, new_len):
    """0 host reads per layer; the origin's kernels the same for 1, 8 and 64 requests and for
    2 to 4 holders; each other holder adds its own fixed few."""
    mode = "decode" if new_len == 1 else "extend"
    for batch_size in (1, 8, 64):
        layer, peers, holders = layer_counts(num_instances, batch_size, new_len)
        assert layer.num_host_reads == 0, layer.ops
        assert peers.num_host_reads == 0, peers.ops
        assert 0 in holders  # the origin holds part of every prefix here (checked)
        origin = layer.num_kernels - peers.num_kernels
        assert origin == ORIGIN_KERNELS[mode, len(holders) > 1], (batch_size, layer.kernels)
        assert peers.num_kernels == PER_REMOTE_HOLDER * (len(holders) - 1), peers.kernels


def init_reads(batch_size: int, new_len: int, num_instances: int = 2):
    """Host reads of the backend's ``init_forward_metadata`` for a batch of ``batch_size``
    requests computing ``new_len`` tokens each after a prefill (counted at the Python call,
    ``.cpu()``, ``.numpy()``, ``.tolist()``, ``int(t)``, ..., as a GPU's tensors would be read)."""
    config = SGLangPoolConfig(num_instances=num_instances, num_slots=4096, segment_len=SEGMENT_LEN)
    w = sgl_world.World(config, max_reqs=80, kv_size=8192)
    for i in range(batch_size):
        w.add(f"r{i}", sgl_world.tokens(100 + i, PROMPT_LEN))
    w.step({f"r{i}": PROMPT_LEN // 2 for i in range(batch_size)})
    backend, counted = w.tokenlake, {}
    init = backend.init_forward_metadata

    def init_counted(fb):
        with HostReadCounter() as reads, OpCounter() as ops:
            init(fb)
        counted.update(reads=reads, ops=ops)

    backend.init_forward_metadata = init_counted
    w.step({f"r{i}": new_len for i in range(batch_size)})
    assert w.max_err <= sgl_world.TOLERANCE
    return counted["reads"], counted["ops"]


# per forward, whatever the batch: the new tokens' one copy (.cpu() + .numpy()), the rows
# (.tolist(): a device read unless SGLang hands over its host copy), and host tensors read
# as such (SGLang's generations and seq lens; the CPU data plane's NumPy view of its own
# staging buffer). A row first seen with a cached prefix adds one gather's copy per forward.
READS_PER_FORWARD = 6


@pytest.mark.parametrize("new_len", [1, 5], ids=["decode", "extend"])
def test_planning_a_forward_reads_nothing_per_request(new_len) -> None:
    """``init_forward_metadata`` keeps each request's token ids on the host: a forward reads
    its new tokens once, whatever the batch; no read per request (the token rows it used to
    copy per request and per step)."""
    counts = {n: init_reads(n, new_len) for n in (1, 8, 64)}
    for reads, ops in counts.values():
        assert reads.num_reads == READS_PER_FORWARD, reads.reads
        assert ops.num_host_reads == 0, ops.ops
