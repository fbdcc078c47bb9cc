"""Per-cycle Python overhead of the engine, two commits side by side.

The target is a tiny random llama (hidden 64, 2 layers) and the proposer copies a known
continuation, every third proposal wrong (no drafter forward), so a cycle's wall time is
Python: the tiny HF model's forward (most of it, ~1.5-2 ms on 2-core EPYCs) and the
engine's own planning, controller, verification, commit, emit and stop detection, reported
apart as "(engine only)": the wall time minus the time inside the target model's ``forward``. Each commit runs in its own
process (``PYTHONPATH`` = that checkout's ``src``), alternating, ``--rounds`` times; the
median per-cycle time of each setting is reported, with the machine stamp.

    python benchmarks/engine_overhead.py --old /path/to/old/checkout --new . \
        --out benchmarks/engine-overhead/<cpu-class>-<date>.json

Settings: one request with the fixed controller, one with the cost controller (a synthetic
cost curve, so nothing is measured), and a batch of four with the cost controller.
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
import json, sys, time, torch
torch.set_num_threads(1)
from dspine.config import SamplingConfig
from dspine.core.engine import Engine
from dspine.core.batch import BatchEngine
from dspine.proposers.base import Proposal, Proposer
from dspine.target.adapter import load_target
try:
    from dspine.control.cost_curve import CostCurve
except ImportError:  # before the controllers shared an estimator
    from dspine.control.policy import CostCurve
from dspine.control.policy import CostModelPolicy

class Known(Proposer):
    feature_layers = [0]
    needs_features = False
    def __init__(self, refs, block_size=8):
        self.refs, self.block_size, self.k = refs, block_size, 0
    def new_state(self, prompt_ids):
        return list(prompt_ids) + list(self.refs[tuple(prompt_ids)])
    def propose(self, state, anchor, anchor_pos, n, sampling, gen):
        self.k += 1
        toks = [state[anchor_pos + 1 + i] if anchor_pos + 1 + i < len(state) else 1 for i in range(n)]
        if n > 2 and self.k % 3 == 0:
            toks[2] = (toks[2] + 1) % 256 or 1
        return Proposal(torch.tensor(toks, dtype=torch.long))

t = load_target("random:llama", vocab_size=256, seed=1, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
t.eos_token_ids = set()
fwd_s = [0.0]  # wall time inside the target model's forward: not the engine's own
_fwd = t.model.forward
def _timed_forward(*a, **k):
    t0 = time.perf_counter()
    try:
        return _fwd(*a, **k)
    finally:
        fwd_s[0] += time.perf_counter() - t0
t.model.forward = _timed_forward  # what the single and the batched paths both call
prompts = [[1 + (7 * i + j) % 200 for j in range(12)] for i in range(4)]
N = 192
refs = {tuple(p): Engine(t, None, "ar").generate(p, SamplingConfig(), N + 16).token_ids for p in prompts}
curve = CostCurve([1e-3 * (1 + 0.1 * n) for n in range(8)], draft_s=0.0)
out = {}
for name in ("single-fixed", "single-cost", "batch4-cost"):
    times, own = [], []
    for rep in range(3):
        pol = None if name == "single-fixed" else CostModelPolicy(curve, observe_costs=False, explore_every=0)
        eng = Engine(t, Known(refs), "dspine", verify_policy=pol)
        fwd_s[0] = 0.0
        t0 = time.perf_counter()
        if name.startswith("batch"):
            res = BatchEngine(eng, 4).generate_many(prompts, max_new_tokens=[N] * 4)
            cycles = max(len(r.stats.verification_lengths) for r in res)
        else:
            cycles = 0
            for p in prompts:
                r = eng.generate(p, SamplingConfig(), N)
                cycles += len(r.stats.verification_lengths)
        wall = time.perf_counter() - t0
        times.append(wall / cycles * 1e3)
        own.append((wall - fwd_s[0]) / cycles * 1e3)
    out[name] = min(times)
    out[name + " (engine only)"] = min(own)
print(json.dumps(out))
'''


def run_child(src: Path) -> dict:
    from side_by_side import run_json

    return run_json("engine_overhead", CHILD, src, env={"DSPINE_TUNE": "off", "OMP_NUM_THREADS": "1"})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="checkout of the earlier commit (its src/ is used)")
    ap.add_argument("--new", default=".", help="checkout of the later commit (default: this one)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of each checkout")
    ap.add_argument("--out", default=None, help="JSON to write (default: print only)")
    a = ap.parse_args(argv)
    sides = {"old": Path(a.old).resolve(), "new": Path(a.new).resolve()}
    from side_by_side import alternate, commit_of

    commits = {k: commit_of(v) for k, v in sides.items()}
    load0 = os.getloadavg()[0]
    runs = alternate(sides, a.rounds, run_child)
    med = {k: {s: round(statistics.median(x[s] for x in v), 4) for s in v[0]} for k, v in runs.items()}
    sys.path.insert(0, str(sides["new"] / "src"))
    from dspine.tune.machine import describe

    result = {"what": "per-cycle wall time (ms) of the engine on a tiny target with a copying proposer; "
                      "'(engine only)': without the time inside the target's forward (the tiny HF "
                      "model's own Python), i.e. the engine's own overhead", "machine": describe("cpu"), "threads": 1,
              "load_1m_start": round(load0, 2), "load_1m_end": round(os.getloadavg()[0], 2),
              "date": time.strftime("%Y-%m-%d"), "commits": commits, "ms_per_cycle": med,
              "new_over_old": {s: round(med["new"][s] / med["old"][s], 3) for s in med["old"]}}
    from side_by_side import report

    report(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
