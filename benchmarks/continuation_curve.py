"""Learning curves of `dspine train` runs: held-out tau and rows 1-4 against training seconds.

Reads each run's ``metrics.jsonl`` (the periodic ``--eval-every`` records that
:func:`dspine.train.acceptance.measure_acceptance` wrote, and the step records' ``wall_s``:
seconds of training in that process, evaluations excluded) and, with ``--start NAME=DIR``,
measures a run's starting checkpoint with the same settings as the periodic evaluation
(``--eval-prompts`` prompts per set, 48 new tokens, greedy, the target in the runs' feature dtype, the drafter
alone, chains verified whole, the candidate pass over all tokens), so that every curve starts at step 0. ``--reference NAME=DIR`` measures
other checkpoints the same way and draws them as horizontal lines (the shipped drafter beside
runs from scratch). Writes a JSON file and a plot next to it.

    python benchmarks/continuation_curve.py --runs dspine=runs/dspine dflash=runs/dflash \\
        --start dspine=src/dspine/checkpoints/smollm2-135m-dspine \\
                dflash=src/dspine/checkpoints/smollm2-135m-dflash \\
        --eval-prompts 16 --out benchmarks/drafter-diagnosis/continuation-amx-2026-12-07.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_curve(run: Path) -> list[dict]:
    """The evaluation points of one run: step, training seconds at that step, tau and rows.

    ``train_s`` is the ``wall_s`` of the step record at the evaluation's step (or the last
    one before it); one point per step, in step order. Raises ``SystemExit`` naming ``--runs``
    when ``run`` has no ``metrics.jsonl``."""
    f = run / "metrics.jsonl"
    if not f.exists():
        raise SystemExit(f"--runs {run}: no metrics.jsonl (not a `dspine train --out` directory)")
    wall: dict[int, float] = {}
    points = []
    for line in f.read_text().splitlines():
        rec = json.loads(line)
        if "wall_s" in rec:
            wall[rec["step"]] = rec["wall_s"]
        if "tau_code" in rec:
            points.append(rec)
    # a run stopped between a save and its next one repeats those steps after --resume:
    # the last record of a step is the one the saved run continued from
    points = list({rec["step"]: rec for rec in points}.values())
    out = []
    for rec in sorted(points, key=lambda r: r["step"]):
        s = rec["step"]
        w = wall.get(s, max((v for k, v in wall.items() if k <= s), default=0.0))
        out.append({"step": s, "train_s": w, "tau_code": rec["tau_code"], "tau_chat": rec["tau_chat"],
                    "rows_code": rec.get("row_accept_code", [])[:4],
                    "rows_chat": rec.get("row_accept_chat", [])[:4]})
    return out


def start_point(path: str, n: int, dtype: str = "bfloat16") -> dict:
    """The starting checkpoint measured as the periodic evaluation measures: 48 tokens, the target
    in ``dtype``. A training process moves its target to ``--feature-dtype`` (bfloat16 by default
    and always with a feature store) before its first evaluation, so its greedy answers are the
    bfloat16 target's; a float32 start point would be measured on other answers."""
    import torch

    from dspine.drafter.checkpoint import load_drafter
    from dspine.target.adapter import load_target
    from dspine.train.acceptance import measure_acceptance

    target = load_target("smollm2-135m", dtype="float32")
    d = load_drafter(path, target, dtype=torch.float32)
    target.model.to(getattr(torch, dtype))  # as dspine.train.loop does with the features' dtype
    target.dtype = getattr(torch, dtype)
    r = measure_acceptance(target, d, n=n, max_new_tokens=48)  # all tokens, as the periodic evaluation
    return {"step": 0, "train_s": 0.0, "tau_code": r["tau_code"], "tau_chat": r["tau_chat"],
            "rows_code": r["row_accept_code"][:4], "rows_chat": r["row_accept_chat"][:4]}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, s in zip(axes, ("code", "chat")):
        for name, pts in res["curves"].items():
            xs = [p["step"] for p in pts] if res.get("x") == "steps" else [p["train_s"] / 60 for p in pts]
            ax.plot(xs, [p[f"tau_{s}"] for p in pts], marker="o", label=name)
        for i, (name, ref) in enumerate(res.get("references", {}).items()):
            ax.axhline(ref[f"tau_{s}"], color=f"C{len(res['curves']) + i}", ls="--", lw=1,
                       label=f"{name}: {ref[f'tau_{s}']:.3f}")
        ax.set_title(f"held-out {s}")
        ax.set_xlabel("training steps" if res.get("x") == "steps" else "training minutes (1 thread each)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tau, drafter alone (greedy chain, 48 tokens)")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    fig.suptitle(res.get("title", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", required=True, metavar="NAME=DIR")
    ap.add_argument("--start", nargs="*", default=[], metavar="NAME=CHECKPOINT")
    ap.add_argument("--reference", nargs="*", default=[], metavar="NAME=CHECKPOINT",
                    help="checkpoints measured like the start points, drawn as horizontal lines (e.g. the "
                         "shipped drafter beside runs from scratch)")
    ap.add_argument("--eval-prompts", type=int, default=16, help="the runs' --eval-prompts")
    ap.add_argument("--start-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the target's dtype in the runs' periodic evaluations: their --feature-dtype")
    ap.add_argument("--x", choices=["time", "steps"], default="time",
                    help="the plot's x axis: training minutes (the runs' wall_s; equal load assumed) or steps "
                         "(where the machine's load changed during the runs)")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = dict(r.split("=", 1) for r in args.runs)
    starts = dict(s.split("=", 1) for s in args.start)
    if set(starts) - set(runs):
        ap.error(f"--start names {sorted(set(starts) - set(runs))}, which --runs does not")
    from dspine.tune.machine import describe

    res = {"machine": describe(), "date": time.strftime("%Y-%m-%d"), "args": vars(args), "title": args.title,
           "x": args.x, "curves": {}}
    for name, d in runs.items():
        pts = read_curve(Path(d))
        if name in starts:
            print(f"measuring the start of {name} ({starts[name]}) ...", file=sys.stderr, flush=True)
            pts = [start_point(starts[name], args.eval_prompts, args.start_dtype)] + pts
        res["curves"][name] = pts
    refs = dict(r.split("=", 1) for r in args.reference)
    if refs:
        res["references"] = {}
        for name, ck in refs.items():
            print(f"measuring the reference {name} ({ck}) ...", file=sys.stderr, flush=True)
            res["references"][name] = start_point(ck, args.eval_prompts, args.start_dtype)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    plot(res, Path(args.out).with_suffix(".png"))
    print(json.dumps({k: v[-1] for k, v in res["curves"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
