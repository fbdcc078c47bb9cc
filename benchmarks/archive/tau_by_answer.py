"""copies copy-heavy check: pooled τ of a `dspine bench` run per workload, with the
``tools`` requests split by what the target answered: a function call (JSON or Python
call syntax that :func:`dspine.bench.checks.parse_tool_calls` reads, the copy-heavy case
the issue names) or prose (the 135M default target often ignores the schema and explains
instead; its answer then copies little).

τ = emitted tokens / cycles pooled over the requests of a group (``emitted_sum`` and
``cycles`` of each result row), with the split per proposer source from ``sources``.
Run the bench with full blocks so that τ is the proposer's, not the cost policy's:

    dspine bench --modes dspine --verify-policy fixed --tree-budget 0 \\
        --workloads tools,edit,multifile --limit 16 --settings greedy --repeats 1 --out DIR
    python benchmarks/archive/tau_by_answer.py chain=DIR/results.jsonl tree16=DIR2/results.jsonl \
        --out benchmarks/archive/copy-heavy/tau.json --plot benchmarks/archive/copy-heavy/tau.png

Each positional argument is ``LABEL=results.jsonl`` (one configuration per label, e.g. chains
and draft trees; the results of several runs of one configuration may be concatenated);
the plot shows pooled τ per workload and label beside the goal of 3.0.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def pooled(rows: list[dict]) -> dict:
    """τ, requests, cycles and the per-source τ of ``rows`` (bench result rows)."""
    cyc = sum(r["cycles"] for r in rows)
    emitted = sum(r["emitted_sum"] for r in rows)
    src: dict[str, dict] = {}
    for r in rows:
        for name, d in (r.get("sources") or {}).items():
            a = src.setdefault(name, {"cycles": 0, "emitted": 0})
            a["cycles"] += d.get("cycles", 0)
            a["emitted"] += d.get("emitted", 0)
    return {"requests": len(rows), "cycles": cyc, "tau": round(emitted / max(1, cyc), 3),
            "per_request_tau": sorted(round(r["tau"], 2) for r in rows),
            "sources": {k: {**v, "tau": round(v["emitted"] / max(1, v["cycles"]), 3)}
                        for k, v in sorted(src.items()) if v["cycles"]}}


def analyse(path: Path, mode: str) -> dict:
    """Pooled τ per workload of one bench run (``tools`` also split into call / prose)."""
    from dspine.bench.checks import parse_tool_calls

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["mode"] == mode and not r.get("warmup") and not r.get("failed")]
    if not rows:
        raise SystemExit(f"{path}: no finished {mode} requests")
    out: dict = {"results": str(path), "mode": mode,
                 "mode_info": rows[0].get("mode_info"), "setup": rows[0].get("setup"), "workloads": {}}
    for w in sorted({r["workload"] for r in rows}):
        ws = [r for r in rows if r["workload"] == w]
        out["workloads"][w] = pooled(ws)
        if w == "tools":
            calls = [r for r in ws if parse_tool_calls(r["text"])]
            prose = [r for r in ws if not parse_tool_calls(r["text"])]
            out["workloads"]["tools:call"] = pooled(calls) if calls else None
            out["workloads"]["tools:prose"] = pooled(prose) if prose else None
    return out


def plot(runs: dict[str, dict], path: Path, goal: float = 3.0) -> None:
    """Grouped bars: pooled τ per workload (x) and run label (bars), the goal as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w for w in next(iter(runs.values()))["workloads"] if all(r["workloads"].get(w) for r in runs.values())]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(runs)
    for i, (label, r) in enumerate(runs.items()):
        xs = [k + i * width for k in range(len(names))]
        ys = [r["workloads"][w]["tau"] for w in names]
        ax.bar(xs, ys, width, label=label)
        for x, y in zip(xs, ys):
            ax.text(x, y + 0.05, f"{y:.2f}", ha="center", fontsize=7)
    ax.axhline(goal, color="k", ls="--", lw=0.8, label=f"goal {goal}")
    ax.set_xticks([k + width * (len(runs) - 1) / 2 for k in range(len(names))], names)
    ax.set_ylabel("pooled τ (tokens per cycle)")
    ax.set_title("DSpine + copies (hybrid), full blocks, greedy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=results.jsonl of a dspine bench run")
    ap.add_argument("--mode", default="dspine")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    runs = {}
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"{spec!r}: give each run as LABEL=results.jsonl")
        runs[label] = analyse(Path(path), args.mode)
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1) + "\n")
    if args.plot:
        plot(runs, args.plot)
    for label, out in runs.items():
        print(f"{label}\nworkload     | requests | cycles | tau   | per source")
        for w, d in out["workloads"].items():
            if d:
                srcs = ", ".join(f"{k} {v['tau']} ({v['cycles']})" for k, v in d["sources"].items())
                print(f"{w:12} | {d['requests']:8} | {d['cycles']:6} | {d['tau']:5} | {srcs}")


if __name__ == "__main__":
    main()
