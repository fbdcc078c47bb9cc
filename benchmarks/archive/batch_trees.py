"""Draft trees in the batched engine (``dspine serve``'s cycles) vs chains, side by side in one
process (2026-12-03).

For each concurrency c, c held-out prompts (code and chat, after the first 16 of each set, which
were tuned on) run together through :class:`dspine.core.batch.BatchEngine` on the lean decode path,
greedy, with ``dspine serve``'s defaults (hybrid proposer, cost policy, measured kernels) and
either draft trees sized per cycle (``--tree-budget B``, ``--tree-size cost``) or chains
(``--tree-budget 0``), alternating which goes first per round. The figure is output tokens per
second of the whole batch (decode only: prefill is the same in both). Greedy output ids of the
two must be equal (both are the target's own).

    python benchmarks/archive/batch_trees.py --concurrency 1 2 4 --rounds 2 --out benchmarks/archive/batch_trees_avx512.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--budget", type=int, default=16, help="tree budget of the tree configuration")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from dspine.core.batch import BatchEngine
    from dspine.cli.main import DEFAULT_VERIFY_POLICY, build_engine
    from dspine.config import SamplingConfig
    from dspine.data.sources import heldout_prompts
    from dspine.trees.tree import TreeSpec
    from dspine.tune.machine import describe

    recs = heldout_prompts("code", 24)[16:16 + 4] + heldout_prompts("chat", 24)[16:16 + 4]
    load0 = os.getloadavg()
    engines = {}
    for name, spec in (("trees", TreeSpec(args.budget, None, size="cost")), ("chains", TreeSpec(0))):
        target, engines[name] = build_engine("smollm2-135m", None, "dspine", verify_policy=DEFAULT_VERIFY_POLICY,
                                             proposer="hybrid", linear_backend="auto", progress=True, tree=spec)
    prompts = [target.encode_prompt(r["prompt"], chat=r.get("kind") != "code") for r in recs]
    for eng in engines.values():  # warm-up (one-time measurements)
        BatchEngine(eng, 1).generate_many(prompts[:1], max_new_tokens=8)
    runs, table = [], {}
    for c in args.concurrency:
        speeds: dict[str, list[float]] = {k: [] for k in engines}
        ids: dict[str, list] = {}
        tree_cycles: dict[str, int] = {k: 0 for k in engines}
        for rnd in range(args.rounds):
            for k in range(0, len(prompts), c):  # every prompt once per round, c at a time
                ps = prompts[k:k + c]
                order = list(engines) if (rnd + k // c) % 2 == 0 else list(engines)[::-1]
                for name in order:
                    be = BatchEngine(engines[name], c)
                    t0 = time.perf_counter()
                    got = be.generate_many(ps, SamplingConfig(), max_new_tokens=args.tokens)
                    dt = time.perf_counter() - t0
                    decode = dt - sum(g.stats.ttft_s for g in got)  # prefill runs before the batch
                    n = sum(len(g.token_ids) for g in got)
                    trees = sum(1 for g in got for x in g.stats.tree_nodes if x > 0)
                    tree_cycles[name] += trees
                    cycles = sum(g.stats.cycles for g in got)
                    speeds[name].append(n / decode)
                    if rnd == 0:
                        ids.setdefault(name, []).extend(g.token_ids for g in got)
                    runs.append({"concurrency": c, "round": rnd, "group": k // c, "config": name, "tokens": n,
                                 "decode_s": round(decode, 4), "tok_s": round(n / decode, 2),
                                 "tree_cycles": trees, "cycles": cycles})
                    print(f"c={c} round {rnd} group {k // c} {name:<7} {n / decode:7.1f} tok/s "
                          f"({trees}/{cycles} tree cycles)", flush=True)
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(
            [r for r in runs if r["concurrency"] == c and r["config"] == "trees"],
            [r for r in runs if r["concurrency"] == c and r["config"] == "chains"])]
        table[f"c={c}"] = {"trees_tok_s": round(statistics.median(speeds["trees"]), 1),
                           "chains_tok_s": round(statistics.median(speeds["chains"]), 1),
                           "ratio_median": round(statistics.median(ratios), 3),
                           "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
                           "tree_cycles": tree_cycles["trees"], "same_ids": ids["trees"] == ids["chains"]}
    out = {"machine": describe("cpu"), "threads": args.threads, "load_start": load0, "load_end": os.getloadavg(),
           "tokens": args.tokens, "rounds": args.rounds, "prompts": len(prompts), "table": table, "runs": runs,
           "command": "python benchmarks/archive/batch_trees.py " + " ".join(
               f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(args).items() if v is not None and k != "out")}
    for k, v in table.items():
        print(f"{k:<5} trees {v['trees_tok_s']:7.1f}  chains {v['chains_tok_s']:7.1f}  {v['ratio_median']:.2f}x "
              f"({v['ratio_min']:.2f}-{v['ratio_max']:.2f})  tree cycles {v['tree_cycles']}  same ids {v['same_ids']}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
