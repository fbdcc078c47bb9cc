"""Cost of the copy proposer's index (copies: "suffix automaton, suffix tree or hashed
n-grams: measure"): the hashed n-gram index of :mod:`dspine.proposers.ngram` beside a
suffix automaton in the same language (pure Python), per committed token and per lookup,
at 512 / 2048 / 8192 tokens of context. Both index the same token ids (a real
SmolLM2-tokenized text: the Python standard library's ``json/decoder.py``, repeated to
length). The automaton's lookup walks the query suffix (<= ``max_ngram`` tokens) from the
root; it finds matches of any length, the hashed index up to ``max_ngram``.

Usage: python benchmarks/archive/ngram_index.py [--out benchmarks/archive/ngram_index.json]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from dspine.proposers.ngram import NgramIndex
from dspine.tune.machine import describe, machine_info, others_cpu_load


class SuffixAutomaton:
    """Suffix automaton over token ids (online, Blumer et al. 1985): the longest suffix of
    the text that occurred earlier, and the end of its latest occurrence (``last_end``)."""

    def __init__(self):
        self.next = [{}]
        self.link = [-1]
        self.len = [0]
        self.end = [-1]  # end position of the latest occurrence of each state's strings
        self.last = 0
        self.tokens: list[int] = []

    def append(self, t: int) -> None:
        i = len(self.tokens)
        self.tokens.append(t)
        cur = len(self.len)
        self.next.append({})
        self.len.append(self.len[self.last] + 1)
        self.link.append(0)
        self.end.append(i)
        p = self.last
        while p != -1 and t not in self.next[p]:
            self.next[p][t] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][t]
            if self.len[p] + 1 == self.len[q]:
                self.link[cur] = q
            else:
                clone = len(self.len)
                self.next.append(dict(self.next[q]))
                self.len.append(self.len[p] + 1)
                self.link.append(self.link[q])
                self.end.append(self.end[q])
                while p != -1 and self.next[p].get(t) == q:
                    self.next[p][t] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur
        p = self.link[cur]  # every suffix state now ends at i too (latest occurrence)
        while p > 0 and self.end[p] != i:
            self.end[p] = i
            p = self.link[p]

    def match_len(self, suffix: list[int]) -> int:
        """Length of the longest suffix of ``suffix`` that is a substring of the text."""
        best = 0
        for k in range(len(suffix), 0, -1):
            s, ok = 0, True
            for t in suffix[-k:]:
                s = self.next[s].get(t)
                if s is None:
                    ok = False
                    break
            if ok:
                best = k
                break
        return best


def tokens_of_text(n: int) -> list[int]:
    import inspect
    import json.decoder as mod

    from dspine.target.adapter import load_target

    tok = load_target("smollm2-135m").tokenizer
    ids = tok(inspect.getsource(mod))["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/archive/ngram_index.json")
    ap.add_argument("--max-ngram", type=int, default=4)
    args = ap.parse_args()
    load = others_cpu_load()
    base = tokens_of_text(8192)
    rows = []
    for n in (512, 2048, 8192):
        ids = base[:n]
        res = {"context_tokens": n}
        for name, make in (("hashed_ngrams", lambda: NgramIndex(args.max_ngram)), ("suffix_automaton", SuffixAutomaton)):
            idx = make()
            t0 = time.perf_counter()
            for t in ids:
                idx.append(t)
            app = (time.perf_counter() - t0) / n
            rng = random.Random(0)
            qs = [rng.randrange(args.max_ngram, n) for _ in range(2000)]
            t0 = time.perf_counter()
            for q in qs:
                if name == "hashed_ngrams":
                    idx.lookup(ids[q], 16, 1)
                else:
                    idx.match_len(ids[q - args.max_ngram + 1:q + 1])
            look = (time.perf_counter() - t0) / len(qs)
            res[name] = {"append_us_per_token": round(1e6 * app, 2), "lookup_us": round(1e6 * look, 2)}
        rows.append(res)
        print(json.dumps(res))
    out = {"what": "copy-proposer index cost per committed token and per lookup (pure Python)",
           "machine": describe(), "machine_info": machine_info(), "other_processes_busy_cores": load,
           "max_ngram": args.max_ngram, "text": "json/decoder.py of the standard library, SmolLM2 tokens",
           "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
