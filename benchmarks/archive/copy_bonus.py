"""Copies fused into the DSpine final stage (``--copy-bonus B``): tau per bonus.

tau does not depend on the machine, only on the drafter, the target and the prompts, so
this runs the real engine loop (greedy, float32, chains, full blocks: no cost policy, as
``dspine acceptance``) with the shipped DSpine drafter and the hybrid proposer, for the
hybrid without fusion (``off``) and with fused copies at several bonuses. ``--split train``
tunes on training rows (the committed ``training-data/smollm2-135m-regen`` prompts, never
evaluation or held-out prompts); ``--split heldout`` then measures the chosen bonus on the
held-out sets (``heldout_prompts``), as the README's tau table does.

Usage: python benchmarks/archive/copy_bonus.py --split train [--bonuses 0,2,4,8] [--n 12]
       [--out benchmarks/archive/copy_bonus_train.json]
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import torch

from dspine.build import DEFAULT_CHECKPOINTS
from dspine.config import SamplingConfig
from dspine.data.sources import heldout_prompts
from dspine.data.tokenizer import encode_record
from dspine.drafter.checkpoint import load_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.proposers import make_proposer
from dspine.target.adapter import load_target
from dspine.tune.machine import describe

DATA = Path(__file__).resolve().parents[2] / "training-data" / "smollm2-135m-regen"


def prompt_sets(t, split: str, n: int) -> dict[str, list[list[int]]]:
    """``{"code": [ids, ...], "chat": [...]}``: the first ``n`` training rows of each kind
    (their stored prompt ids) or the first ``n`` held-out prompts of each set."""
    if split == "heldout":
        return {s: [encode_record(t, r)[-768:] for r in heldout_prompts(s, n)] for s in ("code", "chat")}
    rows = []
    for shard in sorted(DATA.glob("data-*.jsonl.gz")):
        with gzip.open(shard, "rt", encoding="utf-8") as f:
            rows += [json.loads(line) for line in f]
    out = {}
    for kind in ("code", "chat"):
        part = [r for r in rows if (r.get("kind") == "code") == (kind == "code")]
        out[kind] = [r["prompt_ids"][-768:] for r in part[:n]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", choices=["train", "heldout"], required=True)
    ap.add_argument("--bonuses", default="0,2,4,8")
    ap.add_argument("--n", type=int, default=12, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t = load_target("smollm2-135m", dtype="float32")
    t.set_runtime("dense")
    drafter = load_drafter(DEFAULT_CHECKPOINTS / "smollm2-135m-dspine", t)
    sets = prompt_sets(t, a.split, a.n)
    configs = {"off": None, **{f"bonus{b}": float(b) for b in a.bonuses.split(",")}}
    res = {"what": __doc__.splitlines()[0], "split": a.split, "n_per_set": a.n, "max_new_tokens": a.max_new_tokens,
           "machine": describe() + " (tau does not depend on the machine)", "results": {}}
    for label, bonus in configs.items():
        eng = Engine(t, make_proposer("hybrid", DrafterProposer(drafter), copy_bonus=bonus), "dspine")
        row = {}
        for s, prompts in sets.items():
            emitted = cycles = 0
            src: dict[str, dict] = {}
            for ids in prompts:
                r = eng.generate(ids, SamplingConfig(), a.max_new_tokens)
                emitted += round(r.stats.accepted_length_mean * r.stats.cycles)
                cycles += r.stats.cycles
                for k, v in r.stats.sources.items():
                    d = src.setdefault(k, {"cycles": 0, "proposed": 0, "accepted": 0, "emitted": 0})
                    for key in d:
                        d[key] += v[key]
            row[f"tau_{s}"] = round(emitted / max(1, cycles), 4)
            row[f"sources_{s}"] = src
        res["results"][label] = row
        print(label, {k: v for k, v in row.items() if k.startswith("tau")}, flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    main()
