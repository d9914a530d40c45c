"""Helpers of the multi-process data-plane tests, importable under a name of their own (every
test directory has a ``conftest.py``, so ``from conftest import ...`` picks whichever one was
loaded first when several directories are collected in one run).

The leak checks count only what this test process and its descendants made: other test
suites (and Ray launches) run on the same machine at the same time.
"""

from __future__ import annotations

import os
import re
from multiprocessing import resource_tracker

import numpy as np
from harness import tokens

import tokenlake as tl
from tokenlake.engines.dataplane_config import DataPlaneConfig

MAX_INSTANCES = 4
# the largest layout any test lays out on the shared cluster
SHAPE = tl.ModelShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
CAPACITY = tl.PoolConfig(SHAPE, MAX_INSTANCES, num_slots=64, segment_len=64)
CONFIG = DataPlaneConfig(max_q_rows=512, max_kv_rows=512, timeout_s=8.0)

# every descendant pid seen so far: a leak left by an engine that has exited since is still
# attributed to this run (pids of this run's processes are not reused while it watches them)
_seen_pids: set[int] = set()
_TORCH_SHM = re.compile(r"torch_(\d+)_")  # torch names its shared segments /torch_<pid>_<n>_<n>


def _parents() -> dict[int, int]:
    """Parent pid of every live, non-zombie process."""
    parent = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parent[int(entry)] = int(fields[1])
    return parent


def child_pids() -> set[int]:
    """Live (non-zombie) descendants of this process, but multiprocessing's helpers that live
    as long as it does (the resource tracker, the engines' fork server): started here first
    so that they are never counted as leaks."""
    from multiprocessing import forkserver

    from tokenlake.engines.clusters.launcher import process_context

    resource_tracker.ensure_running()
    process_context()  # the fork server's preload, before it starts
    forkserver.ensure_running()
    helpers = {resource_tracker._resource_tracker._pid, forkserver._forkserver._forkserver_pid}
    parent = _parents()
    out, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - out
        out |= frontier
    _seen_pids.update(out)
    return out - helpers


def _mapped_inodes(pid: int) -> set[int]:
    """Inodes of the /dev/shm files process ``pid`` maps (named semaphores, shared segments;
    by inode: glibc maps a semaphore under a temporary name before linking it to its own)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    out = set()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
            out.add(int(fields[4]))
    return out


def shm_entries() -> set[str]:
    """The /dev/shm entries this process and its descendants made: torch's segments by the
    pid in their name, anything else (multiprocessing's semaphores) by who maps it. Another
    suite's entries, or a Ray launch's ``tokenlake-ray-*`` buffers, are not counted."""
    ours = {os.getpid()} | child_pids() | _seen_pids
    inodes = set().union(*(_mapped_inodes(pid) for pid in ours))
    out = set()
    for entry in os.scandir("/dev/shm"):
        m = _TORCH_SHM.match(entry.name)
        try:
            mapped = entry.inode() in inodes
        except OSError:  # removed meanwhile
            continue
        if mapped or (m and int(m[1]) in ours):
            out.add(entry.name)
    return out


def warm_up(h, names: str, seed: int) -> dict[str, np.ndarray]:
    """One request per letter of ``names``, multi-segment prompts (seeds from ``seed``),
    each prefilled and checked exact; their token ids by name."""
    ids = {r: tokens(seed + k, 16 * 7 + 3) for k, r in enumerate(names)}
    for r in ids:
        assert h.step([[tl.Chunk(r, ids[r], 0)]]) <= h.tolerance
    return ids


def decode_batch(h, ids: dict[str, np.ndarray], token: int) -> list[tl.Chunk]:
    """Append ``token`` to every request of ``ids``: one decode chunk each."""
    for r in ids:
        ids[r] = np.append(ids[r], token)
    return [tl.Chunk(r, ids[r], h.pool.num_stored_tokens(r)) for r in sorted(ids)]
