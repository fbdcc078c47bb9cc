"""Target linear backend side by side: PyTorch's default (``aten``) vs oneDNN with packed
weights (``onednn``, :mod:`dspine.runtime.packed`), for ``ar`` and DSpine (shipped
drafter, cost policy, measured candidate pass), in one process on one loaded target.

Interleaved: every round runs each (backend, mode) pair on each prompt once, in a
rotating order; the table gives medians over rounds and prompts of output tokens/s after
prefill, and ratios within the round. Greedy float32: all four runs of a prompt must give
the same ids (checked). Also the target forward over 1, 2, 4, 8 and 16 tokens after a
64-token context per backend (the cost-policy curve's measurement).

Usage: python benchmarks/archive/linear_backend.py [--rounds 3] [--tokens 96] [--out benchmarks/archive/linear_backend.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from dspine.build import DEFAULT_CHECKPOINTS
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import load_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.tune.controller import make_policy
from dspine.tune.cost import measure_cost
from dspine.runtime.packed import apply_linear_backend
from dspine.target.adapter import load_target
from dspine.tune.machine import describe, machine_info

# held-out of training and of the bench workloads' tuning: written for this benchmark
PROMPTS = {
    "code": "Write a Python function that merges two sorted lists into one sorted list.",
    "chat": "What are three good habits for staying focused while studying?",
    "code2": "Write a Python class Stack with push, pop and peek methods.",
    "chat2": "Explain what a hash table is to a beginner.",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", default="benchmarks/archive/linear_backend.json")
    a = ap.parse_args()
    t = load_target("smollm2-135m", dtype="float32")
    drafter = load_drafter(DEFAULT_CHECKPOINTS / "smollm2-135m-dspine", t)
    load0 = os.getloadavg()[0]
    curves, engines = {}, {}
    for be in ("aten", "onednn"):
        apply_linear_backend(t, be)
        prop = DrafterProposer(drafter)
        c = measure_cost(t, prop, n_max=15, use_cache=False)
        curves[be] = {"verify_ms": [round(v * 1e3, 1) for v in c.verify_s],
                      "propose_ms": [round(v * 1e3, 1) for v in c.propose_s]}
        engines[be] = {"ar": Engine(t, None, "ar"),
                       "dspine": Engine(t, prop, "dspine", verify_policy=make_policy("cost", t, prop, cost=c))}
    runs = []
    pairs = [(be, m) for be in ("aten", "onednn") for m in ("ar", "dspine")]
    for r in range(a.rounds):
        for k, (name, text) in enumerate(PROMPTS.items()):
            ids = t.encode_prompt(text, chat=True)
            order = pairs[(r + k) % 4:] + pairs[:(r + k) % 4]
            out = {}
            for be, m in order:
                apply_linear_backend(t, be)
                res = engines[be][m].generate(ids, SamplingConfig(), a.tokens)
                out[(be, m)] = res.token_ids
                runs.append({"round": r, "prompt": name, "backend": be, "mode": m,
                             "tokens_per_second": res.stats.tokens_per_second,
                             "tau": res.stats.accepted_length_mean,
                             "mean_n": statistics.mean(res.stats.verification_lengths or [0])})
            assert len({tuple(v) for v in out.values()}) == 1, f"ids differ on {name}"
            print(name, r, {f"{be}/{m}": round(x["tokens_per_second"], 1) for x in runs[-4:]
                            for be, m in [(x["backend"], x["mode"])]}, flush=True)

    def med(be, m):
        return statistics.median(x["tokens_per_second"] for x in runs if x["backend"] == be and x["mode"] == m)

    def ratio(b1, m1, b2, m2):
        rs = []
        for r in range(a.rounds):
            for p in PROMPTS:
                x = next(x for x in runs if (x["round"], x["prompt"], x["backend"], x["mode"]) == (r, p, b1, m1))
                y = next(y for y in runs if (y["round"], y["prompt"], y["backend"], y["mode"]) == (r, p, b2, m2))
                rs.append(x["tokens_per_second"] / y["tokens_per_second"])
        return round(statistics.median(rs), 3), round(min(rs), 3), round(max(rs), 3)

    summary = {
        "machine": machine_info(), "machine_line": describe(), "load_avg_1m_start": load0,
        "load_avg_1m_end": os.getloadavg()[0], "rounds": a.rounds, "tokens": a.tokens,
        "prompts": PROMPTS, "cost_curves": curves,
        "median_tokens_per_second": {f"{be}/{m}": round(med(be, m), 2) for be, m in pairs},
        "ratios_median_min_max": {
            "onednn ar / aten ar": ratio("onednn", "ar", "aten", "ar"),
            "aten dspine / aten ar": ratio("aten", "dspine", "aten", "ar"),
            "onednn dspine / onednn ar": ratio("onednn", "dspine", "onednn", "ar"),
            "onednn dspine / aten ar": ratio("onednn", "dspine", "aten", "ar")},
        "runs": runs,
    }
    Path(a.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("machine_line", "median_tokens_per_second", "ratios_median_min_max",
                                              "cost_curves")}, indent=1))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
