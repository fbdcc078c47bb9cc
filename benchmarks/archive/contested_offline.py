"""How often a copied continuation is right, by kind of match, on the committed target-written
data (no model runs): the evidence behind ``NgramIndex.contested`` (docs/decisions.md,
2026-12-04).

For the first ``--rows`` answers of each kind (chat, code) in ``training-data/``, every
answer position is replayed as the copy proposer sees it: the committed tokens (prompt and
answer so far), the anchor, the longest suffix match of up to ``--ngram-max`` tokens and
the continuation of its most recent occurrence. Each position is classed by match length
(``m1`` one token, ``m2+`` longer) and by whether the matched suffix's two most recent
earlier occurrences were followed by different tokens (``contested``), the same token
(``agreed``) or the suffix occurred once (``once``); the table gives how often the first
copied token is the target's next token and the mean number of copied tokens accepted
(of up to 8). Greedy answers of SmolLM2-135M; positions, not decoding cycles.

    python benchmarks/archive/contested_offline.py --out benchmarks/archive/contested_offline.json
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "training-data" / "smollm2-135m-regen"


def classify(rows: list[dict], max_ngram: int) -> dict:
    """{class: [positions, first token right, tokens accepted]} over ``rows``."""
    st: dict = collections.defaultdict(lambda: [0, 0, 0])
    for r in rows:
        seq = r["prompt_ids"] + r["response_ids"]
        last: dict = {}
        prev_follow: dict = {}
        toks: list[int] = []

        def append(t: int) -> None:
            i = len(toks)
            for k in range(1, min(max_ngram, i) + 1):
                key = tuple(toks[i - k:i])
                if key in last:
                    prev_follow[key] = toks[last[key]]
                last[key] = i
            toks.append(t)

        for t in r["prompt_ids"]:
            append(t)
        for i in range(len(r["prompt_ids"]), len(seq) - 1):  # committed seq[:i], anchor seq[i]
            anchor, n = seq[i], len(toks)
            for k in range(min(max_ngram, n + 1), 0, -1):
                key = tuple(toks[n - k + 1:]) + (anchor,) if k > 1 else (anchor,)
                j = last.get(key)
                if j is None:
                    continue
                cont = (toks + [anchor])[j:j + 8]
                acc = 0
                for a, b in zip(cont, seq[i + 1:i + 9]):
                    if a != b:
                        break
                    acc += 1
                pf = prev_follow.get(key)
                kind = "once" if pf is None else ("agreed" if pf == cont[0] else "contested")
                for cls in ("m1" if k == 1 else "m2+", ("m1" if k == 1 else "m2+") + " " + kind):
                    s = st[cls]
                    s[0] += 1
                    s[1] += acc > 0
                    s[2] += acc
                break
            append(anchor)
    return st


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=800, help="answers per kind (the first ones of the committed data)")
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    kinds: dict = collections.defaultdict(list)
    for f in sorted(DATA.glob("data-*.jsonl.gz")):
        for line in gzip.open(f, "rt"):
            r = json.loads(line)
            if len(kinds[r["kind"]]) < args.rows:
                kinds[r["kind"]].append(r)
    table = {}
    for kind, rows in sorted(kinds.items()):
        st = classify(rows, args.ngram_max)
        table[kind] = {c: {"positions": n, "first_right": round(a / n, 3), "mean_accepted": round(l / n, 2)}
                       for c, (n, a, l) in sorted(st.items())}
        print(f"{kind} ({len(rows)} answers)")
        for c, v in table[kind].items():
            print(f"  {c:15s} positions {v['positions']:7d}  first token right {v['first_right']:.3f}  "
                  f"accepted {v['mean_accepted']:.2f}")
    args.out.write_text(json.dumps({"what": __doc__.split("\n\n")[0], "rows_per_kind": args.rows,
                                    "ngram_max": args.ngram_max, "by_kind": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
