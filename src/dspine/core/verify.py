"""Verification: greedy and token-wise speculative sampling (spec section 5).

Inputs per request and cycle: proposals ``y_1..y_n``; the target's logits at the
positions of ``[x0, y_1..y_n]`` give ``p_1..p_{n+1}`` after the same filters as the
plain sampler (:func:`dspine.core.sampling.filter_probs`). ``q`` is either sparse
(candidate ids [n, K] + probabilities [n, K]) or dense ([n, V]); both give identical
decisions and corrections for the same random draws. Uniforms are float64 draws
from the request's generator, in a fixed order: one per examined position, then one
for the correction or bonus.

:func:`verify_proposal` is the one entry point the engine calls: a chain (the
token-wise verifiers here), a draft tree (:func:`dspine.trees.verify.verify_tree`) or no
proposal (the plain sampler), each returning what to emit and which forward rows to commit.
A chain is verified by the chain functions as a fast path; that they decide as the tree
verifier does on :meth:`DraftTree.chain <dspine.trees.tree.DraftTree.chain>` is tested
(``tests/test_verify_proposal.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspine.config import SamplingConfig
from dspine.core.sampling import filter_probs, sample_index, sample_token, uniform
from dspine.trees.verify import verify_tree


@dataclass
class Verdict:
    """Outcome of one verification.

    accepted: number of proposals kept (0..n).
    token: the correction token (at the first rejection) or the bonus token.
    """

    accepted: int
    token: int


def verify_greedy(tokens: torch.Tensor, logits: torch.Tensor) -> Verdict:
    """Greedy verification. tokens [n] int64, logits [n+1, V] float.

    Accept while ``y_i == argmax p_i``; then emit ``argmax p_i`` at the first mismatch,
    or the bonus ``argmax p_{n+1}``.
    """
    toks = tokens.tolist()
    best = torch.argmax(logits[: len(toks) + 1], dim=-1).tolist()  # [n+1]
    a = 0
    while a < len(toks) and toks[a] == best[a]:
        a += 1
    return Verdict(a, best[a])


class _LazyRows:
    """``p[i]`` = ``filter_probs(logits[i])`` [V] float64, computed on first use."""

    def __init__(self, logits: torch.Tensor, sampling: SamplingConfig):
        self.logits, self.sampling, self.rows = logits, sampling, {}

    def __getitem__(self, key):
        i, *rest = key if isinstance(key, tuple) else (key,)
        if i not in self.rows:
            self.rows[i] = filter_probs(self.logits[i], self.sampling)  # [V] float64
        row = self.rows[i]
        return row[tuple(rest)] if rest else row


def verify_sampling(tokens: torch.Tensor, q_probs: torch.Tensor, q_ids: torch.Tensor | None,
                    logits: torch.Tensor, sampling: SamplingConfig, gen: torch.Generator | None,
                    p: torch.Tensor | None = None) -> Verdict:
    """Token-wise speculative sampling.

    Args:
        tokens: [n] int64 proposals y_1..y_n.
        q_probs: [n, K] float64 (sparse, with ``q_ids`` [n, K]) or [n, V] (dense, q_ids None):
            exactly the distributions the proposals were drawn from.
        logits: [n+1, V] target logits (unfiltered); ignored when ``p`` is given.
        p: optional precomputed filtered target probabilities [n+1, V] float64.
    Accept y_i with probability ``min(1, p_i(y_i) / q_i(y_i))``; at the first
    rejection sample from ``max(0, p_i - q_i)`` renormalized; if all are accepted,
    sample the bonus from ``p_{n+1}``. Without ``p``, each ``p_i`` is filtered only
    when position i is examined (``filter_probs`` filters rows independently, so the
    values are those of filtering all rows at once; at tau ~1.4 this skips ~14 of 16
    rows of a 49k-vocabulary filter).
    """
    n = tokens.shape[0]
    if p is None:
        p = _LazyRows(logits, sampling)
    for i in range(n):
        y = int(tokens[i])
        if q_ids is None:
            qy = float(q_probs[i, y])
        else:
            hit = (q_ids[i] == y).nonzero()
            qy = float(q_probs[i, int(hit[0])]) if hit.numel() else 0.0
        py = float(p[i, y])
        u = uniform(gen)
        if qy > 0.0 and u < py / qy:
            continue
        res = p[i].clone()  # [V]
        if q_ids is None:
            res = res - q_probs[i].to(torch.float64)
        else:
            res[q_ids[i]] -= q_probs[i].to(torch.float64)
        res = res.clamp_min(0.0)
        if float(res.sum()) <= 0.0:  # p == q up to rounding: the correction is drawn from p
            res = p[i]
        return Verdict(i, sample_index(res, uniform(gen)))
    return Verdict(n, sample_index(p[n], uniform(gen)))


def verify(tokens: torch.Tensor, q_probs, q_ids, logits: torch.Tensor, sampling: SamplingConfig,
           gen: torch.Generator | None) -> Verdict:
    """Dispatch to :func:`verify_greedy` or :func:`verify_sampling` by ``sampling``."""
    if sampling.greedy:
        return verify_greedy(tokens, logits)
    if tokens.shape[0] > 0 and q_probs is None:
        raise ValueError("sampled verification needs the proposal distribution q")
    return verify_sampling(tokens, q_probs, q_ids, logits, sampling, gen)


@dataclass
class Outcome:
    """One request's verified cycle, chain or tree.

    accepted: proposals accepted (a chain's prefix length, a tree's path length).
    tokens: the accepted proposals' ids, then the correction or bonus token (what the
        request emits, before EOS / stop / length handling).
    rows: the forward's input rows to commit, increasing: 0 (the anchor), then the
        accepted proposals' rows (a chain's ``1..accepted``, a tree's path nodes + 1).
    depth: proposals verified along one path (a chain's n, a tree's depth).
    nodes: tree nodes verified; 0 for a chain.
    """

    accepted: int
    tokens: list[int]
    rows: list[int]
    depth: int
    nodes: int = 0


def verify_proposal(prop, logits: torch.Tensor, sampling: SamplingConfig, gen: torch.Generator | None) -> Outcome:
    """Verify one :class:`~dspine.proposers.base.Proposal` against the target's logits.

    Args:
        prop: the proposal: ``tree`` set (a :class:`~dspine.trees.tree.DraftTree` of N
            nodes), else a chain of ``tokens`` [n] int64 with ``q_ids`` / ``q_probs`` as
            :func:`verify` takes them (n = 0: nothing proposed).
        logits: [n + 1, V] (chain) or [N + 1, V] (tree) float, row 0 after the anchor.
        sampling, gen: the request's sampling settings and generator.
    Returns:
        :class:`Outcome`. With n = 0 the token is drawn by the plain sampler
        (:func:`dspine.core.sampling.sample_token`), exactly as the ``ar`` loop draws it.
    Raises:
        ValueError: sampled verification of proposals without q, or logits whose rows do
            not match the proposal.
    """
    tree = prop.tree
    if tree is not None:
        v = verify_tree(tree, logits, sampling, gen)
        path = [int(c) for c in v.path]
        return Outcome(len(path), [int(tree.tokens[c]) for c in path] + [int(v.token)],
                       [0] + [c + 1 for c in path], int(tree.max_depth), int(tree.size))
    n = int(prop.tokens.shape[0])
    if logits.shape[0] < n + 1:
        raise ValueError(f"logits have {logits.shape[0]} rows for a chain of {n} proposals (need {n + 1})")
    if n == 0:
        v = Verdict(0, sample_token(logits[0], sampling, gen))
    else:
        v = verify(prop.tokens, prop.q_probs, prop.q_ids, logits, sampling, gen)
    a = int(v.accepted)
    return Outcome(a, prop.tokens[:a].tolist() + [int(v.token)], list(range(a + 1)), n)
