"""How much of row 1 the target's own confidence allows: the drafter's teacher-forced row-1
accuracy split by the target's top-1 probability at the predicted position.

For every answer anchor ``a`` of the target's own greedy answers to held-out code and chat
prompts, the drafter's row 1 predicts ``x_{a+1}`` from the target's features up to ``a-1``
and the token ``x_a``. The target's softmax at position ``a`` gives the probability ``p1`` of
that greedy token (the top-1) and the margin to the second token. Positions where ``p1`` is
low are near-ties of the target: a small drafter that cannot redo the target's computation on
``x_a`` has little to go on there. The script reports, per ``p1`` bucket, the share of
positions and the drafter's row-1 accuracy (the continuous logits' argmax over its draft
vocabulary, as `drafter_diagnosis.py` measures rows), and the logit lens of the target's own
layers *at the anchor itself* (the hidden state after the first ``L`` layers, transformers'
``hidden_states[L]``, through the final norm and head: what a drafter that had the target's
processing of ``x_a`` up to layer ``L`` could read off directly; the drafters' last feature
layer, 28 in their 0-based config, is ``L`` = 29 here).

    python benchmarks/drafter_ceiling.py --n 32 --tokens 64 \\
        --out benchmarks/drafter-diagnosis/ceiling-avx512-zen4-2026-12-07.json

Accuracy figures do not depend on load; the script times nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_diagnosis import greedy_answers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUCKETS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0001)


def ngram_tables(data, V: int) -> tuple[np.ndarray, dict]:
    """Top-1 continuation tables of the training answers: bigram ``x_a -> x_{a+1}`` as an
    array [V] (-1: never seen), trigram ``(x_{a-1}, x_a) -> x_{a+1}`` as a dict.

    data: ``dspine.data.load`` sequences (input_ids, response_start)."""
    a, b, c = [], [], []
    for s in data:
        r = np.asarray(s.input_ids[max(s.response_start - 2, 0):], dtype=np.int64)  # triples ending in the answer
        if r.size >= 3:
            a.append(r[:-2]); b.append(r[1:-1]); c.append(r[2:])
    a, b, c = np.concatenate(a), np.concatenate(b), np.concatenate(c)
    big = np.full(V, -1, dtype=np.int64)
    keys, cnt = np.unique(b * V + c, return_counts=True)
    order = np.lexsort((-cnt, keys // V))  # by x_a, most frequent first
    k = keys[order]
    first = np.r_[True, (k[1:] // V) != (k[:-1] // V)]
    big[k[first] // V] = k[first] % V
    tri_keys, tri_cnt = np.unique((a * V + b) * V + c, return_counts=True)
    ctx = tri_keys // V
    order = np.lexsort((-tri_cnt, ctx))
    k, cx = tri_keys[order], ctx[order]
    first = np.r_[True, cx[1:] != cx[:-1]]
    tri = dict(zip(cx[first].tolist(), (k[first] % V).tolist()))
    return big, tri


@torch.no_grad()
def per_position(target, drafter, vocab, seqs, lens_layers: list[int], tables=None) -> list[dict]:
    """One record per answer anchor: p1, margin, drafter row 1 right, lens right per layer,
    and (with ``tables`` from :func:`ngram_tables`) the bigram's and the trigram-with-bigram-
    backoff's top-1 right.

    seqs: (ids, answer start) pairs; vocab: the drafter's draft vocabulary [Vd] int64 or None.
    """
    H = drafter.head if vocab is None else drafter.head[vocab]
    layers = list(drafter.cfg.feature_layers)
    norm = target.model.model.norm
    head = target.model.get_output_embeddings().weight
    recs = []
    for ids, rs in seqs:
        T = len(ids)
        o = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        probs = torch.softmax(o.logits[0].float(), -1)  # [T, V]: position t predicts x_{t+1}
        f = torch.cat([o.hidden_states[l + 1][0] for l in layers], -1)[None].float()
        a = torch.arange(max(rs, 1), T - 1)
        if a.numel() == 0:
            continue
        pos = torch.arange(T)[None]
        ids_t = torch.tensor([ids])
        ctx = drafter.context_kv(f, pos)
        out = drafter.forward_blocks(ids_t[:, a], a[None], ctx, pos, torch.ones(1, T, dtype=torch.bool))
        pred = (drafter.norm_f(out.h[0, :, 1]) @ H.T).argmax(-1)
        if vocab is not None:
            pred = vocab[pred]
        truth = ids_t[0, a + 1]
        top2 = probs[a].topk(2, dim=-1)
        lens = {L: (norm(o.hidden_states[L][0, a]) @ head.T).argmax(-1) == truth for L in lens_layers}
        for j in range(a.numel()):
            ng = {}
            if tables is not None:
                big, tri = tables
                V = big.shape[0]
                xa, xp = ids[int(a[j])], ids[int(a[j]) - 1]
                ng = {"bigram": bool(big[xa] == int(truth[j])),
                      "trigram": bool(tri.get(xp * V + xa, big[xa]) == int(truth[j]))}
            recs.append({**ng, "p1": float(top2.values[j, 0]), "margin": float(top2.values[j, 0] - top2.values[j, 1]),
                         "greedy_is_top1": bool(top2.indices[j, 0] == truth[j]),
                         "row1": bool(pred[j] == truth[j]),
                         **{f"lens{L}": bool(v[j]) for L, v in lens.items()}})
    return recs


def summarize(recs: list[dict], lens_layers: list[int]) -> dict:
    """Bucketed shares and accuracies of :func:`per_position` records."""
    cols = ["row1"] + [f"lens{L}" for L in lens_layers] + [c for c in ("bigram", "trigram") if recs and c in recs[0]]
    out = {"positions": len(recs), **{c: round(sum(r[c] for r in recs) / max(1, len(recs)), 4) for c in cols},
           "buckets": []}
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        sel = [r for r in recs if lo <= r["p1"] < hi]
        n = len(sel)
        out["buckets"].append({"p1": [lo, min(hi, 1.0)], "share": round(n / max(1, len(recs)), 4),
                               **{c: round(sum(r[c] for r in sel) / n, 4) if n else None for c in cols}})
    return out


def plot(res: dict, path: Path) -> None:
    """Per p1 bucket: the share of positions (bars) and the row-1 accuracy of the drafter, the
    target's own state after its last feature layer at the anchor (lens) and the trigram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (kind, s) in zip(axes, res["sets"].items()):
        bs = s["buckets"]
        x = list(range(len(bs)))
        ax.bar(x, [b["share"] for b in bs], color="0.85", label="share of positions")
        lens = max((int(k[4:]) for k in s if k.startswith("lens")), default=None)
        for key, lab, st in (("row1", "drafter row 1", "o-"), (f"lens{lens}", f"target after {lens} layers at the anchor (lens)", "s--"),
                             ("trigram", "trigram of the training answers", "^:")):
            if key in s:
                ax.plot(x, [b[key] if b[key] is not None else float("nan") for b in bs], st, label=f"{lab}: {s[key]:.2f}")
        ax.set_xticks(x, [f"{b['p1'][0]:.1f}-{b['p1'][1]:.1f}" for b in bs])
        ax.set_xlabel("target's probability of its greedy token (p1)")
        ax.set_title(f"{kind}: {s['positions']} answer positions")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    axes[0].set_ylabel("share / accuracy of row 1")
    fig.suptitle(f"Row 1 against the target's confidence ({str(res['machine'])[:70]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default=None, help="checkpoint (default: the shipped DSpine drafter)")
    ap.add_argument("--n", type=int, default=32, help="held-out prompts per set")
    ap.add_argument("--tokens", type=int, default=64, help="greedy answer tokens per prompt")
    ap.add_argument("--lens", type=int, nargs="+", default=[15, 22, 26, 29],
                    help="L: the target's state after its first L layers at the anchor goes through the final "
                         "norm and head (1..layers-1; the last is the target's own prediction)")
    ap.add_argument("--no-ngram", action="store_true",
                    help="skip the bigram / trigram tables of the committed training answers")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.n < 1 or args.tokens < 2 or args.threads < 1:
        ap.error("--n >= 1, --tokens >= 2 and --threads >= 1 are required")
    torch.set_num_threads(args.threads)
    from dspine.build import default_drafter_path
    from dspine.drafter.checkpoint import load_drafter
    from dspine.drafter.vocab import resolve
    from dspine.target.adapter import load_target
    from dspine.tune.machine import describe

    t0 = time.time()
    target = load_target("smollm2-135m", dtype="float32")
    nl = target.model.config.num_hidden_layers
    bad = [L for L in args.lens if not 1 <= L < nl]
    if bad:
        ap.error(f"--lens {bad}: choose from 1..{nl - 1} (the target has {nl} layers)")
    path = Path(args.drafter or default_drafter_path("smollm2-135m", "dspine"))
    d = load_drafter(path, target).float().eval()
    vocab = resolve("auto", str(path), d.cfg.vocab_size, d.cfg.head_topk)
    res = {"machine": describe(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"), "args": vars(args),
           "drafter": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path), "sets": {}}
    tables = None
    if not args.no_ngram:
        from dspine.data.load import load_dataset

        tables = ngram_tables(load_dataset(ROOT / "training-data" / "smollm2-135m-regen", target),
                              target.model.config.vocab_size)
    for kind in ("code", "chat"):
        seqs = greedy_answers(target, kind, args.n, args.tokens)
        res["sets"][kind] = summarize(per_position(target, d, vocab, seqs, args.lens, tables), args.lens)
        print(kind, json.dumps(res["sets"][kind]), file=sys.stderr, flush=True)
    res["wall_s"] = round(time.time() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    plot(res, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
