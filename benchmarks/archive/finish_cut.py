"""Proposals past the end of a request: the default (``Engine.cut_at_finish`` drops the
proposals after the first EOS or stop-completing token) against the same engine verifying
them, beside ``ar``, side by side in one process.

Workloads: the bench's ``code`` (HumanEval completions with its stop strings, ~34-token
answers) and others named in ``--workloads`` (EOS only). Every (round, prompt) runs the
three configurations in a rotated order, each engine keeping its policies across
requests; greedy ids must equal ``ar``'s. Decode time only (TTFT excluded), as the bench.

    python benchmarks/archive/finish_cut.py --out benchmarks/archive/finish_cut_avx512.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contested_copies import build, prompts, rotated_runs, start  # noqa: E402  (the default engines, as generate builds them)

CONFIGS = ("ar", "default", "no-cut")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="code,short,tools")
    ap.add_argument("--limit", type=int, default=16, help="prompts per workload")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    target, engines = build(args.threads, ("default", "no-cut"))
    engines["no-cut"].cut_at_finish = lambda req, prop: prop  # the default engine verifying every proposal whole
    ps = prompts(target, [], 0, 0, [w for w in args.workloads.split(",") if w], args.limit)
    mi, commit = start(engines, ps)
    load0, t0 = os.getloadavg()[0], time.time()
    runs = rotated_runs(engines, ps, args.rounds, CONFIGS, lambda res: {
        "tokens": res.stats.output_tokens, "decode_s": res.stats.decode_s, "cycles": res.stats.cycles,
        "proposed": sum(res.stats.verification_lengths)})
    by = {(x["round"], x["prompt"], x["config"]): x for x in runs}
    table = {}
    for g in dict.fromkeys(p["group"] for p in ps):
        names = [p["name"] for p in ps if p["group"] == g]

        def ratio(num: str, den: str) -> dict:
            per = [statistics.median(by[(r, n, den)]["decode_s"] / by[(r, n, num)]["decode_s"]
                                     for r in range(args.rounds)) for n in names
                   if all(by[(r, n, num)]["decode_s"] > 0 for r in range(args.rounds))]
            tot = lambda c: sum(by[(r, n, c)]["decode_s"] for r in range(args.rounds) for n in names)  # noqa: E731
            return {"median_per_prompt": round(statistics.median(per), 3), "pooled": round(tot(den) / tot(num), 3)}

        prop = lambda c: sum(by[(r, n, c)]["proposed"] for r in range(args.rounds) for n in names)  # noqa: E731
        table[g] = {"default_vs_nocut": ratio("default", "no-cut"), "default_vs_ar": ratio("default", "ar"),
                    "nocut_vs_ar": ratio("no-cut", "ar"),
                    "proposals_verified": {"default": prop("default"), "no-cut": prop("no-cut")}}
    summary = {"what": "default (proposals past a finishing token dropped) vs the same engine verifying them "
                       "(no-cut) vs ar; greedy, one process, rotated order; ratios: tok/s of the first over the "
                       "second (decode only), median of per-prompt medians and pooled",
               "command": "python benchmarks/archive/finish_cut.py " + " ".join(sys.argv[1:]), "machine": mi,
               "commit": commit, "load_avg_1m_start": round(load0, 2), "load_avg_1m_end": round(os.getloadavg()[0], 2),
               "wall_s": round(time.time() - t0, 1),
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "by_group": table,
               "same_ids": f"{sum(x['same_ids'] for x in runs if x['config'] == 'ar')}/{len(runs) // len(CONFIGS)}",
               "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{mi.get('cpu_model')} ({mi.get('isa')}), {args.threads} threads, load {summary['load_avg_1m_start']} -> "
          f"{summary['load_avg_1m_end']}, commit {commit}")
    for g, t in table.items():
        print(f"{g:6} default/no-cut {t['default_vs_nocut']['median_per_prompt']}x (pooled "
              f"{t['default_vs_nocut']['pooled']}x), default/ar {t['default_vs_ar']['median_per_prompt']}x, "
              f"no-cut/ar {t['nocut_vs_ar']['median_per_prompt']}x, proposals verified "
              f"{t['proposals_verified']['default']} vs {t['proposals_verified']['no-cut']}")
    print(f"same ids {summary['same_ids']}; -> {args.out}")


if __name__ == "__main__":
    main()
