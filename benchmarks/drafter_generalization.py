"""Does the shipped drafter generalize, or has it learned its training rows?

Teacher-forced row accuracy (share of answer anchors whose rows 1..k are all right: for a
greedy chain exactly the engine's acceptance, see ``drafter_diagnosis.py``) of the shipped
DSpine and DFlash-style drafters on three sets of the target's own greedy answers:

- ``seen``: the first ``--seen`` rows of the committed data (``training-data/smollm2-135m-regen``):
  prompts from the start of the ShareGPT and stdlib training streams, which the shipped
  drafters' data (built 2026-11-29/30 from the same streams, 4,546 ShareGPT and ~3,000
  stdlib rows) also held: trained on;
- ``unseen``: rows ``--unseen-from`` onward of ``--unseen-data`` (the same training
  streams, further on than the shipped drafters' data reached): the same distribution,
  never trained on;
- ``heldout``: the held-out code and chat prompts (``dspine.data.splits``), the sets τ is
  reported on.

If ``seen`` is far above ``unseen`` the drafter has memorized its rows and more data (not
more steps) is what it lacks; if ``unseen`` is far above ``heldout`` the held-out sets
differ from the training streams.

    python benchmarks/drafter_generalization.py --seen 300 --unseen-data DIR --unseen-from 9072 \
        --out benchmarks/drafter-diagnosis/generalization-<cpu>-<date>.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _diagnosis():
    spec = importlib.util.spec_from_file_location("drafter_diagnosis", ROOT / "benchmarks" / "drafter_diagnosis.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seen", type=int, default=300, help="first N rows of the committed data")
    ap.add_argument("--unseen-data", type=Path, required=True, help="data directory holding the unseen rows")
    ap.add_argument("--unseen-from", type=int, required=True, help="index of its first unseen row")
    ap.add_argument("--unseen", type=int, default=300, help="at most N unseen rows")
    ap.add_argument("--max-len", type=int, default=256, help="window per row (prompt cut first)")
    ap.add_argument("--eval-n", type=int, default=16, help="held-out prompts per set (code, chat)")
    ap.add_argument("--eval-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.seen < 1 or args.unseen < 1 or args.unseen_from < 0:
        ap.error("--seen, --unseen must be >= 1 and --unseen-from >= 0")
    torch.set_num_threads(args.threads)
    D = _diagnosis()

    from dspine.build import default_drafter_path
    from dspine.data.load import load_dataset
    from dspine.drafter.checkpoint import load_drafter
    from dspine.drafter.vocab import resolve
    from dspine.target.adapter import load_target
    from dspine.train.losses import fit_window
    from dspine.tune.machine import describe

    t0 = time.time()
    say = lambda *a: print(f"[{time.time() - t0:7.1f}s]", *a, file=sys.stderr, flush=True)  # noqa: E731
    target = load_target("smollm2-135m", dtype="float32")
    committed = load_dataset(ROOT / "training-data" / "smollm2-135m-regen", target)
    extra = load_dataset(args.unseen_data, target)
    if args.unseen_from >= len(extra):
        ap.error(f"--unseen-from {args.unseen_from}: {args.unseen_data} holds only {len(extra)} rows")
    sets = {"seen": committed[:args.seen], "unseen": extra[args.unseen_from:args.unseen_from + args.unseen]}
    seqs = {k: [fit_window(s.input_ids, s.response_start, args.max_len) for s in v] for k, v in sets.items()}
    for kind in ("code", "chat"):
        seqs[f"heldout_{kind}"] = D.greedy_answers(target, kind, args.eval_n, args.eval_tokens)
    res = {"machine": describe(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=ROOT).stdout.strip(),
           "args": {k: str(v) for k, v in vars(args).items()},
           "rows": {k: len(v) for k, v in seqs.items()},
           "answer_tokens": {k: sum(len(s) - r for s, r in v) for k, v in seqs.items()},
           "sources": {k: {src: sum(1 for s in v if s.source == src) for src in {s.source for s in v}}
                       for k, v in sets.items()},
           "unseen_ids_first_last": [sets["unseen"][0].id, sets["unseen"][-1].id]}
    say("sets", res["rows"], res["answer_tokens"])
    mods = {m: load_drafter(default_drafter_path("smollm2-135m", m), target).eval() for m in ("dspine", "dflash")}
    layers = list(mods["dspine"].cfg.feature_layers)
    assert all(list(d.cfg.feature_layers) == layers for d in mods.values())
    for name, ss in seqs.items():
        feats = D.features(target, ss, layers, False)
        for m, d in mods.items():
            vocab = resolve("auto", str(default_drafter_path("smollm2-135m", m)), d.cfg.vocab_size, d.cfg.head_topk)
            rows = D.drafter_rows(d, ss, feats, vocab)
            res[f"{m}_rows_{name}"] = rows
            res[f"{m}_conditional_{name}"] = [rows[0]] + [round(b / a, 4) if a else None
                                                         for a, b in zip(rows, rows[1:])]
        say(name, {m: res[f"{m}_rows_{name}"] for m in mods})
    res["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(res))
    print("\nrows 1..4 all right (teacher-forced), DSpine | DFlash-style:", file=sys.stderr)
    for name in seqs:
        print(f"  {name:14s} {res['answer_tokens'][name]:7d} tok  " + "  |  ".join(
            " ".join(f"{x:.3f}" for x in res[f"{m}_rows_{name}"]) for m in mods), file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
