"""The wheels the device check carries, packed to fit one device call.

A device call carries at most 64 MiB: the tracked tree plus whatever it names. FlashInfer's wheel
alone is 59 MiB (zip-deflated JIT sources), so the three wheels the device lacks
(flashinfer-python, apache-tvm-ffi, pyzmq) travel as one ``.tar.xz``: FlashInfer's wheel is
re-zipped *stored* (the same files and RECORD, no per-file deflate), so that xz compresses across
all its sources at once (427 MiB of text). Nothing is pruned: every JIT source stays, so any
module FlashInfer builds on the device finds its files. The other two wheels go in unchanged.

``build`` (``make gpu-wheels``) writes the payload and prints its size with the travelling tree's;
``unpack`` (the device check's install step) restores the wheels that ``pip install --no-index
--no-deps --target`` then installs. Standard library only: the device has no tokenlake yet when
it unpacks.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

__all__ = [
    "build",
    "unpack",
    "imports",
    "travelling_tree_bytes",
    "CALL_LIMIT_BYTES",
    "BUDGET_BYTES",
]

CALL_LIMIT_BYTES = 64 << 20  # what one device call carries: tree + carried paths
BUDGET_BYTES = 48 << 20  # what the check may use of it: 16 MiB stay free for the tree to grow
WHEEL_NAMES = ("flashinfer_python", "apache_tvm_ffi", "pyzmq")
XZ_PRESET = 2  # 21 MiB in ~7 s on one core; preset 6 saves 4 MiB for 8x the time


def _wheels(wheels_dir: Path) -> list[Path]:
    """Exactly one wheel of each needed project in ``wheels_dir`` (two versions would stop
    the install on the device)."""
    found = []
    for name in WHEEL_NAMES:
        matches = sorted(wheels_dir.glob(f"{name}-*.whl"))
        if len(matches) != 1:
            raise FileNotFoundError(
                f"wheels_dir: expected one {name} wheel in {wheels_dir}, got "
                f"{[m.name for m in matches]} (run `make gpu-wheels`)"
            )
        found.append(matches[0])
    return found


def _stored_copy(wheel: Path) -> bytes:
    """The wheel as a zip of the same members, uncompressed (a valid wheel: RECORD's hashes
    are of the files' contents, which do not change)."""
    out = io.BytesIO()
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            copy = zipfile.ZipInfo(info.filename, info.date_time)
            copy.external_attr = info.external_attr
            dst.writestr(copy, src.read(info), zipfile.ZIP_STORED)
    return out.getvalue()


def build(wheels_dir: Path, payload: Path, preset: int = XZ_PRESET) -> Path:
    """Pack the wheels of ``wheels_dir`` into ``payload`` (a ``.tar.xz``); returns it."""
    payload.parent.mkdir(parents=True, exist_ok=True)
    partial = payload.with_name(payload.name + ".partial")
    with tarfile.open(partial, "w:xz", preset=preset) as tar:
        for wheel in _wheels(wheels_dir):
            data = (
                _stored_copy(wheel) if wheel.name.startswith("flashinfer") else wheel.read_bytes()
            )
            info = tarfile.TarInfo(wheel.name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    partial.replace(payload)
    return payload


def unpack(payload: Path, dest: Path) -> list[Path]:
    """Extract the payload's wheels into ``dest``; returns their paths. Only plain ``.whl``
    members at the top level are accepted."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    with tarfile.open(payload, "r:xz") as tar:
        for member in tar.getmembers():
            if not (member.isfile() and "/" not in member.name and member.name.endswith(".whl")):
                raise ValueError(f"payload: unexpected member {member.name!r} in {payload}")
            tar.extract(member, dest, filter="data")
            wheels.append(dest / member.name)
    return wheels


def imports(site: Path, names: list[str]) -> dict:
    """Import each module; its version and file, or the error. ``ok``: every one imported,
    from ``site`` (not from a copy installed elsewhere)."""
    import importlib

    found, ok = {}, True
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # report every module, whatever fails
            found[name], ok = {"error": f"{type(e).__name__}: {e}"[:300]}, False
            continue
        path = Path(module.__file__).resolve()
        inside = path.is_relative_to(site.resolve())
        found[name] = {"version": getattr(module, "__version__", None), "from_site": inside}
        ok = ok and inside
    return {"imports": found, "ok": ok}


def travelling_tree_bytes(root: Path) -> int:
    """Bytes of what a device call sends besides carried paths: tracked files and untracked
    files git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout  # fmt: skip
    paths = {p for p in listed.decode().split("\0") if p}
    return sum((root / p).stat().st_size for p in paths if (root / p).is_file())


def report(root: Path, payload: Path) -> dict:
    """Sizes in MiB and whether tree + payload stay inside :data:`BUDGET_BYTES`."""
    tree, packed = travelling_tree_bytes(root), payload.stat().st_size
    mib = 1 << 20
    return {
        "payload": str(payload.relative_to(root)) if payload.is_relative_to(root) else str(payload),
        "payload_mib": round(packed / mib, 2),
        "tree_mib": round(tree / mib, 2),
        "total_mib": round((tree + packed) / mib, 2),
        "budget_mib": BUDGET_BYTES // mib,
        "call_limit_mib": CALL_LIMIT_BYTES // mib,
        "fits": tree + packed <= BUDGET_BYTES,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="pack the wheels; print the sizes as one JSON line")
    b.add_argument("--wheels", type=Path, default=Path(".gpu-wheels"))
    b.add_argument("--payload", type=Path, default=Path(".gpu-payload/gpu-payload.tar.xz"))
    b.add_argument("--preset", type=int, default=XZ_PRESET)
    u = sub.add_parser("unpack", help="extract the wheels; print their paths")
    u.add_argument("payload", type=Path)
    u.add_argument("dest", type=Path)
    i = sub.add_parser("imports", help="import modules; print one JSON line")
    i.add_argument("site", type=Path)
    i.add_argument("names", nargs="+")
    args = p.parse_args(argv)
    if args.command == "imports":
        result = imports(args.site, args.names)
        print(json.dumps(result))
        return 0 if result["ok"] else 1
    if args.command == "unpack":
        for wheel in unpack(args.payload, args.dest):
            print(wheel)
        return 0
    root = Path(__file__).resolve().parents[2]
    payload = build(args.wheels, args.payload, args.preset).resolve()
    sizes = report(root, payload)
    print(json.dumps(sizes))
    return 0 if sizes["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
