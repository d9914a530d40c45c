"""Fixtures of the model tests: seeded random checkpoints saved by ``transformers`` (built
once per session) and their reference generations (cached by prompt)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("transformers")

from driver import make_checkpoint, reference_generate  # noqa: E402


class Checkpoints:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[str, Path] = {}
        self._refs: dict[tuple, tuple] = {}

    def path(self, arch: str) -> Path:
        if arch not in self._paths:
            self._paths[arch] = make_checkpoint(self.root / arch, arch, seed=len(self._paths))
        return self._paths[arch]

    def reference(self, arch: str, prompt, num_new: int):
        key = (arch, tuple(prompt), num_new)
        if key not in self._refs:
            self._refs[key] = reference_generate(self.path(arch), prompt, num_new)
        return self._refs[key]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))
