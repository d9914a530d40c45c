"""Unit tests of the data plane's pieces that need no processes: the wire format, the shared
buffer layout and the executor's run-based put (checked against the row-based one)."""

from __future__ import annotations

import dataclasses
import pickle

import msgpack
import numpy as np
import pytest
import torch

import tokenlake as tl
from tokenlake.engines.core import puts
from tokenlake.engines.core.kv_pool import KVPool
from tokenlake.engines.core.shared_buffers import InstanceBuffers, Layout
from tokenlake.engines.transport import messages

SHAPE = tl.ModelShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8)


def _sample(cls) -> object:
    values = []
    for f in dataclasses.fields(cls):
        kind = str(f.type)
        if "ndarray" in kind:
            values.append(np.array([3, -1, 7], dtype=np.int32))
        elif kind == "bytes":
            values.append(b"\x00x")
        elif kind.startswith("tuple[str"):
            values.append(("a", "bc"))
        elif kind.startswith("tuple"):
            values.append((b"a", b"bc"))
        elif kind == "str":
            values.append("x")
        elif kind == "bool":
            values.append(True)
        else:
            values.append(11)
    return cls(*values)


@pytest.mark.parametrize("cls", messages.MESSAGES, ids=lambda c: c.__name__)
def test_every_message_round_trips(cls):
    msg = _sample(cls)
    out = messages.decode(messages.encode(msg))
    assert type(out) is cls
    for f in dataclasses.fields(cls):
        a, b = getattr(msg, f.name), getattr(out, f.name)
        if isinstance(a, np.ndarray):
            assert b.dtype == np.int32 and np.array_equal(a, b)
        else:
            assert a == b


def test_decode_rejects_other_versions_unknown_types_and_pickle():
    good = msgpack.unpackb(messages.encode(messages.Stop(1)))
    for bad in (
        msgpack.packb({**good, "v": messages.VERSION + 1}),
        msgpack.packb({**good, "t": "Exec"}),
        msgpack.packb({**good, "t": [1]}),  # once killed an engine
        msgpack.packb({**good, "f": [1, 2, 3]}),
        msgpack.packb({**good, "f": {"seq": True}}),
        msgpack.packb({**good, "f": {"seq": 1, "extra": 2}}),
        pickle.dumps(messages.Stop(1)),
        b"\xc1",
    ):
        with pytest.raises(messages.ProtocolError, match="message|Stop"):
            messages.decode(bad)
    with pytest.raises(messages.ProtocolError, match="message"):
        messages.encode(object())


def test_views_share_the_raw_storage_and_capacity_is_checked():
    layout = Layout(SHAPE, 2, num_slots=4, segment_len=8, max_q_rows=16, max_kv_rows=8)
    buffers = InstanceBuffers.allocate(layout.nbytes(), "cpu")
    views = buffers.views(layout)
    assert views.pool.data.shape == layout.pool_shape and views.out_o.dtype == torch.float32
    views.q.fill_(2.0)
    assert buffers.views(layout).q.eq(2.0).all()  # a second view sees the same bytes
    assert all(t.is_shared() for t in buffers.raw.values())
    smaller = dataclasses.replace(layout, num_slots=2, max_q_rows=4)
    assert buffers.fits(smaller) is None
    bigger = dataclasses.replace(layout, num_slots=5)
    assert "pool" in buffers.fits(bigger)
    with pytest.raises(tl.InvalidArgumentError, match="layout: pool"):
        buffers.views(bigger)


def test_write_runs_equals_a_row_by_row_put_and_packed_gather():
    """The run-based put (one copy per run) stores exactly what a brute-force row-by-row
    put stores, both from the kv buffer and from packed rows as received between hosts."""
    cfg = tl.PoolConfig(SHAPE, 2, num_slots=8, segment_len=8)
    pool = tl.Pool(cfg)
    ids = np.arange(50, dtype=np.int32) % 13
    plans = pool.gen_plans([[tl.Chunk("r", ids, 0)]], dops=[1])
    tp = plans.transfer_plans[0]
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((SHAPE.num_layers, tp.num_rows, 2, 2, 8), generator=gen)
    for d in range(len(tp.dst_ids)):
        runs = puts.put_runs(tp, d)
        src, slot, offset = tp.rows_to(d)
        assert runs.num_rows == len(src)
        by_rows, by_runs, packed = (KVPool(SHAPE, 8, 8) for _ in range(3))
        for layer in range(SHAPE.num_layers):
            for r, s_, o in zip(src.tolist(), slot.tolist(), offset.tolist(), strict=True):
                by_rows.data[layer, s_, :, o] = kv[layer, r]
            puts.write_runs(by_runs, runs.as_array(), kv[layer], layer)
            rows = puts.gather_runs(kv[layer], runs.as_lists())
            puts.write_runs(packed, runs.packed().as_array(), rows, layer)
        assert torch.equal(by_rows.data, by_runs.data)
        assert torch.equal(by_rows.data, packed.data)
    pool.abort(plans)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_runs_rejects_every_out_of_range_run_before_writing(dtype):
    """The C++ copy checks every run against both buffers before it writes any byte."""
    shape = tl.ModelShape(2, 4, 2, 8, dtype)
    pool = KVPool(shape, 4, 8)
    kv = torch.randn((6, 2, 2, 8)).to(shape.torch_dtype)
    good = [0, 2, 1, 3]  # rows 0..1 -> slot 1, tokens 3..4
    puts.write_runs(pool, np.array([good], dtype=np.int32), kv, 1)
    assert torch.equal(pool.data[1, 1, :, 3:5], kv[0:2].transpose(0, 1))
    before = pool.data.clone()
    for bad, name in [
        ([5, 2, 0, 0], "src_row"),  # rows 5..6 of 6
        ([-1, 1, 0, 0], "src_row"),
        ([0, -1, 0, 0], "length"),
        ([0, 1, 4, 0], "dst_slot"),
        ([0, 1, -1, 0], "dst_slot"),
        ([0, 2, 0, 7], "dst_offset"),  # tokens 7..8 of a page of 8
        ([0, 1, 0, -1], "dst_offset"),
    ]:
        runs = np.array([good, bad], dtype=np.int32)  # the good run first: still not written
        with pytest.raises(ValueError, match=f"runs: {name} out of range in run 1"):
            puts.write_runs(pool, runs, kv, 0)
        assert torch.equal(pool.data, before)


def test_copy_segment_copies_the_first_tokens_of_every_layer():
    src, dst = KVPool(SHAPE, 4, 8), KVPool(SHAPE, 4, 8)
    src.data.normal_()
    puts.copy_segment(src, 1, dst, 3, 5)
    assert torch.equal(dst.data[:, 3, :, :5], src.data[:, 1, :, :5])
    assert dst.data[:, 3, :, 5:].eq(0).all() and dst.data[:, :3].eq(0).all()


def test_pool_config_accepts_exactly_the_kernels_dtypes_of_its_device():
    from tokenlake.config import KERNEL_DTYPES
    from tokenlake.engines.clusters.local import LocalCluster

    for device, dtypes in KERNEL_DTYPES.items():
        for dtype in ("float32", "bfloat16", "float16"):
            shape = tl.ModelShape(2, 4, 2, 8, dtype)
            if dtype in dtypes:
                assert tl.PoolConfig(shape, 1, 4, 8, device=device).device == device
            else:
                with pytest.raises(tl.InvalidArgumentError, match=f"{device} kernels support"):
                    tl.PoolConfig(shape, 1, 4, 8, device=device)
    with pytest.raises(tl.InvalidArgumentError, match="PoolConfig.device"):
        tl.PoolConfig(SHAPE, 1, 4, 8, device="tpu")
    with pytest.raises(tl.InvalidArgumentError, match="config.device"):
        LocalCluster(tl.PoolConfig(SHAPE, 1, 4, 8, device="cuda"))  # a CPU data plane
