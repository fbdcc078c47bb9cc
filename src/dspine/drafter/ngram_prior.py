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

``P`` smooths the counts of every held context ending ``ctx`` (1..:data:`ORDER` tokens)
into one distribution (Dirichlet backoff, :meth:`NgramPrior.lookup`; each context keeps its
:data:`TOP` most frequent continuations, others count 0). Contexts are keyed by a 64-bit
polynomial hash of their tokens, salted by their length (a collision merges two contexts' counts: it changes a
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
TOP = 4  # continuations kept per context (docs/decisions.md: 4 over 2 measured on tuning rows)
WEIGHT = 0.5  # --ngram-prior-weight's default (docs/decisions.md, "An n-gram memory in the final stage")
BETA = 1.0  # Dirichlet backoff smoothing of the counts (NgramPrior.lookup; docs/decisions.md)
MEMO_SIZE = 4096  # lookups remembered per table (cleared when full)
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


def compact_counts(counts: np.ndarray, totals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Counts [U, top] and totals [U] (int64) as uint16: a context seen more than 65,535
    times has its counts and total scaled by the same factor (floored; the shares, which
    are all the prior reads, change by less than 1/65,535 each)."""
    cap = np.iinfo(np.uint16).max
    big = totals > cap
    if big.any():
        scale = cap / totals[big].astype(np.float64)
        counts = counts.copy()
        counts[big] = np.floor(counts[big] * scale[:, None]).astype(np.int64)
        totals = np.where(big, cap, totals)
    return counts.astype(np.uint16), totals.astype(np.uint16)


class NgramPrior:
    """Counts of the target's continuations after 1..:data:`ORDER` tokens.

    Arrays (sorted by key): keys [U] uint64, ids [U, top] (uint16 where every id fits, else
    int32), counts [U, top] uint16 (0 = no continuation in that slot), totals [U] uint16 (a
    context seen more than 65,535 times keeps its counts' proportions: :func:`compact_counts`).
    ``weight`` scales the log-probability added to the final stage's logits of chain rows
    2.., ``row1_weight`` (default: ``weight``) that of row 1, where the drafter's own guess is
    strongest; ``floor`` is the probability of a token the memory never saw after the
    context; ``beta`` smooths the counts (:meth:`lookup`).

    Raises:
        ValueError: a weight outside 0..100, a negative or non-finite ``beta``, a
            ``floor`` outside (0, 1).
    """

    def __init__(self, keys, ids, counts, totals, weight: float = WEIGHT, floor: float = 1e-3, source: str = "",
                 row1_weight: float | None = None, beta: float = BETA):
        for name, w in (("weight", weight), ("row1_weight", weight if row1_weight is None else row1_weight)):
            if (isinstance(w, bool) or not isinstance(w, (int, float))
                    or not (math.isfinite(w) and 0 <= w <= MAX_WEIGHT)):
                raise ValueError(f"ngram prior {name} must be in 0..{MAX_WEIGHT:g}, got {w!r}")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (math.isfinite(beta) and beta >= 0):
            raise ValueError(f"ngram prior beta must be a finite number >= 0, got {beta!r}")
        if not 0 < floor < 1:
            raise ValueError(f"ngram prior floor must be in (0, 1), got {floor!r}")
        self.keys, self.ids, self.counts, self.totals = keys, ids, counts, totals
        self.weight, self.floor, self.source = float(weight), float(floor), source
        self.row1_weight = self.weight if row1_weight is None else float(row1_weight)
        self.beta = float(beta)
        # the last lookups: a chain's scores look up the contexts its fused copy (chain()) just did
        self._memo: dict[tuple, tuple[list[int], list[float]]] = {}

    # -- building ------------------------------------------------------------------------
    @classmethod
    def build(cls, rows, top: int = TOP, min_total: int = 1, **kw) -> "NgramPrior":
        """From (prompt ids, response ids) pairs: every response token after the prompt's
        last :data:`PROMPT_TAIL` tokens and the response before it. Keeps the ``top`` most
        frequent continuations per context, and the contexts of 2+ tokens seen at least
        ``min_total`` times (a context occurs at most as often as its shorter suffixes, so
        every held context's suffixes are held too, as :meth:`_matches` assumes)."""
        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise ValueError(f"ngram prior top must be an integer >= 1, got {top!r}")
        if isinstance(min_total, bool) or not isinstance(min_total, int) or min_total < 1:
            raise ValueError(f"ngram prior min_total must be an integer >= 1, got {min_total!r}")
        parts = []
        for prompt, resp in rows:
            ids = list(prompt[-PROMPT_TAIL:]) + list(resp)
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**31 for t in ids):
                raise ValueError("token ids must be integers in 0 .. 2**31 - 1")
            parts.append(np.asarray(ids + [-1], dtype=np.int64))
        seq = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        keys, nxt, lens = [], [], []
        for k in range(1, ORDER + 1):
            h, i = _keys(seq, k)
            keys.append(h)
            nxt.append(seq[i])
            lens.append(np.full(h.shape, k, dtype=np.int8))
        key = np.concatenate(keys)
        tok = np.concatenate(nxt)
        klen = np.concatenate(lens)
        order = np.lexsort((tok, key))
        key, tok, klen = key[order], tok[order], klen[order]
        # runs of equal (key, token): their counts
        new_pair = np.ones(key.shape, dtype=bool)
        new_pair[1:] = (key[1:] != key[:-1]) | (tok[1:] != tok[:-1])
        starts = np.flatnonzero(new_pair)
        pk, pt, pl = key[starts], tok[starts], klen[starts]
        pc = np.diff(np.append(starts, key.shape[0]))
        # per key: the TOP most frequent tokens (ties: the smaller id)
        o = np.lexsort((pt, -pc, pk))
        pk, pt, pc, pl = pk[o], pt[o], pc[o], pl[o]
        first = np.ones(pk.shape, dtype=bool)
        first[1:] = pk[1:] != pk[:-1]
        kstart = np.flatnonzero(first)
        rank = np.arange(pk.shape[0]) - np.repeat(kstart, np.diff(np.append(kstart, pk.shape[0])))
        U = kstart.shape[0]
        ids = np.zeros((U, top), dtype=np.int64)
        counts = np.zeros((U, top), dtype=np.int64)
        which = np.repeat(np.arange(U), np.diff(np.append(kstart, pk.shape[0])))
        keep = rank < top
        ids[which[keep], rank[keep]] = pt[keep]
        counts[which[keep], rank[keep]] = pc[keep]
        totals = np.add.reduceat(pc, kstart) if U else np.zeros(0, dtype=np.int64)
        held = (totals >= min_total) | (pl[kstart] == 1)
        if not held.all():
            kstart, ids, counts, totals = kstart[held], ids[held], counts[held], totals[held]
        counts, totals = compact_counts(counts, totals)
        small = ids.size == 0 or int(ids.max()) <= np.iinfo(np.uint16).max
        return cls(pk[kstart], ids.astype(np.uint16 if small else np.int32), counts, totals, **kw)

    # -- lookups -------------------------------------------------------------------------
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.ids.nbytes + self.counts.nbytes + self.totals.nbytes)

    def _matches(self, ctx: list[int]) -> list[int]:
        """Table rows of the contexts ending ``ctx`` that the memory holds, shortest first
        (1, 2, ... tokens), up to the first length it does not hold (a context of k tokens
        occurs only where its last k - 1 do): one search for every length."""
        m = min(ORDER, len(ctx))
        if m == 0 or self.keys.shape[0] == 0:
            return []
        want = np.array([_key(ctx[-k:]) for k in range(1, m + 1)], dtype=np.uint64)
        at = np.searchsorted(self.keys, want)
        hit = self.keys[np.minimum(at, self.keys.shape[0] - 1)] == want
        out = []
        for i, h in zip(at.tolist(), hit.tolist()):
            if not h:
                break
            out.append(i)
        return out

    def lookup(self, ctx: list[int]) -> tuple[list[int], list[float]]:
        """Continuations of the contexts ending ``ctx`` (oldest first) that the memory holds:
        (token ids, probabilities), most probable first (ties: the smaller id); ([], []) when
        none.

        ``beta`` 0: the count shares of the longest held context. ``beta`` > 0: Dirichlet
        backoff over every held length k (interpolated smoothing as in PPM / Witten-Bell,
        Chen & Goodman 1999), ``P_k(v) = (c_k(v) + beta * P_{k-1}(v)) / (total_k + beta)``
        with ``P_0 = 0``: a context seen once no longer claims certainty, and the shorter
        contexts' continuations keep some probability.
        """
        key = (self.beta, tuple(ctx[-ORDER:]))  # only the last ORDER tokens are looked at
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
            got = self._memo[key] = self._lookup(ctx)
        return list(got[0]), list(got[1])

    def _lookup(self, ctx: list[int]) -> tuple[list[int], list[float]]:
        p: dict[int, float] = {}
        rows = self._matches(ctx)
        if self.beta == 0:
            rows = rows[-1:]
        for i in rows:
            tot = float(self.totals[i]) + self.beta
            p = {t: self.beta * v / tot for t, v in p.items()}
            for t, c in zip(self.ids[i].tolist(), self.counts[i].tolist()):
                if c > 0:
                    p[t] = p.get(t, 0.0) + c / tot
        best = sorted(p.items(), key=lambda kv: (-kv[1], kv[0]))
        return [t for t, _ in best], [v for _, v in best]

    def scores(self, ctx: list[int], cand: torch.Tensor, row: int = 2) -> torch.Tensor:
        """``w * log(P(v | ctx) + floor)`` for each candidate v: cand [K] int64 -> [K] float32,
        with ``w`` = ``row1_weight`` for chain row 1 and ``weight`` for the later rows."""
        ids, ps = self.lookup(ctx)
        got = dict(zip(ids, ps))
        p = torch.tensor([got.get(t, 0.0) + self.floor for t in cand.tolist()], dtype=torch.float32)
        return (self.row1_weight if row == 1 else self.weight) * torch.log(p)

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

