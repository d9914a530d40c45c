"""One name per device: ``torch.device("cuda") != torch.device("cuda:0")`` and
``torch.device("cpu:0") != torch.device("cpu")``, while tensors report ``cuda:N`` and ``cpu``.
Everything that compares devices goes through :func:`tokenlake.validate.canonical_device`; on
CPU the ``cpu:0`` / ``cpu`` pair stands for SGLang's ``cuda`` / ``cuda:0``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenlake.engines.client.prefix_attention import PrefixAttention
from tokenlake.errors import InvalidArgumentError
from tokenlake.validate import canonical_device, check_tensor


def test_canonical_device_names_devices_as_tensors_do():
    assert torch.device("cpu:0") != torch.device("cpu")  # why the helper exists
    assert canonical_device("cpu:0") == canonical_device("cpu") == torch.zeros(1).device
    assert canonical_device("cuda:1") == torch.device("cuda:1") != canonical_device("cuda:0")
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    assert canonical_device("cuda") == canonical_device(f"cuda:{current}")
    assert canonical_device("meta") == torch.empty(1, device="meta").device


def test_check_tensor_accepts_another_name_of_its_device():
    t = torch.zeros(2)
    assert check_tensor("t", t, device="cpu:0") is t
    with pytest.raises(InvalidArgumentError, match="t: expected a tensor on cuda:1"):
        check_tensor("t", t, device="cuda:1")


@pytest.mark.parametrize("one_each", [True, False])
def test_prefix_attention_bound_on_cpu_0_runs_on_cpu_tensors(one_each):
    gen = torch.Generator().manual_seed(0)
    t, h_q, h_kv, d = 3, 4, 2, 8
    offsets = np.arange(t + 1) if one_each else np.array([0, 2, 3])
    q = torch.randn((t, h_q, d), generator=gen)
    k, v = (torch.randn((t, h_kv, d), generator=gen) for _ in range(2))
    o_p, lse_p = torch.randn((t, h_q, d), generator=gen), torch.randn((t, h_q), generator=gen)
    results = []
    for device in ("cpu:0", "cpu"):
        bound = PrefixAttention.bind(offsets, (t, h_q, d), h_kv, torch.float32, device=device)
        assert bound.device == torch.device("cpu")
        results.append(bound(q, k, v, o_p, lse_p))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    bound = PrefixAttention.bind(offsets, (t, h_q, d), h_kv, torch.float32, device="cpu:0")
    with pytest.raises(InvalidArgumentError, match="q: expected a tensor on cpu"):
        bound(q.to("meta"), k, v, o_p, lse_p)
