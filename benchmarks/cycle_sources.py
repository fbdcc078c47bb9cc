"""Where the defaults' decoding time goes: cycles by proposer source and verification length.

Runs the default engine that ``dspine generate`` builds (the hybrid proposer, the cost policy)
in one process, greedy, on held-out prompts never used for training or tuning (after
``--offset``), and groups every cycle by (source, n): how many cycles, accepted tokens per
cycle, milliseconds per cycle (proposal, final stage and verification; ``CycleRecord``), and
their tokens per millisecond against a plain step's. A group whose rate is below the plain
step's costs time: the policy verified something that did not pay on this machine. ``--mode
ar`` rows of the same prompts give the plain step's cost for reference.

    python benchmarks/cycle_sources.py --n 6 --out benchmarks/drafter-diagnosis/cycle-sources-<isa>-<date>.json

It is a timing: run it on an otherwise idle machine. The acceptance profile the cost policy
saved from earlier runs on this machine is used as ``dspine generate`` uses it, so the
choices depend on what ran before (the file records the profile's cycle count).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch


def run_set(target, engine, kind: str, n: int, offset: int, tokens: int) -> dict:
    """{(source, n) -> [cycles, accepted tokens, seconds]} over ``n`` prompts of ``kind``."""
    from dspine.config import SamplingConfig
    from dspine.data.sources import heldout_prompts

    agg: dict = defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0, 0.0, 0.0])
    for rec in heldout_prompts(kind, offset + n)[offset:]:
        ids = target.encode_prompt(rec["prompt"], chat=kind != "code")
        cycles = []
        engine.generate(ids, SamplingConfig(), tokens, on_cycle=lambda req: cycles.append(req.cycles[-1]))
        for c in cycles:
            a = agg[(c.source or "none", c.n)]
            a[0] += 1
            a[1] += c.emitted - 1
            a[2] += c.total_s
            a[3] += c.draft_s
            a[4] += c.final_s
            a[5] += c.verify_s
            a[6] += getattr(c, "context_s", 0.0)
    return agg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", nargs="+", default=["code", "chat"], choices=["code", "chat"])
    ap.add_argument("--n", type=int, default=6, help="held-out prompts per set")
    ap.add_argument("--offset", type=int, default=16, help="skip the first OFFSET prompts (tuned on)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.n < 1 or args.offset < 0 or args.max_new_tokens < 1 or args.threads < 1:
        ap.error("--n, --max-new-tokens and --threads must be >= 1, --offset >= 0")
    torch.set_num_threads(args.threads)
    from dspine.build import build_engine
    from dspine.config import SpeculativeConfig
    from dspine.tune.machine import describe

    load0 = os.getloadavg()[0]
    res = {"what": __doc__.split("\n\n")[0], "machine": describe(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "sets": {}}
    for mode in ("ar", "dspine"):
        target, engine = build_engine(SpeculativeConfig(mode=mode))
        if mode == "dspine":
            res["profile_cycles"] = round(float(engine.verify_policy.profile().get("cycles", 0.0)), 1) \
                if hasattr(engine.verify_policy, "profile") else None
        for kind in args.sets:
            agg = run_set(target, engine, kind, args.n, args.offset, args.max_new_tokens)
            rows = res["sets"].setdefault(kind, {})
            for (src, n), (c, acc, s, ds, fs, vs, cs) in sorted(agg.items()):
                key = "ar" if mode == "ar" else f"{src} n={n}"
                rows[key] = {"cycles": c, "accepted_per_cycle": round(acc / c, 3), "ms_per_cycle": round(s / c * 1e3, 2),
                             "tokens_per_ms": round((acc + c) / s / 1e3, 4),
                             # per cycle: the proposal (with the draft context it projected), the final
                             # stage, the verification (with the engine's own per-request work)
                             "draft_ms": round(ds / c * 1e3, 2), "context_ms": round(cs / c * 1e3, 2),
                             "final_ms": round(fs / c * 1e3, 2), "verify_ms": round(vs / c * 1e3, 2)}
    for kind, rows in res["sets"].items():
        plain = rows["ar"]["tokens_per_ms"]
        print(f"{kind}: plain step {rows['ar']['ms_per_cycle']} ms")
        for key, r in rows.items():
            r["rate_over_plain"] = round(r["tokens_per_ms"] / plain, 3)
            print(f"  {key:12s} {r['cycles']:5d} cycles  accepted {r['accepted_per_cycle']:.2f}  "
                  f"{r['ms_per_cycle']:6.2f} ms (draft {r['draft_ms']:.2f}, of it context {r['context_ms']:.2f}; "
                  f"final {r['final_ms']:.2f}; verify {r['verify_ms']:.2f})  rate {r['rate_over_plain']:.2f}x plain")
    res["load_1m_start"], res["load_1m_end"] = round(load0, 2), round(os.getloadavg()[0], 2)
    print(res["machine"], f"load {res['load_1m_start']} -> {res['load_1m_end']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
