"""What one drafter proposal costs, two commits side by side.

A proposal of n tokens is the drafter's block forward over n + 1 rows, the candidate pass
and the final stage's conditional tables, then the serial chain
(``DrafterProposer.propose``). On fast CPUs this latency is paid in every cycle that
drafts, before the verification knows whether the drafter was right, so it decides
whether drafting pays as much as the drafter's acceptance does (docs/decisions.md).

Each commit runs in its own process (``PYTHONPATH`` = that checkout's ``src``),
alternating, ``--rounds`` times, with the default target and shipped DSpine drafter on
``--threads`` threads; the median wall time of ``--reps`` proposals per n is reported,
with a plain one-token target step for scale and the machine stamp. The kernels are the
ones the engine picks here (``--head-kernel auto``: the cached per-machine measurement,
the same for both commits) unless ``--head-kernel`` forces one.

    python benchmarks/proposal_latency.py --old /path/to/old/checkout --new . \\
        --out benchmarks/drafter-diagnosis/proposal-latency-<cpu-class>-<date>.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

CHILD = r'''
import json, statistics, sys, time, torch
threads, reps, kernel = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(threads)
from dspine.build import build_engine
from dspine.config import SamplingConfig, SpeculativeConfig
target, eng = build_engine(SpeculativeConfig(proposer="drafter", head_kernel=kernel))
prop = eng.proposer
V, ctx = target.vocab_size, 256
ids = (torch.arange(1, ctx + 1) * 7919 % (V - 1) + 1)[None]
cache = target.new_cache()
out = target.forward(ids, cache, list(prop.feature_layers), logits_to_keep=1)
state = prop.new_state(ids[0].tolist())
prop.commit(state, out.features[0], 0)
res = {}
for n in (1, 2, 3, 4, 8, 15):
    ts = []
    for r in range(reps + 3):
        t0 = time.perf_counter()
        prop.propose(state, int(ids[0, -1]), ctx, n, SamplingConfig(), None)
        if r >= 3:
            ts.append(time.perf_counter() - t0)
    res[f"propose n={n}"] = statistics.median(ts) * 1e3
ts = []
for r in range(max(reps // 4, 1) + 2):
    t0 = time.perf_counter()
    target.forward(ids[:, -1:], cache, list(prop.feature_layers))
    ts.append(time.perf_counter() - t0)
    cache.rollback(ctx)
res["target plain step"] = statistics.median(ts[2:]) * 1e3
res["kernels"] = prop.kernel_info()
print(json.dumps(res))
'''


def run_child(src: Path, threads: int, reps: int, kernel: str) -> dict:
    from side_by_side import run_json

    return run_json("proposal_latency", CHILD, src, [str(threads), str(reps), kernel])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="checkout of the earlier commit (its src/ is used)")
    ap.add_argument("--new", default=".", help="checkout of the later commit (default: this one)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of each checkout")
    ap.add_argument("--reps", type=int, default=200, help="proposals timed per n and run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head-kernel", default="auto", help="auto (the engine's measured choice) or a kernel name")
    ap.add_argument("--out", default=None, help="JSON to write (default: print only)")
    a = ap.parse_args(argv)
    for name in ("rounds", "reps", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
    sides = {"old": Path(a.old).resolve(), "new": Path(a.new).resolve()}
    from side_by_side import alternate, commit_of

    commits = {k: commit_of(v) for k, v in sides.items()}
    load0 = os.getloadavg()[0]
    runs = alternate(sides, a.rounds, lambda src: run_child(src, a.threads, a.reps, a.head_kernel),
                     show=lambda r: {s: round(v, 3) for s, v in r.items() if s != "kernels"})
    keys = [s for s in runs["old"][0] if s != "kernels"]
    med = {k: {s: round(statistics.median(x[s] for x in v), 4) for s in keys} for k, v in runs.items()}
    sys.path.insert(0, str(sides["new"] / "src"))
    from dspine.tune.machine import describe

    result = {"what": "median wall time (ms) of one DrafterProposer.propose of n tokens (greedy; default target, "
                      "shipped DSpine drafter), and of a plain one-token target step for scale",
              "machine": describe("cpu"), "threads": a.threads,
              "load_1m_start": round(load0, 2), "load_1m_end": round(os.getloadavg()[0], 2),
              "date": time.strftime("%Y-%m-%d"), "commits": commits, "head_kernel": a.head_kernel,
              "kernels": {k: v[0]["kernels"] for k, v in runs.items()}, "ms": med,
              "new_over_old": {s: round(med["new"][s] / med["old"][s], 3) for s in keys}}
    from side_by_side import report

    report(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
