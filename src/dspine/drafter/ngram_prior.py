"""An n-gram memory of the target's own answers, scored in the final stage's serial chain.

The block drafter's rows guess x_{a+2}, x_{a+3}, ... from the features that end at the
anchor; only the final stage's tables see the chosen predecessor, and on the default
target they chain weakly: teacher-forced on held-out answers, row 2 is right given row 1
in 40% (code) / 29% (chat) of anchors. Counts of what the target itself wrote after the
same 1-6 tokens in its regenerated training answers chain far better (rows 1..4 all right
0.104 vs 0.042 on code), though they guess row 1 less often (0.405 vs 0.454). The prior
adds ``weight * log(P(v | context) + floor)`` to row i's score of candidate v, with the
context the committed tokens and the chain's own choices of rows < i (docs/decisions.md,
"An n-gram memory in the final stage"). Built from a data directory and cached by
:mod:`dspine.data.prior`.

``P`` is the count share of v among the continuations of the longest context (up to
:data:`ORDER` tokens) that occurs in the memory, over its :data:`TOP` most frequent
continuations (others count 0). Contexts are keyed by a 64-bit polynomial hash of their
tokens, salted by their length (a collision merges two contexts' counts: it changes a
proposal, never the output, which the target verifies).

Exactness: the prior is a function of the committed tokens and the chain's earlier choices,
so the chain's q (the filtered softmax of the scored row, :func:`dspine.drafter.final_stage.chain`)
is still the distribution it samples from.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from dspine.argtypes import MAX_NGRAM_PRIOR_WEIGHT as MAX_WEIGHT  # log P >= log 0.001 ~ -6.9: no need for more

ORDER = 6  # longest context looked up (tokens)
TOP = 2  # continuations kept per context
PROMPT_TAIL = 8  # prompt tokens before each answer (the chat template's assistant header)
_P = np.uint64(0x100000001B3)  # FNV-style multiplier
_MASK = (1 << 64) - 1


def _key(ctx: list[int] | tuple[int, ...]) -> int:
    """The hash of a context (oldest token first), salted by its length; as :func:`_keys`."""
    h = len(ctx)
    for t in ctx:
        h = (h * int(_P) + int(t) + 1) & _MASK
    return h


def _keys(seq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of every k-token context in ``seq`` (int64, -1 separates answers) and the
    index of the token each one predicts. Returns (keys [m] uint64, next index [m])."""
    n = seq.shape[0]
    idx = np.arange(k, n)
    ok = seq[idx] >= 0
    h = np.full(idx.shape, k, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for m in range(k):
            t = seq[idx - k + m]
            ok &= t >= 0
            h = h * _P + (t + 1).astype(np.uint64)
    return h[ok], idx[ok]


class NgramPrior:
    """Counts of the target's continuations after 1..:data:`ORDER` tokens.

    Arrays (sorted by key): keys [U] uint64, ids [U, TOP] int32 (-1 = none), counts
    [U, TOP] int32, totals [U] int32. ``weight`` scales the log-probability added to the
    final stage's logits; ``floor`` is the probability of a token the memory never saw
    after the context; rows before ``first_row`` are not scored (row 1 is where the
    drafter's own guess is strongest).
    """

    def __init__(self, keys, ids, counts, totals, weight: float = 0.5, floor: float = 1e-3, source: str = "",
                 first_row: int = 1):
        if not (math.isfinite(weight) and 0 <= weight <= MAX_WEIGHT):
            raise ValueError(f"ngram prior weight must be in 0..{MAX_WEIGHT:g}, got {weight!r}")
        if isinstance(first_row, bool) or not isinstance(first_row, int) or first_row < 1:
            raise ValueError(f"ngram prior first_row must be an integer >= 1, got {first_row!r}")
        self.first_row = first_row
        if not 0 < floor < 1:
            raise ValueError(f"ngram prior floor must be in (0, 1), got {floor!r}")
        self.keys, self.ids, self.counts, self.totals = keys, ids, counts, totals
        self.weight, self.floor, self.source = float(weight), float(floor), source

    # -- building ------------------------------------------------------------------------
    @classmethod
    def build(cls, rows, **kw) -> "NgramPrior":
        """From (prompt ids, response ids) pairs: every response token after the prompt's
        last :data:`PROMPT_TAIL` tokens and the response before it."""
        parts = []
        for prompt, resp in rows:
            ids = list(prompt[-PROMPT_TAIL:]) + list(resp)
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**31 for t in ids):
                raise ValueError("token ids must be integers in 0 .. 2**31 - 1")
            parts.append(np.asarray(ids + [-1], dtype=np.int64))
        seq = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        keys, nxt = [], []
        for k in range(1, ORDER + 1):
            h, i = _keys(seq, k)
            keys.append(h)
            nxt.append(seq[i])
        key = np.concatenate(keys)
        tok = np.concatenate(nxt)
        order = np.lexsort((tok, key))
        key, tok = key[order], tok[order]
        # runs of equal (key, token): their counts
        new_pair = np.ones(key.shape, dtype=bool)
        new_pair[1:] = (key[1:] != key[:-1]) | (tok[1:] != tok[:-1])
        starts = np.flatnonzero(new_pair)
        pk, pt = key[starts], tok[starts]
        pc = np.diff(np.append(starts, key.shape[0]))
        # per key: the TOP most frequent tokens (ties: the smaller id)
        o = np.lexsort((pt, -pc, pk))
        pk, pt, pc = pk[o], pt[o], pc[o]
        first = np.ones(pk.shape, dtype=bool)
        first[1:] = pk[1:] != pk[:-1]
        kstart = np.flatnonzero(first)
        rank = np.arange(pk.shape[0]) - np.repeat(kstart, np.diff(np.append(kstart, pk.shape[0])))
        U = kstart.shape[0]
        ids = np.full((U, TOP), -1, dtype=np.int32)
        counts = np.zeros((U, TOP), dtype=np.int32)
        which = np.repeat(np.arange(U), np.diff(np.append(kstart, pk.shape[0])))
        keep = rank < TOP
        ids[which[keep], rank[keep]] = pt[keep]
        counts[which[keep], rank[keep]] = pc[keep]
        totals = np.add.reduceat(pc, kstart).astype(np.int32)
        return cls(pk[kstart], ids, counts, totals, **kw)

    # -- lookups -------------------------------------------------------------------------
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.ids.nbytes + self.counts.nbytes + self.totals.nbytes)

    def lookup(self, ctx: list[int]) -> tuple[list[int], list[float]]:
        """Continuations of the longest context ending ``ctx`` (oldest first) that the memory
        holds: (token ids, probabilities), most frequent first; ([], []) when none."""
        for k in range(min(ORDER, len(ctx)), 0, -1):
            key = np.uint64(_key(ctx[-k:]))
            i = int(np.searchsorted(self.keys, key))
            if i < self.keys.shape[0] and self.keys[i] == key:
                tot = float(self.totals[i])
                got = [(int(t), c / tot) for t, c in zip(self.ids[i], self.counts[i]) if t >= 0]
                return [t for t, _ in got], [p for _, p in got]
        return [], []

    def scores(self, ctx: list[int], cand: torch.Tensor) -> torch.Tensor:
        """``weight * log(P(v | ctx) + floor)`` for each candidate v: cand [K] int64 -> [K] float32."""
        ids, ps = self.lookup(ctx)
        p = torch.full(cand.shape, self.floor, dtype=torch.float32)
        for t, q in zip(ids, ps):
            p[cand == t] += q
        return self.weight * torch.log(p)

    def chain(self, ctx: list[int], n: int) -> list[int]:
        """The memory's own greedy continuation of ``ctx``: up to ``n`` tokens, stopping where
        no context matches (the tokens fused into the candidates, :func:`inject_copy`)."""
        ctx, out = list(ctx), []
        for _ in range(n):
            ids, _ = self.lookup(ctx)
            if not ids:
                break
            out.append(ids[0])
            ctx.append(ids[0])
        return out

