"""An instance's shared buffers as a named file in ``/dev/shm`` of its node, so every Ray
actor of that node (its own compute, query and transfer processes, and the other instances
placed there) maps the same memory; processes on other nodes never see it and reach the
instance over ``torch.distributed`` instead.

The file is created with mode 0600 by whichever process maps it first (all of them size it
alike, so the order does not matter) and removed at shutdown by :func:`remove_launch_files`,
which runs on every node of the launch.
"""

from __future__ import annotations

import glob
import os
import shutil

import torch

from tokenlake.engines.core.shared_buffers import InstanceBuffers
from tokenlake.errors import InvalidArgumentError

SHM_DIR = "/dev/shm"
PREFIX = "tokenlake-ray-"


def check_launch_id(launch_id: str) -> str:
    if not isinstance(launch_id, str) or not launch_id.isalnum() or not 4 <= len(launch_id) <= 32:
        raise InvalidArgumentError(f"launch_id: expected 4..32 letters/digits, got {launch_id!r}")
    return launch_id


def buffer_path(launch_id: str, instance_id: int) -> str:
    """Where instance ``instance_id``'s buffers live on its node."""
    return os.path.join(SHM_DIR, f"{PREFIX}{check_launch_id(launch_id)}-i{int(instance_id)}")


def map_instance(path: str, nbytes: dict[str, int]) -> InstanceBuffers:
    """Map (creating it if needed) the file at ``path`` as one instance's buffers of
    ``nbytes[name]`` bytes each, in :attr:`InstanceBuffers.NAMES` order. A new file reads as
    zeros."""
    total = sum(nbytes[name] for name in InstanceBuffers.NAMES)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if os.fstat(fd).st_size < total:
            os.ftruncate(fd, total)
    finally:
        os.close(fd)
    whole = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    raw, offset = {}, 0
    for name in InstanceBuffers.NAMES:
        raw[name] = whole[offset : offset + nbytes[name]]
        offset += nbytes[name]
    return InstanceBuffers(raw)


def remove_launch_files(launch_id: str) -> list[str]:
    """Delete this node's shared-memory files and secret directories of a launch; returns
    what was removed (mapped memory stays valid in processes that still hold it)."""
    launch_id = check_launch_id(launch_id)
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, f"{PREFIX}{launch_id}-*")):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    for path in glob.glob(os.path.join(secret_root(), f"{PREFIX}{launch_id}-*")):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def secret_root() -> str:
    """Where a node keeps the launch's secret file (a private directory inside)."""
    import tempfile

    return tempfile.gettempdir()


def write_secret(launch_id: str, key: bytes) -> str:
    """Create a private directory holding the cluster secret in a 0600 file on this node;
    returns the file's path (what actors are given; the key itself never is)."""
    import tempfile

    from tokenlake.engines.transport.auth import ClusterSecret

    directory = tempfile.mkdtemp(prefix=f"{PREFIX}{check_launch_id(launch_id)}-")
    path = os.path.join(directory, "secret")
    ClusterSecret(key).write(path)
    return path
