"""Fixed vs per-cycle tree size (``--tree-size cost``), side by side.

One process, one loaded float32 target on the dense runtime, the shipped DSpine drafter,
the default proposer (hybrid) and cost policy; held-out prompts (``heldout_prompts``, never
trained on), greedy, EOS ignored so every configuration emits the same count. Configs: ``ar``,
the chain (budget 0), per-cycle sized trees under several budgets, each with the tree gate
(``costB``, the default since 2026-12-03: a tree or a chain per drafting cycle by their measured
rates) and without it (``costB-always``), and with ``--fixed8`` 2026-12-02 fixed tree of 8. Interleaved: each round runs every configuration on each prompt once in a
rotating order; medians of output tokens/s after prefill, pooled tau, mean verified nodes,
and per-(round, prompt) ratios against the chain (or the fixed tree with ``--fixed8``). Every run's ids are checked
equal to ``ar``'s.

Usage: python benchmarks/archive/tree_size.py [--rounds 2] [--tokens 96] [--prompts 4]
       [--budgets 8,16,32] [--drafter-linears auto] [--draft-vocab auto] [--out benchmarks/archive/tree_size.json]
(``--drafter-linears auto --draft-vocab auto``: the drafter as ``dspine generate`` runs it;
the defaults keep the 2026-12-02 setting, float32 linears over the whole vocabulary.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from side_by_side import heldout_ids, interleaved_greedy, load_smollm2_dense, paired_ratio

from dspine.tune.drafter import measured_proposer
from dspine.core.engine import Engine
from dspine.tune.controller import make_policy
from dspine.proposers import make_proposer
from dspine.trees import TreeSpec
from dspine.tune.machine import describe, machine_info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts per set (code, chat)")
    ap.add_argument("--budgets", default="8,16,32", help="budgets of the per-cycle sized trees")
    ap.add_argument("--linear-backend", default="auto")
    ap.add_argument("--fixed8", action="store_true", help="also the fixed tree of 8 (2026-12-02 default)")
    ap.add_argument("--drafter-linears", default="float32", choices=("auto", "float32", "q8"),
                    help="the drafter's own linears (dspine generate's default: auto)")
    ap.add_argument("--draft-vocab", default="full", choices=("auto", "full", "subset"),
                    help="the candidate pass's vocabulary (dspine generate's default: auto)")
    ap.add_argument("--out", default="benchmarks/archive/tree_size.json")
    a = ap.parse_args()
    t, backend, drafter = load_smollm2_dense(a.linear_backend)
    load0 = os.getloadavg()[0]

    configs = {"ar": Engine(t, None, "ar")}
    specs = {"chain": TreeSpec(0)}
    if a.fixed8:
        specs["fixed8"] = TreeSpec(8)
    for b in a.budgets.split(","):  # sized trees, with the tree gate (the default) and without it
        specs[f"cost{b}"] = specs[f"cost{b}-always"] = TreeSpec(int(b), size="cost")
    from dspine.build import DEFAULT_CHECKPOINTS
    from dspine.drafter.vocab import resolve

    vocab = resolve(a.draft_vocab, DEFAULT_CHECKPOINTS / "smollm2-135m-dspine", drafter.cfg.vocab_size,
                    drafter.cfg.head_topk)
    for name, spec in specs.items():
        prop = make_proposer("hybrid", measured_proposer(drafter, linears=a.drafter_linears, vocab=vocab))
        configs[name] = Engine(t, prop, "dspine", verify_policy=make_policy("cost", t, prop), tree=spec)
        if name.endswith("-always"):  # every drafting cycle a tree (before 2026-12-03)
            configs[name].verify_policy.gate = None
    labels = list(configs)
    prompts = heldout_ids(t, a.prompts)

    def record(res):
        nodes = [n for n in res.stats.tree_nodes if n] if res.stats.tree_nodes else []
        return {"tree_cycles": len(nodes), "cycles": res.stats.cycles,
                "tree_nodes_mean": statistics.mean(nodes) if nodes else 0}

    runs, ids_of = interleaved_greedy(t, configs, prompts, a.rounds, a.tokens, record)
    equal = {lb: sum(ids_of[(r, p, lb)] == ids_of[(r, p, "ar")] for r in range(a.rounds) for p in prompts)
             for lb in labels}
    assert all(v == a.rounds * len(prompts) for v in equal.values()), f"ids differ from ar: {equal}"

    def med(label, key):
        return round(statistics.median(x[key] for x in runs if x["config"] == label), 3)

    def ratio(l1, l2):
        return paired_ratio(runs, l1, l2)

    def pooled_tau(label, s):
        xs = [x for x in runs if x["config"] == label and x["prompt"].startswith(s)]
        return round(sum(x["tokens"] - 1 for x in xs) / sum((x["tokens"] - 1) / x["tau"] for x in xs), 3)

    ref = "fixed8" if a.fixed8 else "chain"  # the configuration the others are paired with
    sizers = {lb: configs[lb].verify_policy.sizer.describe() for lb in labels
              if getattr(configs[lb].verify_policy, "sizer", None) is not None}
    summary = {
        "machine": machine_info(), "machine_line": describe(), "threads": torch.get_num_threads(),
        "load_avg_1m_start": load0, "load_avg_1m_end": os.getloadavg()[0], "linear_backend": backend,
        "runtime": "dense", "dtype": "float32", "proposer": "hybrid", "verify_policy": "cost",
        "drafter_linears": a.drafter_linears, "draft_vocab": a.draft_vocab,
        "rounds": a.rounds, "tokens": a.tokens, "prompts_per_set": a.prompts,
        "median_tokens_per_second": {lb: med(lb, "tokens_per_second") for lb in labels},
        "tau_pooled_code": {lb: pooled_tau(lb, "code") for lb in labels if lb != "ar"},
        "tau_pooled_chat": {lb: pooled_tau(lb, "chat") for lb in labels if lb != "ar"},
        "mean_nodes_per_tree_cycle": {lb: round(statistics.mean(x["tree_nodes_mean"] for x in runs
                                                                if x["config"] == lb), 2) for lb in labels[2:]},
        "ratios_median_min_max": {**{f"{lb} / {ref}": ratio(lb, ref) for lb in labels if lb != ref},
                                  **{f"{lb} / ar": ratio(lb, "ar") for lb in labels if lb not in ("ar", ref)}},
        "tree_gates": {lb: configs[lb].verify_policy.gate.describe() for lb in labels
                       if getattr(configs[lb].verify_policy, "gate", None) is not None},
        "sizer_calibration": sizers,
        "greedy_runs_equal_to_ar": equal, "runs": runs,
    }
    Path(a.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("machine_line", "median_tokens_per_second", "tau_pooled_code",
                                              "tau_pooled_chat", "mean_nodes_per_tree_cycle",
                                              "ratios_median_min_max")}, indent=1))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    main()
