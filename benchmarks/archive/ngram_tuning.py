"""Settings of the copy proposer, tuned on *training* rows only.

Greedy acceptance of a copy is exact to simulate: a proposal is accepted as far as it
equals the target's own greedy continuation. The committed training data
(``training-data/smollm2-135m-regen``: training prompts and the target's greedy answers)
gives that continuation, so every (longest match ``--ngram-max``, shortest match
``--ngram-min``) pair is scored without running a model, on prompts that are neither
evaluation nor held-out prompts. The first 64 answer tokens of each row are used (as
``dspine acceptance --max-new-tokens 64``), at most 15 proposals per cycle; no cost
policy (every copy found is verified in full), the first answer token comes from the
prefill as in the engine.

Usage: python benchmarks/archive/ngram_tuning.py [--out benchmarks/archive/ngram_tuning.json]
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from dspine.proposers.ngram import NgramIndex
from dspine.tune.machine import describe

DATA = Path(__file__).resolve().parents[2] / "training-data" / "smollm2-135m-regen"


def simulate(rows: list[dict], max_ngram: int, min_match: int, tokens: int = 64, n_max: int = 15) -> dict:
    """tau (tokens per cycle) and the share of cycles that verified a copy."""
    cycles = emitted = copies = 0
    for r in rows:
        prompt, answer = r["prompt_ids"], r["response_ids"][:tokens]
        idx = NgramIndex(max_ngram)
        idx.observe(prompt, 0)
        t = 1  # answer[0] came from the prefill
        while t < len(answer):
            anchor = answer[t - 1]
            _, cont = idx.lookup(anchor, min(n_max, len(answer) - t), min_match)
            a = 0
            while a < len(cont) and cont[a] == answer[t + a]:
                a += 1
            e = min(a + 1, len(answer) - t)
            idx.observe([anchor] + answer[t:t + e - 1], len(idx.tokens))
            cycles, emitted, copies, t = cycles + 1, emitted + e, copies + bool(cont), t + e
    return {"tau": round(emitted / cycles, 4), "copy_cycle_share": round(copies / cycles, 3), "cycles": cycles}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/archive/ngram_tuning.json")
    args = ap.parse_args()
    rows = []
    for shard in sorted(DATA.glob("data-*.jsonl.gz")):
        with gzip.open(shard, "rt", encoding="utf-8") as f:
            rows += [json.loads(line) for line in f]
    res = {"what": __doc__.splitlines()[0], "data": str(DATA.name), "rows": len(rows),
           "machine": describe() + " (a simulation: the results do not depend on the machine)", "results": []}
    for kind in ("code", "chat"):
        part = [r for r in rows if (r.get("kind") == "code") == (kind == "code")]
        for mx, mn in ((2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2), (4, 3)):
            d = {"set": kind, "rows": len(part), "ngram_max": mx, "ngram_min": mn, **simulate(part, mx, mn)}
            res["results"].append(d)
            print(json.dumps(d))
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
