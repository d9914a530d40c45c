"""Named shared-memory buffers (``MPCluster(named_buffers=True)``): a process the launcher did
not spawn maps the same bytes by name; pickled for a spawned process they travel as names;
the creator removes them; and a worker checks the host's ``attach`` answer before using it."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from tokenlake.config import ModelShape
from tokenlake.engines.core.shared_buffers import InstanceBuffers, Layout
from tokenlake.errors import InvalidArgumentError

LAYOUT = Layout(ModelShape(2, 4, 2, 8, "float32"), 2, 6, 4, 16, 16)


def test_attach_by_name_maps_the_same_bytes_and_unlink_removes_them() -> None:
    host = InstanceBuffers.create_named(LAYOUT.nbytes(), doorbell_bytes=128)
    try:
        names = host.segment_names
        assert set(names) == {*InstanceBuffers.NAMES, "doorbells"}
        mapped = InstanceBuffers.attach(names, host.sizes())
        pool = host.views(LAYOUT).pool.data
        pool[1, 3, 0, 2] = 7.5  # the host writes a K row; the other mapping sees it
        assert float(mapped.views(LAYOUT).pool.data[1, 3, 0, 2, 0, 0]) == 7.5
        mapped.doorbells[5] = 9
        assert int(host.doorbells[5]) == 9
        again = pickle.loads(pickle.dumps(host))  # what a spawned engine receives
        assert again.segment_names == names
        again.views(LAYOUT).q.fill_(2.0)
        assert torch.equal(host.views(LAYOUT).q, torch.full_like(host.views(LAYOUT).q, 2.0))
    finally:
        host.unlink()
    assert not any(os.path.exists(f"/dev/shm/{n.lstrip('/')}") for n in names.values())
    with pytest.raises(InvalidArgumentError, match=r"names\['pool'\]: no shared memory segment"):
        InstanceBuffers.attach(names, host.sizes())


def test_attach_refuses_missing_or_short_segments() -> None:
    host = InstanceBuffers.create_named(LAYOUT.nbytes())
    try:
        names, sizes = host.segment_names, host.sizes()
        with pytest.raises(InvalidArgumentError, match="names: expected segments"):
            InstanceBuffers.attach({"pool": names["pool"]}, {"pool": sizes["pool"]})
        with pytest.raises(InvalidArgumentError, match=r"sizes\['pool'\]"):
            InstanceBuffers.attach(names, {**sizes, "pool": sizes["pool"] * 64})
    finally:
        host.unlink()


def test_a_malformed_attach_answer_is_refused() -> None:
    pytest.importorskip("sglang", reason="the SGLang adapter's module imports sglang")
    from tokenlake.engines.sglang.attach import attachment_from

    host = InstanceBuffers.create_named(LAYOUT.nbytes())
    try:
        from dataclasses import asdict

        from tokenlake.engines.dataplane_config import DataPlaneConfig

        good = {
            "layout": asdict(LAYOUT), "dataplane": asdict(DataPlaneConfig()), "backend": "",
            "buffers": [{"names": host.segment_names, "sizes": host.sizes()}] * 2,
            "endpoints": [["query", 0, "tcp://127.0.0.1:1"], ["transfer", 1, "tcp://127.0.0.1:2"]],
        }  # fmt: skip
        att = attachment_from(good, 1, "tcp://127.0.0.1:3", "/nonexistent")
        assert att.layout == LAYOUT and att.instance_id == 1 and len(att.buffers) == 2
        bad = [
            ("not a map", "attach reply: expected a map"),
            ({**good, "buffers": good["buffers"][:1]}, "buffers: expected 2 entries"),
            ({**good, "endpoints": [["shell", 0, "x"]]}, "endpoints: unexpected entry"),
            ({**good, "layout": {**good["layout"], "num_slots": -1}}, "num_slots: expected a pos"),
            ({**good, "layout": {**good["layout"], "num_slots": 600}}, r"buffers\[0\]: pool"),
            ({**good, "layout": {**good["layout"], "extra": 1}}, "malformed"),
        ]
        for answer, message in bad:
            with pytest.raises(InvalidArgumentError, match=message):
                attachment_from(answer, 0, "tcp://127.0.0.1:3", "/nonexistent")
        with pytest.raises(InvalidArgumentError, match="instance_id: expected 0..1"):
            attachment_from(good, 2, "tcp://127.0.0.1:3", "/nonexistent")
    finally:
        host.unlink()
