"""The wall-clock bench's fixed SLO: measured once per model and workload by a calibrate step
(``tokenlake bench wallclock --calibrate``) and kept in a JSON file, or given with flags
(``--ttft-slo-ms``, ``--tpot-slo-ms``); every invocation prints the one it uses and where it
came from. A missing entry is measured at first use and written, so later runs compare
against the same thresholds whatever the machine's load that day.

The file maps ``model`` → ``workload`` → ``{"ttft_s", "tpot_s", "solo_e2e_s"}`` (the last:
the batch-size-1 end-to-end seconds, from which the search's first rate is derived).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tokenlake.benchmarks.wallclock.measure import SLO_SCALE, Slo

DEFAULT_PATH = Path("results/wallclock_slo.json")
ASSUMED_TOKENS = 8  # a solo request's tokens when only flags give the SLO (for the first rate)


def read(path: Path) -> dict:
    """The file's entries (empty when it does not exist); ``ValueError`` when malformed."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of models")
    return data


def entry(data: dict, model: str, workload: str) -> tuple[Slo, float] | None:
    found = data.get(model, {}).get(workload)
    if found is None:
        return None
    try:
        slo = Slo(float(found["ttft_s"]), float(found["tpot_s"]))
        solo = float(found["solo_e2e_s"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"SLO file entry {model}/{workload}: {e!r}") from None
    if not (slo.ttft_s > 0 and slo.tpot_s > 0 and solo > 0):
        raise ValueError(f"SLO file entry {model}/{workload}: expected positive seconds")
    return slo, solo


def write(path: Path, model: str, workload: str, slo: Slo, solo_e2e_s: float) -> None:
    data = read(path)
    data.setdefault(model, {})[workload] = {**slo.as_dict(), "solo_e2e_s": round(solo_e2e_s, 6)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def resolve(
    args, model: str, workload: str, measure: Callable[[], tuple[Slo, float]]
) -> tuple[Slo, float, str]:
    """The SLO of ``model`` / ``workload``, its solo end-to-end seconds and a line saying
    where they came from: the flags, else the file (``args.calibrate``: measured again and
    written), else measured now and written."""
    if args.ttft_slo_ms and args.tpot_slo_ms:
        slo = Slo(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
        solo = (slo.ttft_s + slo.tpot_s * ASSUMED_TOKENS) / SLO_SCALE
        return slo, solo, "given by --ttft-slo-ms / --tpot-slo-ms"
    path = args.slo_file
    if not args.calibrate:
        found = entry(read(path), model, workload)
        if found is not None:
            return *found, f"fixed, from {path}"
    slo, solo = measure()
    write(path, model, workload, slo, solo)
    how = "calibrated now" if args.calibrate else "measured now (first use)"
    return slo, solo, f"{how}: {SLO_SCALE:g}x batch-size-1 at idle, written to {path}"
