"""The bench workloads on two commits, side by side: `dspine bench` in alternating processes.

Runs ``dspine bench --modes ar,dspine --settings greedy`` (every workload, ``--limit``
prompts each, one repeat) with ``PYTHONPATH`` set to each checkout's ``src``, in the order old, new, new, old
(so a drift of the machine's load hits both alike), then compares per workload: the
defaults' speed over ``ar`` in the same process (median over prompts and runs), new over
old, and whether both commits gave the same token ids for every request (greedy: they must,
and the bench itself checks the defaults against ``ar``).

    python benchmarks/bench_old_vs_new.py --old /path/to/old/checkout --new . --limit 2 \
        --out benchmarks/bench-old-vs-new/<cpu-class>-<date>.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run(src: Path, out: Path, limit: int, max_new: int | None) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "dspine.cli", "bench", "--modes", "ar,dspine", "--workloads", "all",
           "--limit", str(limit), "--repeats", "1", "--settings", "greedy", "--out", str(out), "--no-plots"]
    if max_new:
        cmd += ["--max-new-tokens", str(max_new)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        cmd.remove("--no-plots")  # older commits may lack the option
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"bench with {src} failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if not r.get("warmup") and r.get("setting") == "greedy"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, type=Path)
    ap.add_argument("--new", default=Path("."), type=Path)
    ap.add_argument("--limit", type=int, default=2, help="prompts per workload")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-old-vs-new"))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    sides = {"old": a.old.resolve(), "new": a.new.resolve()}
    git = lambda p, *c: subprocess.run(["git", "-C", str(p), *c], capture_output=True, text=True).stdout.strip()  # noqa: E731
    commits = {k: git(v, "rev-parse", "--short", "HEAD") + (" (with local changes)" if git(v, "status", "--porcelain", "src") else "")
               for k, v in sides.items()}
    load0 = os.getloadavg()[0]
    recs: dict[str, list[dict]] = {"old": [], "new": []}
    for i, k in enumerate(("old", "new", "new", "old")):
        t0 = time.time()
        recs[k] += [dict(r, _run=i) for r in run(sides[k] / "src", a.work / f"{i}-{k}", a.limit, a.max_new_tokens)]
        print(f"run {i + 1}/4 ({k}) {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    sys.path.insert(0, str(sides["new"] / "src"))
    from dspine.tune.machine import describe

    def speedups(rs: list[dict]) -> dict[str, list[float]]:
        by = {}
        for r in rs:
            by.setdefault((r["_run"], r["workload"], r["prompt_id"]), {})[r["mode"]] = r
        out: dict[str, list[float]] = {}
        for (_, w, _), m in by.items():
            if "ar" in m and "dspine" in m and not m["ar"].get("failed") and not m["dspine"].get("failed"):
                out.setdefault(w, []).append(m["dspine"]["tokens_per_second"] / m["ar"]["tokens_per_second"])
        return out

    sp = {k: speedups(v) for k, v in recs.items()}
    ids = {k: {(r["workload"], r["prompt_id"], r["mode"]): r.get("output_ids") for r in v} for k, v in recs.items()}
    same = sum(1 for key, v in ids["new"].items() if ids["old"].get(key) == v)
    table = {w: {"old_dspine_over_ar": round(statistics.median(sp["old"][w]), 3),
                 "new_dspine_over_ar": round(statistics.median(sp["new"][w]), 3),
                 "new_over_old": round(statistics.median(sp["new"][w]) / statistics.median(sp["old"][w]), 3)}
             for w in sorted(sp["new"]) if w in sp["old"]}
    res = {"what": "dspine bench --modes ar,dspine on two commits in alternating processes (old, new, new, old); "
                   "per workload the median over prompts and runs of the defaults' tokens/s over ar's in the same "
                   "process", "machine": describe("cpu"), "date": time.strftime("%Y-%m-%d"), "commits": commits,
           "limit": a.limit, "load_1m_start": round(load0, 2), "load_1m_end": round(os.getloadavg()[0], 2),
           "workloads": table,
           "geomean_new_over_old": round(statistics.geometric_mean([t["new_over_old"] for t in table.values()]), 3),
           "same_ids": f"{same}/{len(ids['new'])}"}
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
