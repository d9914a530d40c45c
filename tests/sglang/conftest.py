"""SGLang backend tests. They skip when sglang is not installed (``make test`` installs it).

SGLang's attention modules import ``torchvision`` (through its multimodal configs), which
cannot be installed next to CPU torch (pip swaps torch for a CUDA build); nothing these tests
run uses it, so a stub stands in for it here, and only here.
"""

from __future__ import annotations

import torchvision_stub  # noqa: F401  (installs the stub before any sglang import)
