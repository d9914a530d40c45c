"""SGLang backend tests. They skip when sglang is not installed (``make test`` installs it).

SGLang's attention modules import ``torchvision`` (through its multimodal configs), which
cannot be installed next to CPU torch (pip swaps torch for a CUDA build); nothing these tests
run uses it, so a stand-in for it is installed here, from the CPU-test support folder
(``cpu_support/``, which also serves the real SGLang servers these tests start).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "cpu_support"))

import torchvision_stub  # noqa: E402, F401  (installs the stand-in before any sglang import)
