"""Teacher-forced greedy chains of the DSpine drafter with variants of its n-gram prior.

Every answer position of N code + N chat training-stream rows the prior never saw is an
anchor. The rows come after ``--prior-rows`` of the committed data; the prior is built from
the rows before them, less every row of an evaluated row's stdlib module or ShareGPT
conversation. They are target-greedy answers, so the committed tokens at an anchor are
exactly what greedy decoding would have committed. At each anchor the drafter's
context holds the target's features of every earlier position, the real proposer
(:class:`dspine.proposers.drafter.DrafterProposer`: block forward, candidate pass, fused
copy, conditional tables, serial chain) proposes a full block, and the leading rows that
equal the answer are its acceptance. This is the acceptance of a full-block chain at every
anchor rather than at the anchors one decoding run visits, so it is denser than ``dspine
acceptance`` (which it approximates) and costs no target verification. Acceptance only: the
machine and its load do not matter.

Variants (``--variants``, each ``name:key=value,...``):
    data=F      build the prior from the first F (0..1] of the prior rows
    weight=W    ``--ngram-prior-weight``
    weight1=W   another weight on row 1 (``weight`` on the later rows)
    beta=B      Dirichlet backoff smoothing (NgramPrior.lookup; 0: the longest match alone;
                default: the library's BETA)
    top=T       continuations kept per context (default: the library's TOP)
    prune=M     contexts of 2+ tokens seen fewer than M times dropped (1: none)
    off=1       no prior (the drafter alone)

    python benchmarks/ngram_prior_variants.py --n 30 --tokens 96 \\
        --variants off:off=1 longest:beta=0,top=2 shipped: top2:top=2 half:data=0.5
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ngram_prior_tuning import DATA, emit, group, rows  # noqa: E402

from dspine.drafter.ngram_prior import BETA, TOP, NgramPrior  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--prior-rows", type=int, default=12896)
    ap.add_argument("--n", type=int, default=40, help="rows per kind after --prior-rows")
    ap.add_argument("--skip", type=int, default=0, help="rows after --prior-rows skipped first")
    ap.add_argument("--tokens", type=int, default=128, help="answer tokens per row (anchors)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--variants", nargs="+", default=["off:off=1", "base:"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from dspine.build import default_drafter_path
    from dspine.config import SamplingConfig
    from dspine.drafter.checkpoint import load_drafter
    from dspine.drafter.vocab import resolve
    from dspine.runtime.select import apply_runtime
    from dspine.target.adapter import load_target
    from dspine.tune.drafter import measured_proposer
    from dspine.tune.machine import describe

    all_rows = list(rows(Path(args.data)))
    ev = {"code": [], "chat": []}
    groups = set()
    for r in all_rows[args.prior_rows + args.skip:]:
        k = "code" if r.get("kind") == "code" else "chat"
        if len(ev[k]) < args.n:
            ev[k].append((r["prompt_ids"][-args.prompt_tokens:], r["response_ids"][:args.tokens]))
            groups.add(group(r))
    # the prior never holds a row of an evaluated stdlib module or ShareGPT conversation: later
    # cuts of one module continue the same code (a memory of it would be a leak, not a skill)
    prior_rows = [r for r in all_rows[:args.prior_rows] if group(r) not in groups]
    print(f"prior rows: {len(prior_rows)} of the first {args.prior_rows} (others share a module or "
          f"conversation with an evaluated row)", file=sys.stderr, flush=True)
    target = load_target("smollm2-135m", dtype="float32")
    apply_runtime(target, "auto")
    path = default_drafter_path("smollm2-135m", "dspine")
    d = load_drafter(path, target).eval()
    vocab = resolve("auto", str(path), d.cfg.vocab_size, d.cfg.head_topk)
    layers = list(d.cfg.feature_layers)
    t0 = time.time()
    feats = {}
    for k, seqs in ev.items():
        feats[k] = [target.forward(torch.tensor([p + a]), None, layers, logits_to_keep=1).features[0]
                    for p, a in seqs]
    print(f"features in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    built: dict[float, NgramPrior] = {}
    res = {"machine": describe(), "args": vars(args), "prior_rows": len(prior_rows), "anchors": {}, "variants": {}}
    B = d.cfg.block_size - 1
    for spec in args.variants:
        name, _, kv = spec.partition(":")
        opt = dict(x.split("=") for x in kv.split(",") if x)
        prior = None
        if not opt.get("off"):
            how = (float(opt.get("data", 1)), int(opt.get("top", TOP)), int(opt.get("prune", 1)))
            if how not in built:
                n = max(1, int(round(how[0] * len(prior_rows))))
                built[how] = NgramPrior.build(((r["prompt_ids"], r["response_ids"]) for r in prior_rows[:n]),
                                              top=how[1], min_total=how[2])
            b = built[how]
            w = float(opt.get("weight", 0.5))
            prior = NgramPrior(b.keys, b.ids, b.counts, b.totals, weight=w,
                               row1_weight=float(opt.get("weight1", w)), beta=float(opt.get("beta", BETA)))
            print(f"{name}: {b.keys.shape[0]} contexts, {b.nbytes() / 2**20:.1f} MiB", file=sys.stderr, flush=True)
        prop = measured_proposer(d, linears="float32", vocab=vocab, progress=False, prior=prior)
        t1 = time.time()
        out = {}
        for k, seqs in ev.items():
            hist = np.zeros(B + 1, dtype=np.int64)  # anchors by accepted rows
            for (p, a), f in zip(seqs, feats[k]):
                st = prop.new_state(p)
                prop.commit(st, f[:len(p) - 1], 0)
                prop.observe(st, p[:-1], 0)
                ids = p + a
                for pos in range(len(p) - 1, len(ids) - 1):  # anchor ids[pos]; rows predict ids[pos+1..]
                    if pos > len(p) - 1:
                        prop.commit(st, f[pos - 1:pos], pos - 1)
                        prop.observe(st, ids[pos - 1:pos], pos - 1)
                    n = min(B, len(ids) - 1 - pos)
                    pr = prop.propose(st, ids[pos], pos, n, SamplingConfig(), None)
                    got = pr.tokens.tolist()
                    acc = 0
                    while acc < n and got[acc] == ids[pos + 1 + acc]:
                        acc += 1
                    hist[acc] += 1
            tot = int(hist.sum())
            reach = hist[::-1].cumsum()[::-1] / tot  # reach[j]: share of anchors with >= j rows right
            out[k] = {"tau": round(1 + float(reach[1:].sum()), 4),
                      "rows_1_to_k": [round(float(x), 4) for x in reach[1:5]],
                      "tau_n3": round(1 + float(reach[1:4].sum()), 4)}
            res["anchors"][k] = tot
        res["variants"][name] = {"settings": opt, **out}
        print(f"{name} {opt}: {out} ({time.time() - t1:.0f} s)", file=sys.stderr, flush=True)
    return emit(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
