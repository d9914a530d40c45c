"""What a ``tokenlake sglang-host`` leaves behind if it is killed (``kill -9``, a crash, the
machine's OOM killer): its instances' named shared memory segments, which only it removes.

Each running host keeps a run record beside its cluster secret,
``tokenlake-host-<port>.run.json`` (0600): its process (pid and start time, so a reused pid is
not taken for it) and the names of its segments. A host starting with a secret in the same
folder removes the segments of every record whose host is gone, then the record;
``tokenlake sglang-host --cleanup --secret-file FILE`` does only that. A host that stops
normally removes its segments and its record itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenlake.engines.transport.peers import LauncherId

SHM_DIR = Path("/dev/shm")
PATTERN = "tokenlake-host-*.run.json"


def run_record_path(secret_file: str, port: int) -> Path:
    return Path(secret_file).resolve().parent / f"tokenlake-host-{int(port)}.run.json"


def segment_names(cluster) -> list[str]:
    """The named shared memory segments of ``cluster``'s instances."""
    names = []
    for buffers in cluster.buffers:
        names.extend(str(n).lstrip("/") for n in (buffers.segment_names or {}).values())
    return names


def write_run_record(path: Path, names: list[str]) -> None:
    me = LauncherId.this_process()
    body = json.dumps({"pid": me.pid, "start_time": me.start_time, "segments": names})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(body)


def remove_stale_runs(directory: Path) -> list[str]:
    """Remove the segments (and records) of every host recorded in ``directory`` that is no
    longer running; returns the segment names removed."""
    removed = []
    for path in sorted(directory.glob(PATTERN)):
        try:
            record = json.loads(path.read_text())
            host = LauncherId(int(record["pid"]), record["start_time"])
            names = [str(n) for n in record["segments"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a record of ours (or being written): leave it
        if host.alive():
            continue
        for name in names:
            if not name.startswith("psm_") or "/" in name:
                continue  # only Python's shared memory names, never a path elsewhere
            try:
                (SHM_DIR / name).unlink()
                removed.append(name)
            except FileNotFoundError:
                pass
        path.unlink(missing_ok=True)
    return removed
