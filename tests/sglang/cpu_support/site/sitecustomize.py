"""Imported by every Python process that has this folder on ``PYTHONPATH`` (SGLang's spawned
scheduler and detokenizer processes included): installs the torchvision stand-in.
CPU-test support only (tests/sglang/cpu_support)."""

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torchvision_stub  # noqa: E402, F401
