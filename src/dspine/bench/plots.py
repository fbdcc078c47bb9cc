"""The plots of a benchmark summary: speedup, per-position acceptance and cycle-time split.

:func:`make_plots` writes ``speedup.png``, ``acceptance.png`` and ``cycle_split.png``
(matplotlib, imported when called) beside :mod:`dspine.bench.report`'s ``report.md``.
"""
from __future__ import annotations

import statistics
from pathlib import Path


def make_plots(summary: dict, out_dir: Path) -> list[str]:
    """speedup.png, acceptance.png (concurrency 1), cycle_split.png (a bar per mode and
    concurrency); returns file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [g for g in summary["results"] if g["concurrency"] == 1]
    if not res:
        return []
    settings = list(dict.fromkeys(g["setting"] for g in res))
    workloads = list(dict.fromkeys(g["workload"] for g in res))
    modes = [m for m in summary["modes"] if m != "ar"]
    files = []
    # 1. speedup per workload and mode
    fig, axes = plt.subplots(1, len(settings), figsize=(max(6, 1.6 * len(workloads)) * len(settings), 4), squeeze=False)
    for ax, s in zip(axes[0], settings):
        width = 0.8 / max(1, len(modes))
        for i, m in enumerate(modes):
            xs, ys, lo, hi = [], [], [], []
            for j, w in enumerate(workloads):
                g = next((g for g in res if (g["setting"], g["workload"], g["mode"]) == (s, w, m)), None)
                if g and g.get("speedup"):
                    sp = g["speedup"]
                    xs.append(j + (i - (len(modes) - 1) / 2) * width)
                    ys.append(sp["median"])
                    lo.append(sp["median"] - sp["min"])
                    hi.append(sp["max"] - sp["median"])
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=m)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel("speedup over ar (tok/s, median, min–max)")
        ax.set_title(f"speedup ({s})")
        if ax.get_legend_handles_labels()[0]:  # a run without `ar` has no speedup bars
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup.png", dpi=100)
    plt.close(fig)
    files.append("speedup.png")
    # 2. per-position acceptance (pooled over workloads)
    fig, ax = plt.subplots(figsize=(6, 4))
    drew = False
    for s in settings:
        for m in modes:
            gs = [g for g in res if g["setting"] == s and g["mode"] == m and g.get("acceptance_per_position")]
            if not gs:
                continue
            L = max(len(g["acceptance_per_position"]) for g in gs)
            ys = []
            for k in range(L):
                vals = [g["acceptance_per_position"][k] for g in gs
                        if len(g["acceptance_per_position"]) > k and g["acceptance_per_position"][k] is not None]
                ys.append(statistics.mean(vals) if vals else float("nan"))
            ax.plot(range(1, L + 1), ys, marker="o", label=f"{m} ({s})")
            drew = True
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(position k accepted | drafted)")
    ax.set_ylim(-0.03, 1.05)
    ax.set_title("per-position acceptance (mean over workloads)")
    if drew:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance.png", dpi=100)
    plt.close(fig)
    files.append("acceptance.png")
    # 3. cycle-time split per output token (mean over workloads, first setting; one bar
    #    per mode and concurrency)
    res = summary["results"]
    concs = sorted({g["concurrency"] for g in res})
    bars = [(m, c) for c in concs for m in summary["modes"]]
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(bars)), 4))
    parts = ["draft", "final_stage", "verify", "prefill_stall", "overhead", "cycle_unsplit"]
    colors = dict(zip(parts, ["#4c72b0", "#dd8452", "#55a868", "#937860", "#8c8c8c", "#c44e52"]))
    s0 = settings[0]
    for i, (m, conc) in enumerate(bars):
        gs = [g for g in res if g["setting"] == s0 and g["mode"] == m and g["concurrency"] == conc
              and g.get("cycle_split_s") and g.get("tau_pooled")]
        if not gs:
            continue
        bottom = 0.0
        for p in parts:
            vals = [1000 * g["cycle_split_s"][p] / g["tau_pooled"] for g in gs if p in g["cycle_split_s"]]
            if not vals:
                continue
            v = statistics.mean(vals)
            ax.bar(i, v, bottom=bottom, color=colors[p], label=p)
            bottom += v
    ax.set_xticks(range(len(bars)), [m if len(concs) == 1 else f"{m}\nc={c}" for m, c in bars])
    ax.set_ylabel("ms per output token (cycle time / tau)")
    ax.set_title(f"cycle-time split ({s0}, mean over workloads)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "cycle_split.png", dpi=100)
    plt.close(fig)
    files.append("cycle_split.png")
    return files
