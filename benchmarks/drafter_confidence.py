"""Would cutting the drafter's chain where its own confidence drops make drafting pay here?

The cost controller picks one verification length n per cycle from past acceptance. A
drafter also knows, per row, how sure it is: the probability its continuous logits give
their top token (softmax over the draft vocabulary, the candidate pass's scores). Cutting
the chain at the first row below a threshold t (a stopping rule on the drafted rows only,
so verification stays exact, like the end-of-request cut) verifies only rows the drafter
is sure of. This script measures, teacher-forced on the target's own greedy answers to
held-out prompts, row by row: the top probability and whether the top token is the
target's. It then replays, for every answer position as the anchor, a cycle that drafts
``--rows`` rows (cost: the measured proposal cost of that many rows) and verifies the
confident prefix (cost: the measured verification of n tokens), and prints the expected
speed over plain decoding from this machine's cached cost curve (``dspine tune``): with no
cut at the best fixed n, and with the cut at each threshold. An anchor whose first row is
below t pays the draft for a plain step; nothing here is timed.

    python benchmarks/drafter_confidence.py --n 32 --out benchmarks/drafter-diagnosis/confidence-<cpu>-<date>.json

Positions are counted as anchors one by one (not only those a real run would reach after
its accepted tokens), so the figures are a model of the cycle, not a run: use them to
decide whether the rule is worth building, then measure it with ``dspine bench``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_diagnosis import features, greedy_answers  # noqa: E402


@torch.no_grad()
def rows_confidence(drafter, seqs, feats, vocab, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top probability [A, rows] float, top token right [A, rows] bool) over every answer
    anchor A of ``seqs``; a row past the sequence's end counts as wrong."""
    H = drafter.head if vocab is None else drafter.head[vocab]
    conf, ok = [], []
    for (ids, rs), f in zip(seqs, feats):
        T = len(ids)
        a = torch.arange(max(rs, 1), T - 1)[None]
        if a.numel() == 0:
            continue
        ids_t = torch.tensor([ids])
        pos = torch.arange(T)[None]
        ctx = drafter.context_kv(f[None].float(), pos)
        o = drafter.forward_blocks(ids_t[:, a[0]], a, ctx, pos, torch.ones(1, T, dtype=torch.bool))
        z = (drafter.norm_f(o.h[:, :, 1:rows + 1]) @ H.T)[0].float()  # [nb, rows, Vs]
        pm, top = z.softmax(-1).max(-1)
        pred = vocab[top] if vocab is not None else top
        p = a[0][:, None] + torch.arange(1, rows + 1)[None]  # [nb, rows]
        truth = ids_t[0, p.clamp(max=T - 1)]
        conf.append(pm)
        ok.append((pred == truth) & (p < T))
    return torch.cat(conf), torch.cat(ok)


def replay(conf: torch.Tensor, ok: torch.Tensor, verify_s: list[float], propose_s: list[float],
           n_fixed: int | None, threshold: float, rows: int) -> dict:
    """Expected tokens per cycle, cost per cycle and speed over plain decoding of cycles that
    draft ``rows`` rows (``n_fixed``: verify exactly that many, no cut; else the prefix whose
    top probabilities are all >= ``threshold``)."""
    A = conf.shape[0]
    if n_fixed is not None:
        n = torch.full((A,), n_fixed)
        draft = propose_s[n_fixed] if n_fixed else 0.0
    else:
        below = conf < threshold
        first_low = torch.where(below.any(1), below.float().argmax(1), torch.full((A,), rows))
        n = first_low
        draft = propose_s[rows]
    wrong = ~ok
    first_wrong = torch.where(wrong.any(1), wrong.float().argmax(1), torch.full((A,), ok.shape[1]))
    acc = torch.minimum(first_wrong, n)
    tokens = (1 + acc).float().mean().item()
    cost = sum(verify_s[int(k)] for k in n.tolist()) / A + draft
    return {"tokens_per_cycle": round(tokens, 4), "cycle_ms": round(cost * 1e3, 3),
            "speed": round(tokens / cost * verify_s[0], 4), "mean_n": round(n.float().mean().item(), 3),
            "share_n0": round((n == 0).float().mean().item(), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default=None, help="checkpoint (default: the shipped DSpine drafter)")
    ap.add_argument("--n", type=int, default=32, help="held-out prompts per set")
    ap.add_argument("--tokens", type=int, default=64, help="greedy answer tokens per prompt")
    ap.add_argument("--rows", type=int, default=4, help="rows drafted per cycle with the cut")
    ap.add_argument("--threads", type=int, default=1, help="threads of this script's own forwards (the cost "
                    "curve read is the one decoding uses, at the machine's default threads)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for flag, v, lo, hi in (("--n", args.n, 1, None), ("--tokens", args.tokens, 1, None), ("--rows", args.rows, 1, 15),
                            ("--threads", args.threads, 1, None)):
        if v < lo or (hi is not None and v > hi):
            ap.error(f"{flag} {v}: must be " + (f"in {lo}..{hi}" if hi else f">= {lo}"))
    from dspine.build import default_drafter_path
    from dspine.drafter.checkpoint import load_drafter
    from dspine.drafter.vocab import resolve
    from dspine.target.adapter import load_target
    from dspine.tune import store
    from dspine.tune.machine import describe

    from dspine.tune.conditions import untrusted_reason

    # the default engine's curve: the shipped DSpine drafter on the default target in float32
    want = "smollm2-135m float32"
    drafting = [(k, e) for k, e in sorted(store.load()["entries"].items())
                if k.startswith("cost:") and isinstance(e, dict) and isinstance(e.get("curve"), dict)
                and e["curve"].get("propose_s")]
    curves = [(k, e) for k, e in drafting
              if str(e.get("label", "")).startswith(want) and "drafter dspine" in str(e.get("label", ""))]
    if not curves:  # entries written before 2026-12-06 carry no label: assumed the default engine's
        curves = [(k, {**e, "label": "(no label: assumed the default engine's)"}) for k, e in drafting
                  if "label" not in e]
    if not curves:
        raise SystemExit(f"drafter_confidence: no cost curve of the DSpine drafter on {want} is cached on this machine: "
                         f"run `dspine generate` or `dspine tune` with the defaults first")
    curves.sort(key=lambda kv: untrusted_reason(kv[1]) is not None)  # a trusted curve first
    key, entry = curves[0]
    c = entry["curve"]
    print(f"cost curve {key} ({entry['label']}, measured {entry.get('measured_at')})"
          + (f"; NOT TRUSTED: {untrusted_reason(entry)}" if untrusted_reason(entry) else ""))
    verify_s, propose_s = c["verify_s"], c["propose_s"]
    machine = describe()  # the machine the curve was measured on (its threads: read before ours change)
    torch.set_num_threads(args.threads)
    path = Path(args.drafter or default_drafter_path("smollm2-135m", "dspine"))
    if not (path / "config.json").is_file():
        ap.error(f"--drafter {path}: not a drafter checkpoint directory (no config.json)")
    target = load_target("smollm2-135m", dtype="float32")
    d = load_drafter(path, target).float().eval()
    vocab = resolve("auto", str(path), d.cfg.vocab_size, d.cfg.head_topk)
    res = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "drafter": str(path.name),
           "cost_curve": key, "cost_curve_label": entry["label"], "cost_curve_trusted": untrusted_reason(entry) is None, "verify_ms": [round(v * 1e3, 3) for v in verify_s],
           "propose_ms": [round(v * 1e3, 3) for v in propose_s], "args": vars(args), "sets": {}}
    for kind in ("code", "chat"):
        seqs = greedy_answers(target, kind, args.n, args.tokens)
        conf, ok = rows_confidence(d, seqs, features(target, seqs, list(d.cfg.feature_layers), False), vocab,
                                   args.rows)
        bins = [0.0, 0.2, 0.4, 0.6, 0.8, 1.01]
        calib = [{"p_top": f"{lo:.1f}-{min(hi, 1.0):.1f}", "share": round(((conf[:, 0] >= lo) & (conf[:, 0] < hi))
                                                                         .float().mean().item(), 4),
                  "row1_right": round(ok[:, 0][(conf[:, 0] >= lo) & (conf[:, 0] < hi)].float().mean().item(), 4)
                  if ((conf[:, 0] >= lo) & (conf[:, 0] < hi)).any() else None}
                 for lo, hi in zip(bins, bins[1:])]
        fixed = {n: replay(conf, ok, verify_s, propose_s, n, 0.0, args.rows) for n in range(0, args.rows + 1)}
        cut = {f"{t:.2f}": replay(conf, ok, verify_s, propose_s, None, t, args.rows)
               for t in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)}
        res["sets"][kind] = {"anchors": int(conf.shape[0]), "row1_calibration": calib,
                             "fixed_n": fixed, "cut_at_threshold": cut}
        best_fixed = max(fixed.items(), key=lambda kv: kv[1]["speed"])
        best_cut = max(cut.items(), key=lambda kv: kv[1]["speed"])
        print(f"{kind}: {conf.shape[0]} anchors; row 1 right {ok[:, 0].float().mean():.3f}; best fixed n = "
              f"{best_fixed[0]}: {best_fixed[1]['speed']:.3f}x plain; best cut t = {best_cut[0]}: "
              f"{best_cut[1]['speed']:.3f}x (mean n {best_cut[1]['mean_n']}, no proposal in "
              f"{best_cut[1]['share_n0']:.0%} of cycles)")
        for row in calib:
            print(f"  row-1 top probability {row['p_top']}: {row['share']:.0%} of anchors, right {row['row1_right']}")
    print(res["machine"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
