"""Tune ``--ngram-prior-weight`` on training-stream prompts the prior never saw.

The prior is built from the first ``--prior-rows`` rows of the committed training data, less
every row of a tuning prompt's stdlib module or ShareGPT conversation (before 2026-12-07 those
stayed in: every code tuning prompt's module was in the prior, which inflated its code gains);
the tuning prompts are rows after those (the same ShareGPT / stdlib streams, never held out and
never in the prior), split by kind (code / chat). For each weight: the DSpine drafter alone,
full-block greedy chains, fixed verification (what `dspine acceptance` measures on the
held-out sets), tau pooled per kind. Acceptance does not depend on the machine's load.

    python benchmarks/ngram_prior_tuning.py --weights 0 0.25 0.5 1 2 --n 12 --tokens 64
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "training-data" / "smollm2-135m-regen"


def rows(data: Path):
    shards = sorted(data.glob("data-*.jsonl.gz")) + sorted(data.glob("data-*.jsonl"))
    for s in sorted(shards, key=lambda p: p.name.split(".")[0]):
        raw = gzip.decompress(s.read_bytes()) if s.name.endswith(".gz") else s.read_bytes()
        for line in raw.splitlines():
            yield json.loads(line)


def emit(res: dict, out: str | None) -> int:
    """Print ``res`` as one JSON line and write it to ``out`` (indented) when given; exit status 0."""
    print(json.dumps(res))
    if out:
        Path(out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


def group(r: dict) -> str:
    """The stdlib module (``module:offset`` ids) or ShareGPT conversation (``conv_turn``) of a row:
    later cuts of one module continue the same code, so a prior holding one of them would leak
    the answer of another."""
    i = str(r.get("id", ""))
    return "m:" + i.split(":")[0] if r.get("kind") == "code" else "c:" + i.rsplit("_", 1)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--prior-rows", type=int, default=12896, help="rows the prior is built from (the first N)")
    ap.add_argument("--n", type=int, default=12, help="tuning prompts per kind (rows after --prior-rows)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0, 2.0])
    ap.add_argument("--row1-weights", type=float, nargs="+", default=[None],
                    help="weights of chain row 1 (default: the weight; 0 leaves row 1 unscored), each tried "
                         "with every weight")
    ap.add_argument("--beta", type=float, default=0.0, help="the prior's backoff smoothing (0: longest match)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from dspine.build import default_drafter_path
    from dspine.config import SamplingConfig
    from dspine.core.engine import Engine
    from dspine.drafter.checkpoint import load_drafter
    from dspine.drafter.ngram_prior import NgramPrior
    from dspine.drafter.vocab import resolve
    from dspine.runtime.select import apply_runtime
    from dspine.target.adapter import load_target
    from dspine.tune.drafter import measured_proposer
    from dspine.tune.machine import describe

    all_rows = list(rows(Path(args.data)))
    if len(all_rows) <= args.prior_rows:
        raise SystemExit(f"{args.data} holds {len(all_rows)} rows: none after --prior-rows {args.prior_rows}")
    tune = {"code": [], "chat": []}
    groups = set()
    for r in all_rows[args.prior_rows:]:
        k = "code" if r.get("kind") == "code" else "chat"
        if len(tune[k]) < args.n:
            tune[k].append(r["prompt_ids"])
            groups.add(group(r))
    t0 = time.time()
    kept = [r for r in all_rows[:args.prior_rows] if group(r) not in groups]
    prior = NgramPrior.build((r["prompt_ids"], r["response_ids"]) for r in kept)
    print(f"prior: {prior.keys.shape[0]} contexts from {len(kept)} rows (the first {args.prior_rows} less those "
          f"of a tuning prompt's module or conversation) in {time.time() - t0:.1f} s", file=sys.stderr)
    target = load_target("smollm2-135m", dtype="float32")
    apply_runtime(target, "auto")
    path = default_drafter_path("smollm2-135m", "dspine")
    d = load_drafter(path, target).eval()
    vocab = resolve("auto", str(path), d.cfg.vocab_size, d.cfg.head_topk)
    res = {"machine": describe(), "args": vars(args), "tune_prompts": {k: len(v) for k, v in tune.items()},
           "tau": {}}
    settings = [(w, f) for f in args.row1_weights for w in args.weights]
    for w, f in settings:
        prop = measured_proposer(d, linears="float32", vocab=vocab, progress=False,
                                 prior=None if w == 0 else NgramPrior(prior.keys, prior.ids, prior.counts,
                                                                      prior.totals, weight=w, row1_weight=f,
                                                                      beta=args.beta))
        eng = Engine(target, prop, "dspine")
        out = {}
        for k, ps in tune.items():
            emitted = cycles = 0
            for ids in ps:
                with torch.no_grad():
                    st = eng.generate(ids[-768:], SamplingConfig(), args.tokens).stats
                emitted += round(st.accepted_length_mean * st.cycles)
                cycles += st.cycles
            out[k] = round(emitted / max(cycles, 1), 4)
        res["tau"][f"weight={w},row1_weight={w if f is None else f}"] = out
        print(f"weight {w}, row 1 weight {w if f is None else f}: tau {out}", file=sys.stderr, flush=True)
    return emit(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
