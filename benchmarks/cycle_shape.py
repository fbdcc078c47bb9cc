"""What a target forward over n + 1 tokens costs against a plain step, in one process.

Times ``target.forward`` of n + 1 tokens (the anchor and n proposals) after a 64- and a
256-token context, the points n = 0, 1, 2, 3, 4, 8, 15 in interleaved rounds (the first round
a warm-up), the way :func:`dspine.tune.cost.measure_cost` times the cost curve, with the
default target, runtime and kernels that ``dspine generate`` builds. Prints and writes the
median milliseconds per point and their ratio to the plain step (n = 0): the shape of the
cost curve, to compare with a cached one (``dspine tune --show``).

    python benchmarks/cycle_shape.py --rounds 25 --out benchmarks/drafter-diagnosis/cycle-shape-<isa>-<date>.json

Run it on an otherwise idle machine: it is a timing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from dspine.build import build_engine
    from dspine.config import SpeculativeConfig
    from dspine.tune.machine import describe

    target, engine = build_engine(SpeculativeConfig(), progress=False)
    prop = engine.proposer
    layers = None
    for obj in (prop, getattr(prop, "drafter_proposer", None)):
        if obj is not None and getattr(obj, "feature_layers", None):
            layers = list(obj.feature_layers)
    V = target.vocab_size
    pts = [0, 1, 2, 3, 4, 8, 15]
    res = {"machine": describe(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
           "rounds": args.rounds, "contexts": {}}
    with torch.no_grad():
        for context in args.contexts:
            ids = (torch.arange(1, context + 17) * 7919 % (V - 1) + 1)[None]
            cache = target.new_cache()
            target.forward(ids[:, :context], cache, layers, logits_to_keep=1)
            cache.rollback(context)
            times: dict[int, list[float]] = {n: [] for n in pts}
            for r in range(args.rounds):
                for n in pts:
                    t0 = time.perf_counter()
                    target.forward(ids[:, context: context + n + 1], cache, layers)
                    dt = time.perf_counter() - t0
                    cache.rollback(context)
                    if r:  # the first round is a warm-up
                        times[n].append(dt)
            med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
            res["contexts"][str(context)] = {"ms": {str(n): round(m, 2) for n, m in med.items()},
                                             "ratio_to_plain": {str(n): round(m / med[0], 3) for n, m in med.items()}}
            print(context, res["contexts"][str(context)], file=sys.stderr)
    print(json.dumps(res))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
