"""``--latency-model-file``: a start without the file profiles and writes it; a start with it
reads it instead of profiling, so its scheduler plans with exactly that model (the same DoP
and chunk choices as the start that wrote it)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("safetensors")

from tokenlake.scheduler import Coeffs, LatencyModel  # noqa: E402
from tokenlake.serve import build as build_module  # noqa: E402
from tokenlake.serve.config import ServeConfig  # noqa: E402

MODEL = LatencyModel({1: Coeffs(2e-3, 4e-6, 1e-10), 2: Coeffs(3e-3, 2e-6, 5e-11)},
                     Coeffs(1.5e-3, 2e-5, 0.0), hop_s=0.0)  # fmt: skip


def config(path, **kw) -> ServeConfig:
    return ServeConfig(num_instances=1, segment_len=8, num_slots=64, chunk_len=32,
                       max_num_seqs=4, max_model_len=256, torch_threads=1, port=0,
                       latency_model_file=str(path), **kw)  # fmt: skip


def test_profiled_once_then_read(tmp_path, monkeypatch):
    path = tmp_path / "latency.json"
    profiled = []

    def fake_profile(*args, **kwargs):
        profiled.append(args)
        return MODEL

    monkeypatch.setattr(build_module, "profile_latency_model", fake_profile)
    first = build_module.build(config(path))
    try:
        assert first.runtime.scheduler.latency_model == MODEL and len(profiled) == 1
    finally:
        first.runtime.close()
    assert LatencyModel.from_dict(json.loads(path.read_text())) == MODEL
    second = build_module.build(config(path))
    try:
        assert len(profiled) == 1  # read, not profiled again
        assert second.runtime.scheduler.latency_model == MODEL
    finally:
        second.runtime.close()
