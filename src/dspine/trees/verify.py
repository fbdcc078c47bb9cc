"""Verification of a draft tree in one target forward (spec section 5 for chains).

``logits`` [N+1, V]: row 0 is the target's next-token logits after the anchor, row i + 1
those after tree node i (its ancestors and itself appended to the context).

Greedy (:func:`verify_tree_greedy`): from the root, descend into the child whose token
is the target's argmax while one exists; emit the argmax where none does (the correction,
or the bonus token below a leaf). Equal to the plain loop because every emitted token is
the target's argmax after the committed prefix.

Sampling (:func:`verify_tree_sampling`), multi-candidate speculative sampling (SpecInfer,
Miao et al. 2024, "multi-step speculative sampling"; EAGLE's recursive rejection
sampling): at a node with target distribution r (initially ``p`` = the filtered target
row), examine its children in draw order; child k, drawn from ``q_k``, is accepted with
probability ``min(1, r(y_k) / q_k(y_k))``; after a rejection ``r <- norm(max(0, r - q_k))``.
An accepted child becomes the node (its own row's ``p``); when every child is rejected the
token is drawn from the last residual, below a leaf from ``p``. Each round is one
token-wise speculative sampling step with target r and proposal q_k, so by induction the
emitted token is distributed as p whatever the q_k are, as long as each is exactly the
distribution its child was drawn from given the earlier draws (the tree builders record
that: :mod:`.build`). Uniforms: float64 draws of ``gen``, one per examined child, then one
for the correction or bonus (a chain consumes them like :func:`dspine.core.verify.verify_sampling`
and reaches the same decisions).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspine.config import SamplingConfig
from dspine.core.sampling import filter_probs, sample_index, uniform
from dspine.trees.tree import DraftTree


@dataclass
class TreeVerdict:
    """path: accepted node indices, root to deepest (their tokens are the accepted
    proposals); token: the correction or bonus token."""

    path: list[int]
    token: int

    @property
    def accepted(self) -> int:
        return len(self.path)


def _check_logits(tree: DraftTree, logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[0] != tree.size + 1:
        raise ValueError(f"tree verification needs logits [{tree.size + 1}, V] (the anchor and every node), "
                         f"got {tuple(logits.shape)}")


def verify_tree_greedy(tree: DraftTree, logits: torch.Tensor) -> TreeVerdict:
    """Longest path of target argmaxes plus the next argmax. logits [N+1, V].

    Raises:
        ValueError: logits not [N+1, V].
    """
    _check_logits(tree, logits)
    best = torch.argmax(logits, dim=-1).tolist()  # [N+1]
    toks = tree.tokens.tolist()
    node, path = -1, []
    while True:
        want = best[node + 1]
        nxt = next((c for c in tree.children(node) if toks[c] == want), None)
        if nxt is None:
            return TreeVerdict(path, want)
        path.append(nxt)
        node = nxt


def _q_of(tree: DraftTree, c: int, y: int) -> float:
    hit = (tree.q_ids[c] == y).nonzero()
    return float(tree.q_probs[c, int(hit[0])]) if hit.numel() else 0.0


def verify_tree_sampling(tree: DraftTree, logits: torch.Tensor, sampling: SamplingConfig,
                         gen: torch.Generator | None) -> TreeVerdict:
    """Lossless multi-candidate verification (module docstring). logits [N+1, V];
    ``tree.q_ids`` / ``tree.q_probs`` [N, K] must be set when the tree has nodes.

    Raises:
        ValueError: a tree with nodes but without q, or logits not [N+1, V].
    """
    _check_logits(tree, logits)
    if tree.size and tree.q_probs is None:
        raise ValueError("sampled tree verification needs the distribution q of every node")
    toks = tree.tokens.tolist()
    node, path = -1, []
    while True:
        r = filter_probs(logits[node + 1], sampling)  # [V] float64, normalized
        raw = r  # the residual before normalization (what the correction is drawn from)
        accepted = None
        for c in tree.children(node):
            y = toks[c]
            qy = _q_of(tree, c, y)
            u = uniform(gen)
            if qy > 0.0 and u < float(r[y]) / qy:
                accepted = c
                break
            res = r.clone()  # index_add_: a point-mass q repeats its token id (see build.graft)
            res.index_add_(0, tree.q_ids[c], -tree.q_probs[c].to(torch.float64))
            res = res.clamp_min(0.0)
            total = float(res.sum())
            if total <= 0.0:  # r == q_k up to rounding: r stays
                continue
            raw, r = res, res / total
        if accepted is None:
            return TreeVerdict(path, sample_index(raw, uniform(gen)))
        path.append(accepted)
        node = accepted


def verify_tree(tree: DraftTree, logits: torch.Tensor, sampling: SamplingConfig,
                gen: torch.Generator | None) -> TreeVerdict:
    """Dispatch to :func:`verify_tree_greedy` or :func:`verify_tree_sampling` by ``sampling``."""
    if sampling.greedy:
        return verify_tree_greedy(tree, logits)
    return verify_tree_sampling(tree, logits, sampling, gen)
