"""The cross-request output cache (``dspine serve --ngram-cache-tokens``),
side by side with the same proposer without it.

One process, one loaded float32 target on the dense runtime, the shipped DSpine drafter,
the default proposer (hybrid), cost policy and tree settings; greedy with EOS on. The
prompts of each bench workload are sent once each, in the workload's order, as a stream of
requests from one tenant: before prompt i the cache holds the outputs of prompts 0..i-1 of
the same workload (never the prompt's own answer: no prompt repeats, and the cache is
cleared between workloads). ``--resend K`` then sends the first K prompts of the workload
once more (a client retrying or re-asking): those runs are reported apart (``resent``),
since the cache then holds their own earlier answer. For every prompt the configuration without the cache and the
one with it run back to back (order alternating per prompt); their ids must be equal.
Reports per workload: pooled tau, the per-source acceptance of the copies, median
tokens/s and the median of the per-prompt speed ratios.

Usage: python benchmarks/archive/output_cache.py [--workloads tools,edit,short] [--n 16] [--resend 4]
       [--max-new-tokens 128] [--cache-tokens 100000] [--out benchmarks/archive/output_cache.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from side_by_side import load_smollm2_dense

from dspine.bench.prompts import build_prompts
from dspine.config import SamplingConfig
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.tune.controller import make_policy
from dspine.proposers import make_proposer, output_cache_of
from dspine.trees.tree import TreeSpec
from dspine.argtypes import DEFAULT_TREE_BUDGET, DEFAULT_TREE_SIZE
from dspine.tune.machine import describe, machine_info, others_cpu_load


def pooled_tau(xs: list[dict]) -> float:
    toks = sum(x["tokens"] - 1 for x in xs)
    cyc = sum(x["cycles"] for x in xs)
    return round(toks / cyc, 3) if cyc else 0.0


def part(xs: list[dict]) -> dict:
    """Pooled tau, median tokens/s, paired speed ratios and per-source counts of runs ``xs``."""
    if not xs:
        return {}
    by = {(x["prompt"], x["config"]): x for x in xs}
    ratios = [by[(p, "cache")]["tokens_per_second"] / by[(p, "off")]["tokens_per_second"]
              for p in {x["prompt"] for x in xs}]
    src = {}
    for x in xs:
        if x["config"] != "cache":
            continue
        for s, v in x["sources"].items():
            d = src.setdefault(s, {"cycles": 0, "proposed": 0, "accepted": 0})
            for key in d:
                d[key] += v.get(key, 0)
    labels = ("off", "cache")
    return {"prompts": len(ratios),
            "tau_pooled": {lb: pooled_tau([x for x in xs if x["config"] == lb]) for lb in labels},
            "median_tokens_per_second": {lb: round(statistics.median(x["tokens_per_second"] for x in xs
                                                                     if x["config"] == lb), 2) for lb in labels},
            "speed_ratio_cache_over_off_median_min_max": [round(statistics.median(ratios), 3),
                                                          round(min(ratios), 3), round(max(ratios), 3)],
            "sources_with_cache": src}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="tools,edit,short")
    ap.add_argument("--n", type=int, default=16, help="prompts per workload (the first ones)")
    ap.add_argument("--resend", type=int, default=4, help="prompts sent a second time at the end")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--cache-tokens", type=int, default=100_000)
    ap.add_argument("--linear-backend", default="auto")
    ap.add_argument("--out", default="benchmarks/archive/output_cache.json")
    a = ap.parse_args()
    t, backend, drafter = load_smollm2_dense(a.linear_backend)
    load0, busy0 = os.getloadavg()[0], others_cpu_load()
    spec = TreeSpec(DEFAULT_TREE_BUDGET, size=DEFAULT_TREE_SIZE)
    configs = {}
    for label, tokens in (("off", 0), ("cache", a.cache_tokens)):
        prop = make_proposer("hybrid", DrafterProposer(drafter), cache_tokens=tokens)
        configs[label] = Engine(t, prop, "dspine", verify_policy=make_policy("cost", t, prop), tree=spec)
    cache = output_cache_of(configs["cache"].proposer)
    warm = t.encode_prompt("Name three colours.", chat=True)
    for eng in configs.values():
        eng.generate(warm, SamplingConfig(), 32)
    cache.clear()
    runs, summary_w = [], {}
    for w in a.workloads.split(","):
        prompts, skipped = build_prompts(t, [w], limit=a.n, max_new_tokens=a.max_new_tokens)
        cache.clear()
        stream = [(p, False) for p in prompts] + [(p, True) for p in prompts[:a.resend]]
        for k, (p, resent) in enumerate(stream):
            order = ["off", "cache"] if k % 2 == 0 else ["cache", "off"]
            got = {}
            for label in order:
                res = configs[label].generate(p.prompt_ids, SamplingConfig(), p.max_new_tokens, stop=p.stop)
                st = res.stats
                got[label] = res.token_ids
                runs.append({"workload": w, "prompt": p.id, "resent": resent, "config": label, "tokens": len(res.token_ids),
                             "cycles": st.cycles, "tokens_per_second": st.tokens_per_second,
                             "draft_s": round(st.draft_s + st.final_stage_s, 3), "verify_s": round(st.verify_s, 3),
                             "verified": sum(st.verification_lengths),
                             "tree_cycles": sum(1 for n in st.tree_nodes if n), "sources": st.sources})
            assert got["off"] == got["cache"], f"{w} {p.id}: ids differ with the cache"
            last = {x["config"]: x for x in runs[-2:]}
            print(w, k, p.id, {lb: (round(x["tokens_per_second"], 1), x["tokens"], x["cycles"], x["draft_s"],
                                    x["verify_s"], x["verified"], x["tree_cycles"]) for lb, x in last.items()},
                  "cache copies accepted:", last["cache"]["sources"].get("cache", {}).get("accepted", 0), flush=True)
        summary_w[w] = {"skipped": skipped, "distinct": part([x for x in runs if x["workload"] == w and not x["resent"]]),
                        "resent": part([x for x in runs if x["workload"] == w and x["resent"]]),
                        "cache_stats_end": cache.stats()}
        print(w, json.dumps(summary_w[w]), flush=True)
    summary = {
        "what": "cross-request output cache vs none, hybrid proposer, greedy, each prompt once per config",
        "machine": machine_info(), "machine_line": describe(), "threads": torch.get_num_threads(),
        "load_avg_1m_start": load0, "load_avg_1m_end": os.getloadavg()[0],
        "other_processes_busy_cores_start": busy0, "linear_backend": backend, "runtime": "dense",
        "dtype": "float32", "proposer": "hybrid", "verify_policy": "cost",
        "tree": {"budget": spec.budget, "size": spec.size}, "max_new_tokens": a.max_new_tokens,
        "cache_tokens": a.cache_tokens, "workloads": summary_w, "runs": runs,
    }
    Path(a.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({w: {k: v for k, v in s.items() if k != "skipped"} for w, s in summary_w.items()}, indent=1))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    main()
