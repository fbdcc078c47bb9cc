"""The batched engine (``dspine serve``'s cycles) on the lean decode path vs transformers'
batched forward, side by side in one process (2026-12-02).

For each concurrency c, c held-out prompts run together through :class:`dspine.core.batch.BatchEngine`
(greedy, the default settings of ``dspine serve``: hybrid proposer, cost policy, measured kernels,
or ``--mode ar``), once with the lean path (each cycle's tokens of all requests packed into one
C++ call) and once with it switched off (transformers' forward over the padded batch, as before
2026-12-02), alternating which goes first per round. The figure is output tokens per second of
the whole batch (decode only: prefill is the same single-request path in both). Output ids of the
two must be equal.

    python benchmarks/archive/batch_lean.py --concurrency 1 2 4 --rounds 2 --out benchmarks/archive/batch_lean_avx512.json
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
    ap.add_argument("--modes", nargs="+", default=["dspine", "ar"])
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
    from dspine.tune.machine import describe

    recs = heldout_prompts("code", 20)[16:16 + 2] + heldout_prompts("chat", 20)[16:16 + 2]
    load0 = os.getloadavg()
    runs, table = [], {}
    for mode in args.modes:
        target, eng = build_engine("smollm2-135m", None, mode, verify_policy=DEFAULT_VERIFY_POLICY,
                                   proposer="hybrid", linear_backend="auto", progress=True)
        prompts = [target.encode_prompt(r["prompt"], chat=r.get("kind") != "code") for r in recs]
        BatchEngine(eng, 1).generate_many(prompts[:1], max_new_tokens=8)  # warm-up (one-time measurements)
        for c in args.concurrency:
            ps = [prompts[i % len(prompts)] for i in range(c)]
            speeds: dict[str, list[float]] = {"lean": [], "transformers": []}
            ids: dict[str, list] = {}
            for rnd in range(args.rounds):
                order = ["lean", "transformers"] if (rnd + c) % 2 == 0 else ["transformers", "lean"]
                for path in order:
                    be = BatchEngine(eng, c)
                    if path == "transformers":
                        be.cycle.target_pass.lean_plan = lambda: None
                    t0 = time.perf_counter()
                    got = be.generate_many(ps, SamplingConfig(), max_new_tokens=args.tokens)
                    dt = time.perf_counter() - t0
                    decode = dt - sum(g.stats.ttft_s for g in got)  # prefill runs before the batch
                    n = sum(len(g.token_ids) for g in got)
                    speeds[path].append(n / decode)
                    ids.setdefault(path, [g.token_ids for g in got])
                    runs.append({"mode": mode, "concurrency": c, "round": rnd, "path": path,
                                 "tokens": n, "decode_s": round(decode, 4), "tok_s": round(n / decode, 2)})
                    print(f"{mode} c={c} round {rnd} {path:<12} {n / decode:7.1f} tok/s", flush=True)
            med = {p: statistics.median(v) for p, v in speeds.items()}
            table[f"{mode} c={c}"] = {"lean_tok_s": round(med["lean"], 1),
                                      "transformers_tok_s": round(med["transformers"], 1),
                                      "ratio": round(med["lean"] / med["transformers"], 2),
                                      "same_ids": ids["lean"] == ids["transformers"]}
    out = {"machine": describe("cpu"), "threads": args.threads, "load_start": load0, "load_end": os.getloadavg(),
           "tokens": args.tokens, "rounds": args.rounds, "table": table, "runs": runs,
           "command": "python benchmarks/archive/batch_lean.py " + " ".join(
               f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(args).items() if v is not None and k != "out")}
    for k, v in table.items():
        print(f"{k:<12} lean {v['lean_tok_s']:7.1f}  transformers {v['transformers_tok_s']:7.1f}  "
              f"{v['ratio']:.2f}x  same ids {v['same_ids']}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
