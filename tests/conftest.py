"""Options of the robustness suite: ``--fuzz-calls N`` and ``--fuzz-seed S`` turn the API
fuzzer (tests/control/test_fuzz_api.py) into a longer soak."""

from __future__ import annotations


def pytest_addoption(parser) -> None:
    group = parser.getgroup("tokenlake robustness")
    group.addoption("--fuzz-calls", type=int, default=2500, help="API fuzzer: calls to make")
    group.addoption("--fuzz-seed", type=int, default=0, help="API fuzzer: random seed")
