"""Plots of the goodput harness, like the paper's Fig. 9-11: latency and SLO attainment vs rate,
per-instance load over time, hit rate vs cache size. Needs matplotlib; without it, says so."""

from __future__ import annotations

from pathlib import Path


def plot_all(out: Path, summary: dict) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping plots (pip install matplotlib)")
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
    systems = summary.get("systems") or {}
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
        fig.suptitle(f"{name}: per-instance cache access load at {r['ref_rate']:.3g} req/s")
        paths.append(_save(fig, out / f"{name}_load.png"))
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


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {path}")
    return path
