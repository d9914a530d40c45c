"""Plots of the goodput harness, like the paper's Fig. 9-11: SLO attainment vs rate (every run of
the goodput bisections), hit rate and load CV per system, latency vs rate, per-instance load
over time, hit rate vs cache size. Needs matplotlib; without it, says so."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def plot_all(out: Path, summary: dict) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed: skipping plots (pip install matplotlib)")
        return []
    name, paths = summary["workload"], []
    if summary.get("sweep"):
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
        keys = ("input_token_latency_ms", "output_token_latency_ms", "slo_attainment")
        labels = ("input token latency (ms)", "output token latency (ms)", "SLO attainment")
        for s, pts in summary["sweep"].items():
            rates = [p["rate"] for p in pts]
            for ax, key in zip(axes, keys, strict=True):
                ax.plot(rates, [p[key] for p in pts], marker="o", label=s)
        for ax, label in zip(axes, labels, strict=True):
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
        axes[0].set_yscale("log")
        axes[1].set_yscale("log")
        axes[2].axhline(0.9, color="gray", ls="--", lw=0.8)
        axes[2].legend(fontsize=7)
        fig.suptitle(f"{name}: latency vs rate")
        paths.append(_save(fig, out / f"{name}_latency.png"))
    systems = {s: r for s, r in (summary.get("systems") or {}).items() if "unresolved" not in r}
    if systems:
        paths += _goodput_plots(plt, out, name, systems)
    with_load = {s: r for s, r in systems.items() if r.get("loads")}
    if with_load:
        fig, axes = plt.subplots(
            1, len(with_load), figsize=(3 * len(with_load), 2.8), squeeze=False
        )
        for ax, (s, r) in zip(axes[0], with_load.items(), strict=True):
            loads = list(zip(*r["loads"], strict=True))
            for i, series in enumerate(loads):
                ax.plot(r["load_times"], series, lw=0.8, label=f"inst {i}")
            ax.set_title(f"{s}\nCV {r['load_cv']:.0%}", fontsize=8)
            ax.set_xlabel("time (s)")
        axes[0][0].set_ylabel("KV tokens read / window")
        fig.suptitle(f"{name}: per-instance cache access load at each system's own goodput")
        paths.append(_save(fig, out / f"{name}_load.png"))
    if summary.get("replay"):
        replay = summary["replay"]
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
        keys = ("slo_attainment", "hit_rate", "load_cv")
        for ax, key, label in zip(
            axes, keys, ("SLO attainment", "hit rate", "load CV"), strict=True
        ):
            ax.bar(list(replay), [r[key] for r in replay.values()])
            ax.set_ylabel(label)
            ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        fig.suptitle(f"{name}: replay at the trace's own timing")
        paths.append(_save(fig, out / f"{name}_replay.png"))
    if summary.get("cache"):
        fig, ax = plt.subplots(figsize=(4, 3))
        for s, pts in summary["cache"].items():
            ax.plot([p["fraction"] for p in pts], [p["hit_rate"] for p in pts], marker="o", label=s)
        ax.set_xlabel("KV capacity (fraction of HBM-derived)")
        ax.set_ylabel("hit rate")
        ax.legend(fontsize=7)
        ax.set_title(f"{name}: hit rate vs cache size")
        paths.append(_save(fig, out / f"{name}_hit_vs_cache.png"))
    return paths


def _goodput_plots(plt, out: Path, name: str, systems: dict) -> list[Path]:
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for s, r in systems.items():
        pts = sorted(
            (rate, a)
            for _, knob, rate, a in r["points"]
            if knob == r.get("knob", str(r["prefill_tokens"]))
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=0.8, label=s)
    ax.axhline(0.9, color="gray", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.legend(fontsize=7)
    ax.set_title(f"{name}: SLO attainment vs rate (all seeds, best prefill setting)", fontsize=9)
    paths = [_save(fig, out / f"{name}_attainment.png")]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    names = list(systems)
    med = [systems[s]["p90_goodput"] for s in names]
    err = [
        [m - systems[s]["p90_goodput_min"] for s, m in zip(names, med, strict=True)],
        [systems[s]["p90_goodput_max"] - m for s, m in zip(names, med, strict=True)],
    ]
    axes[0].bar(names, med, yerr=err, capsize=3)
    axes[0].set_ylabel("P90 goodput (req/s), min-max")
    axes[1].bar(names, [systems[s]["hit_rate"] for s in names])
    axes[1].set_ylabel("hit rate")
    axes[2].bar(names, [systems[s]["load_cv"] for s in names])
    axes[2].set_ylabel("load CV")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.suptitle(f"{name}: goodput, and hit rate / load CV at each system's own goodput")
    paths.append(_save(fig, out / f"{name}_systems.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt

    plt.close(fig)
    log.info("wrote %s", path)
    return path
