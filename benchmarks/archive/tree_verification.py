"""Draft trees vs chains side by side, in one process on one loaded float32 target.

1. Verification cost: one dense-runtime target forward over w new tokens (w = 1 and the
   verification widths 16, 32, 48, 64) after a 300-token context, median of repeats: what
   a tree of w - 1 nodes costs against a chain of 15 proposals (w = 16).
2. End to end: the shipped DSpine drafter on held-out prompts (``dspine.data.sources.
   heldout_prompts``, never trained on), greedy, EOS ignored, as a chain and as trees of
   several budgets, with the drafter alone (fixed verification length 15: what tau the
   tables give) and with the defaults (hybrid proposer, cost policy). Interleaved: every
   round runs each configuration on each prompt once in a rotating order; medians of
   output tokens/s after prefill and of tau, ratios tree/chain within the same round and
   prompt. Every configuration's ids are checked equal to ``ar``'s.
3. Sampled (temperature 0.7, top-p 0.95): the drafter alone as a chain and as trees
   (static widths 4,2,1 under the budget), tau and tokens/s.

Usage: python benchmarks/archive/tree_verification.py [--rounds 2] [--tokens 96] [--prompts 4]
       [--budgets 16,32] [--out benchmarks/archive/tree_verification.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from side_by_side import heldout_ids, interleaved_greedy, load_smollm2_dense, paired_ratio

from dspine.config import SamplingConfig
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.tune.controller import make_policy
from dspine.proposers import make_proposer
from dspine.trees import DraftTree, TreeSpec
from dspine.tune.machine import describe, machine_info


def verify_cost(t, widths=(1, 16, 32, 48, 64), context: int = 300, repeats: int = 7) -> dict:
    """Median ms of one target forward over w new tokens (a chain-shaped tree mask for
    w > 1, so the tree path's mask and positions are what is timed)."""
    ids = torch.randint(100, 20000, (1, context + max(widths)))
    out = {}
    for w in widths:
        times = []
        for _ in range(repeats):
            c = t.new_cache()
            t.forward(ids[:, :context], c, None, logits_to_keep=1)
            c.rollback(context)
            tree = DraftTree.chain(ids[0, context + 1:context + w])
            t0 = time.perf_counter()
            t.forward(ids[:, context:context + w], c, [1, 8, 15, 22, 28],
                      tree=(tree.positions(), tree.attention_mask()) if w > 1 else None)
            times.append(time.perf_counter() - t0)
        out[w] = round(1000 * statistics.median(times), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts per set (code, chat)")
    ap.add_argument("--budgets", default="16,32")
    ap.add_argument("--linear-backend", default="auto")
    ap.add_argument("--out", default="benchmarks/archive/tree_verification.json")
    a = ap.parse_args()
    t, backend, drafter = load_smollm2_dense(a.linear_backend)
    load0 = os.getloadavg()[0]
    cost = verify_cost(t)
    print("verification ms by width:", cost, flush=True)

    budgets = [int(x) for x in a.budgets.split(",")]
    configs = {"ar": Engine(t, None, "ar")}
    for label, proposer, policy in (("drafter", "drafter", None), ("default", "hybrid", "cost")):
        for b in [0] + budgets:
            prop = make_proposer(proposer, DrafterProposer(drafter))
            pol = make_policy(policy, t, prop) if policy else None
            name = f"{label} {'chain' if b == 0 else f'tree{b}'}"
            configs[name] = Engine(t, prop, "dspine", verify_policy=pol, tree=TreeSpec(b))
    labels = list(configs)
    prompts = heldout_ids(t, a.prompts)
    runs, ids_of = interleaved_greedy(
        t, configs, prompts, a.rounds, a.tokens,
        lambda res: {"tree_nodes_mean": statistics.mean(res.stats.tree_nodes) if res.stats.tree_nodes else 0})
    t.eos_token_ids, eos = frozenset(), t.eos_token_ids
    # sampled (temperature 0.7, top-p 0.95, the bench's sampled setting): the drafter alone,
    # chain vs trees (static widths 4,2,1 under the budget), one seed per round and prompt
    sampled_cfg = SamplingConfig(temperature=0.7, top_p=0.95)
    s_labels = [lb for lb in labels if lb.startswith("drafter")]
    sampled = []
    for r in range(a.rounds):
        for k, (name, ids) in enumerate(prompts.items()):
            s = (r * len(prompts) + k) % len(s_labels)
            for label in s_labels[s:] + s_labels[:s]:
                res = configs[label].generate(ids, replace(sampled_cfg, seed=1000 * r + k), a.tokens)
                sampled.append({"round": r, "prompt": name, "config": label, "tokens": len(res.token_ids),
                                "tokens_per_second": res.stats.tokens_per_second,
                                "tau": res.stats.accepted_length_mean})
        print("sampled", r, flush=True)
    t.eos_token_ids = eos
    equal = {lb: sum(ids_of[(r, p, lb)] == ids_of[(r, p, "ar")] for r in range(a.rounds) for p in prompts)
             for lb in labels}
    assert all(v == a.rounds * len(prompts) for v in equal.values()), f"ids differ from ar: {equal}"

    def med(label, key, sets=("code", "chat")):
        xs = [x[key] for x in runs if x["config"] == label and x["prompt"].rstrip("0123456789") in sets]
        return round(statistics.median(xs), 3)

    def ratio(l1, l2):
        return paired_ratio(runs, l1, l2)

    def pooled_tau(label, s, rows=None):
        xs = [x for x in (rows or runs) if x["config"] == label and x["prompt"].startswith(s)]
        return round(sum(x["tokens"] - 1 for x in xs) / sum((x["tokens"] - 1) / x["tau"] for x in xs), 3)

    pairs = [(f"{lb} tree{b}", f"{lb} chain") for lb in ("drafter", "default") for b in budgets]
    pairs += [(lb, "ar") for lb in labels if lb != "ar"]
    summary = {
        "machine": machine_info(), "machine_line": describe(), "threads": torch.get_num_threads(),
        "load_avg_1m_start": load0, "load_avg_1m_end": os.getloadavg()[0], "linear_backend": backend,
        "runtime": "dense", "dtype": "float32", "rounds": a.rounds, "tokens": a.tokens,
        "prompts_per_set": a.prompts, "verification_ms_by_width": cost,
        "median_tokens_per_second": {lb: med(lb, "tokens_per_second") for lb in labels},
        "tau_pooled_code": {lb: pooled_tau(lb, "code") for lb in labels if lb != "ar"},
        "tau_pooled_chat": {lb: pooled_tau(lb, "chat") for lb in labels if lb != "ar"},
        "ratios_median_min_max": {f"{x} / {y}": ratio(x, y) for x, y in pairs},
        "greedy_runs_equal_to_ar": equal,
        "sampled_setting": {"temperature": 0.7, "top_p": 0.95},
        "sampled_tau_pooled": {lb: {st: pooled_tau(lb, st, sampled) for st in ("code", "chat")} for lb in s_labels},
        "sampled_median_tokens_per_second": {
            lb: round(statistics.median(x["tokens_per_second"] for x in sampled if x["config"] == lb), 2)
            for lb in s_labels},
        "runs": runs, "sampled_runs": sampled,
    }
    Path(a.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("machine_line", "verification_ms_by_width", "median_tokens_per_second",
                                              "tau_pooled_code", "tau_pooled_chat", "ratios_median_min_max",
                                              "sampled_tau_pooled", "sampled_median_tokens_per_second")},
                     indent=1))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    main()
