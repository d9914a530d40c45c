"""Logging set-up for TokenLake's commands: standard ``logging`` to stderr at one level.

Library code only logs (``logging.getLogger(__name__)``); the commands (``tokenlake ...``,
``python -m tokenlake.serve``, ``python -m tokenlake.benchmarks.*``) call :func:`setup_logging` once.
"""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str = "info") -> None:
    """Log records at ``level`` and above (one of :data:`LOG_LEVELS`) to stderr."""
    if level not in LOG_LEVELS:
        raise ValueError(f"level: expected one of {LOG_LEVELS}, got {level!r}")
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)
