"""Training curves of the shipped drafters: DSpine vs DFlash-style, same data and steps.

Reads the ``metrics.jsonl`` that ``dspine train`` writes (one record per 10 steps:
``ce`` = position-decayed cross-entropy of rows 1..B-1, ``fs`` = final-stage K-way
CE (DSpine only), ``acc1`` = row-1 top-1 accuracy of the continuous logits on the
training batch) and plots moving averages against the training step. Copies the
metrics next to the plot so the figure can be redrawn from the repository.

    python benchmarks/training_curves.py --run dspine=runs/dspine --run dflash=runs/dflash \
        [--run dspine-s4=runs/dspine4@7060 ...] \
        --out benchmarks/training

A run given as ``NAME=RUN_DIR@STEPS`` starts at STEPS (a warm start from an earlier
run); runs whose names share the part before ``-s`` (``dspine``, ``dspine-s3``) share a
colour, so successive warm-started runs read as one curve.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def _load(path: Path) -> list[dict]:
    return [r for r in (json.loads(l) for l in path.read_text().splitlines() if l.strip()) if "ce" in r]


def _smooth(xs: list[float], k: int = 10) -> list[float]:
    out, acc = [], []
    for x in xs:
        acc.append(x)
        acc = acc[-k:]
        out.append(sum(acc) / len(acc))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", required=True,
                    help="NAME=RUN_DIR[@STEPS] (holds metrics.jsonl; STEPS trained before it)")
    ap.add_argument("--out", default="benchmarks/training")
    ap.add_argument("--step-offset", type=int, default=0, help="steps trained before these runs (warm start)")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    colors: dict[str, str] = {}
    for spec in args.run:
        name, run = spec.split("=", 1)
        run, _, off = run.partition("@")
        offset = int(off) if off else args.step_offset
        family = name.split("-s")[0]
        src = Path(run) / "metrics.jsonl" if Path(run).is_dir() else Path(run)
        if src.resolve() != (out / f"{name}.metrics.jsonl").resolve():
            shutil.copyfile(src, out / f"{name}.metrics.jsonl")
        rs = _load(src)
        steps = [r["step"] + offset for r in rs]
        first = family not in colors  # one legend entry per family (warm-started runs continue it)
        (line,) = a1.plot(steps, _smooth([r["ce"] for r in rs]), color=colors.get(family),
                          label=f"{family} CE rows 1..15" if first else None)
        colors[family] = line.get_color()
        if offset:
            for a in (a1, a2):  # where a warm-started run (fresh warm-up and schedule) begins
                a.axvline(offset, color="0.85", lw=0.8, zorder=0)
        if any(r.get("fs", 0) for r in rs):
            a1.plot(steps, _smooth([r["fs"] for r in rs]), "--", color=line.get_color(),
                    label=f"{family} final-stage CE" if first else None)
        a2.plot(steps, _smooth([r["acc1"] for r in rs]), color=line.get_color(), label=family if first else None)
    a1.set_xlabel("training step (grey lines: a warm-started run begins)")
    a1.set_ylabel("loss (nats, moving avg of 10 logs)")
    a1.legend()
    a2.set_xlabel("training step (grey lines: a warm-started run begins)")
    a2.set_ylabel("row-1 top-1 accuracy (training batches)")
    a2.legend()
    fig.suptitle("smollm2-135m drafters: same data, steps and compute")
    fig.tight_layout()
    fig.savefig(out / "training_curves.png", dpi=110)
    print(out / "training_curves.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
