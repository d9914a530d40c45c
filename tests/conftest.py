"""Options of the robustness suite: ``--fuzz-calls N`` and ``--fuzz-seed S`` turn the API
fuzzer (tests/tokenlake/test_fuzz_api.py) into a longer soak. And one torch thread in the test
process (see :func:`pytest_configure`)."""

from __future__ import annotations


def pytest_addoption(parser) -> None:
    group = parser.getgroup("tokenlake robustness")
    group.addoption("--fuzz-calls", type=int, default=2500, help="API fuzzer: calls to make")
    group.addoption("--fuzz-seed", type=int, default=0, help="API fuzzer: random seed")


def pytest_configure(config) -> None:
    """One intra-op torch thread in the test process: its tensors are tiny, and on a busy
    2-core machine torch's worker threads spin waiting for each other (the concurrent-
    iterations state machine took 63 s and 17 s of CPU with two threads, 27 s and 7 s with
    one, at load 25). Processes the tests start keep their own settings."""
    import torch

    torch.set_num_threads(1)
