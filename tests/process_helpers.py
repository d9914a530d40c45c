"""Processes as ``/proc`` shows them, for tests that check that nothing outlives a server."""

from __future__ import annotations

import glob
import os


def gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (a zombie is gone too)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True


def descendants(pid: int) -> set[int]:
    """Every process under ``pid`` now."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(stat.split("/")[2]))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found
