"""Two opt-in changes to how the default prices copies (2026-12-04), measured beside ``ar``
and the default, side by side in one process. Neither is the default: neither was faster
(docs/decisions.md, 2026-12-04).

1. ``split``: a copy whose matched suffix was followed by different tokens at its two most
   recent earlier occurrences (:meth:`dspine.proposers.NgramIndex.contested`) is right far
   less often than other copies; ``HybridProposer(split_contested=True)`` gives it its own
   source (``ngram-contested``), so the cost policy prices it on its own record.
2. ``depth``: the cost policy's prior for a rarely verified position is the estimate of the
   position before it (``CostModelPolicy(depth_prior=True)``) instead of a flat 0.6, so a
   copy accepted at positions 1-3 is verified further sooner (with ``split``).

Configurations, all as generate runs the default otherwise (hybrid proposer, cost policy,
draft trees sized per cycle, measured kernels):

- ``ar``: the plain target loop;
- ``default``: what ``dspine generate`` runs;
- ``split``: change 1;
- ``depth``: changes 1 and 2.

Prompts: held-out code and chat prompts after the first ``--offset`` (never used for
training or tuning), and the first ``--limit`` prompts of the bench workloads named in
``--workloads`` (with their own output budgets and stop strings). Every (round, prompt) runs
the three configurations in a rotated order; each engine keeps its policies across requests
(as ``serve`` does), the two drafter engines share the target and the drafter weights.
Output ids of every configuration must equal ``ar``'s (greedy is lossless).

    python benchmarks/archive/contested_copies.py --out benchmarks/archive/contested_copies_avx512.json
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

CONFIGS = ("ar", "default", "split", "depth")


def split(engine) -> None:
    """Price contested copies apart: a source ``ngram-contested`` with its own cost policy."""
    from dspine.control.cost_curve import copy_cost
    from dspine.control.policy import CostModelPolicy

    engine.proposer.split_contested = True
    pols = engine.verify_policy.policies
    pols["ngram-contested"] = CostModelPolicy(copy_cost(pols["ngram"].cost), source="ngram-contested")


def depth_prior(engine) -> None:
    """The cost policy's prior at position j > 1 is its estimate at j - 1."""
    for pol in engine.verify_policy.policies.values():
        pol.depth_prior = True


def build(threads: int, labels: tuple[str, ...] = ("default", "split", "depth")):
    """(target, {"ar": engine, label: engine for each of ``labels``}): ``ar`` and one default
    engine per label, as ``dspine generate`` builds them, sharing the target and drafter."""
    import torch

    from dspine.cli import main as cli
    from dspine.cli.engine_setup import drafter_engine

    torch.set_num_threads(threads)
    parser = cli._Parser(prog="dspine")
    cli.add_generate_parser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["generate", "x"])
    target, ar = cli.build_engine(a.target, None, "ar", a.dtype, linear_backend=a.linear_backend, runtime=a.runtime,
                                  target_weights=a.target_weights)
    from dspine.drafter.checkpoint import load_drafter

    path = str(cli.default_drafter_path(a.target, "dspine"))
    model = load_drafter(path, target, dtype=target.dtype)
    engines = {"ar": ar}
    for label in labels:
        engines[label] = drafter_engine(target, model, path, "dspine", proposer=a.proposer,
                                        verify_policy=a.verify_policy or cli.DEFAULT_VERIFY_POLICY,
                                        tree=cli._tree_spec(a), head_kernel=a.head_kernel,
                                        drafter_linears=a.drafter_linears, draft_vocab=a.draft_vocab,
                                        copy_bonus=a.copy_bonus, persist=True)
    return target, engines


def start(engines: dict, ps: list[dict]) -> tuple[dict, str]:
    """Warm every engine up on one short request; return (machine info, git commit)."""
    import torch

    from dspine.config import SamplingConfig
    from dspine.tune.machine import machine_info

    with torch.no_grad():
        for e in engines.values():
            e.generate(ps[0]["ids"], SamplingConfig(), 16)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return machine_info("cpu"), commit


def rotated_runs(engines: dict, ps: list[dict], rounds: int, configs: tuple[str, ...], record) -> list[dict]:
    """Every (round, prompt) through every engine of ``configs`` (``ar`` among them) in an
    order rotated per (round, prompt), greedy; ``record(result)`` gives each run's fields.
    Returns the runs, each with round/prompt/group/config, the token ids and ``same_ids``
    (all configurations emitted ``ar``'s ids for that prompt and round)."""
    import torch

    from dspine.config import SamplingConfig

    runs = []
    for r in range(rounds):
        for k, p in enumerate(ps):
            rot = (r + k) % len(configs)
            got = {}
            for label in configs[rot:] + configs[:rot]:
                with torch.no_grad():
                    got[label] = engines[label].generate(p["ids"], SamplingConfig(), p["max_new_tokens"],
                                                         stop=p["stop"])
            same = all(got[c].token_ids == got["ar"].token_ids for c in configs)
            for c in configs:
                runs.append({"round": r, "prompt": p["name"], "group": p["group"], "config": c,
                             "token_ids": got[c].token_ids, "same_ids": same, **record(got[c])})
            print(f"round {r} {p['name']:24s} " + "  ".join(
                f"{c} {got[c].stats.tokens_per_second:6.1f}" for c in configs) + f"  tok/s, same ids {same}", flush=True)
    return runs


def prompts(target, sets: list[str], n: int, offset: int, workloads: list[str], limit: int) -> list[dict]:
    from dspine.bench.prompts import build_prompts
    from dspine.data.sources import heldout_prompts

    out = []
    for s in sets:
        for k, rec in enumerate(heldout_prompts(s, offset + n)[offset:]):
            out.append({"name": f"{s}{offset + k}", "group": s, "max_new_tokens": 128, "stop": [],
                        "ids": target.encode_prompt(rec["prompt"], chat=rec.get("kind") != "code")})
    if workloads:
        got, _ = build_prompts(target, workloads, limit=limit)
        for p in got:
            out.append({"name": f"{p.workload}/{p.id}", "group": p.workload, "max_new_tokens": p.max_new_tokens,
                        "stop": list(p.stop), "ids": list(p.prompt_ids)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", nargs="+", default=["code", "chat"])
    ap.add_argument("--n", type=int, default=8, help="held-out prompts per set")
    ap.add_argument("--offset", type=int, default=16, help="skip the first OFFSET held-out prompts (tuned on)")
    ap.add_argument("--workloads", default="short,tools,edit", help="bench workloads ('' for none)")
    ap.add_argument("--limit", type=int, default=8, help="prompts per bench workload")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    target, engines = build(args.threads)
    split(engines["split"])
    split(engines["depth"])
    depth_prior(engines["depth"])
    ps = prompts(target, args.sets, args.n, args.offset, [w for w in args.workloads.split(",") if w], args.limit)
    mi, commit = start(engines, ps)
    load0, t_start = os.getloadavg()[0], time.time()
    runs = rotated_runs(engines, ps, args.rounds, CONFIGS, lambda res: {
        "tokens": res.stats.output_tokens, "decode_s": res.stats.decode_s,
        "tokens_per_second": res.stats.tokens_per_second, "tau": res.stats.accepted_length_mean,
        "cycles": res.stats.cycles, "sources": res.stats.sources})

    by = {(x["round"], x["prompt"], x["config"]): x for x in runs}
    groups = list(dict.fromkeys(p["group"] for p in ps))

    def ratio(num: str, den: str, group: str) -> dict:
        """Median over prompts of the per-prompt median (over rounds) of decode-time ratios
        den/num (= tok/s num over den), and the pooled ratio (sum of decode times)."""
        per = []
        for p in ps:
            if p["group"] != group:
                continue
            rs = [by[(r, p["name"], den)]["decode_s"] / by[(r, p["name"], num)]["decode_s"]
                  for r in range(args.rounds) if by[(r, p["name"], num)]["decode_s"] > 0]
            if rs:
                per.append(statistics.median(rs))
        pooled = sum(x["decode_s"] for x in runs if x["group"] == group and x["config"] == den) / \
            max(sum(x["decode_s"] for x in runs if x["group"] == group and x["config"] == num), 1e-12)
        return {"median_per_prompt": round(statistics.median(per), 3) if per else None, "pooled": round(pooled, 3),
                "min": round(min(per), 3) if per else None, "max": round(max(per), 3) if per else None}

    def source_totals(config: str, group: str) -> dict:
        tot: dict = {}
        for x in runs:
            if x["config"] == config and x["group"] == group:
                for s, d in x["sources"].items():
                    t = tot.setdefault(s, {"cycles": 0, "proposed": 0, "accepted": 0})
                    for f in t:
                        t[f] += d[f]
        return tot

    table = {g: {"split_vs_default": ratio("split", "default", g), "depth_vs_default": ratio("depth", "default", g),
                 "default_vs_ar": ratio("default", "ar", g), "split_vs_ar": ratio("split", "ar", g),
                 "tau": {c: round(sum(x["tokens"] - 1 for x in runs if x["config"] == c and x["group"] == g) /
                                  max(sum(x["cycles"] for x in runs if x["config"] == c and x["group"] == g), 1), 3)
                         for c in CONFIGS[1:]},
                 "sources": {c: source_totals(c, g) for c in CONFIGS[1:]}} for g in groups}
    summary = {
        "what": "the default, the default with contested copies priced apart (split), the same with the cost "
                "policy's depth prior (depth), and ar; greedy, one process, rotated order per (round, prompt); "
                "ratios are tok/s of the first over the second (decode only)",
        "command": "python benchmarks/archive/contested_copies.py " + " ".join(sys.argv[1:]),
        "machine": mi, "commit": commit, "load_avg_1m_start": round(load0, 2),
        "load_avg_1m_end": round(os.getloadavg()[0], 2), "wall_s": round(time.time() - t_start, 1),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "kernels": engines["default"].kernel_info(),
        "by_group": table,
        "same_ids": f"{sum(x['same_ids'] for x in runs if x['config'] == 'ar')}/{len(runs) // len(CONFIGS)}",
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n{mi.get('cpu_model')} ({mi.get('isa')}), {args.threads} threads, load {summary['load_avg_1m_start']}"
          f" -> {summary['load_avg_1m_end']}, commit {commit}")
    print("group     | split/default (median, pooled) | depth/default (median, pooled) | default/ar | split/ar | "
          "tau default / split / depth")
    for g, t in table.items():
        print(f"{g:9} | {t['split_vs_default']['median_per_prompt']}x, {t['split_vs_default']['pooled']}x | "
              f"{t['depth_vs_default']['median_per_prompt']}x, {t['depth_vs_default']['pooled']}x | "
              f"{t['default_vs_ar']['median_per_prompt']}x | {t['split_vs_ar']['median_per_prompt']}x | "
              f"{t['tau']['default']} / {t['tau']['split']} / {t['tau']['depth']}")
    print(f"same ids {summary['same_ids']}; -> {args.out}")


if __name__ == "__main__":
    main()
