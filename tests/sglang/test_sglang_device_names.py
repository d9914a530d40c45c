"""The SGLang backend takes its model runner's name for the device as the tensors' device:
SGLang says ``cuda`` while its tensors are on ``cuda:N`` (and ``torch.device("cuda") !=
torch.device("cuda:0")``). On CPU the analogue is a runner on ``cpu:0`` with tensors on
``cpu``: the backend must bind, attend and match SGLang's own ``torch_native`` backend."""

from __future__ import annotations

import pytest
import torch

sgl_world = pytest.importorskip("sgl_world", reason="sglang is not installed")

from tokenlake.engines.sglang.config import SGLangPoolConfig  # noqa: E402


def test_runner_on_cpu_0_attends_like_torch_native() -> None:
    config = SGLangPoolConfig(num_instances=2, num_slots=512, segment_len=4)
    w = sgl_world.World(config, device="cpu:0")
    assert w.runner.device == "cpu:0" and w.tokenlake.device == torch.device("cpu")
    prompt = sgl_world.tokens(1, 13)
    w.add("a", prompt + sgl_world.tokens(2, 3))
    assert w.step({"a": len(prompt)}) <= sgl_world.TOLERANCE  # extend: binds on `cpu:0`
    for _ in range(3):  # decode
        assert w.step({"a": 1}) <= sgl_world.TOLERANCE
