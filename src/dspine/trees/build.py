"""Draft trees from the final stage's candidate tables (spec section 4 tables).

Inputs, as :func:`dspine.drafter.final_stage.conditional_tables` makes them for one block:
``cand`` [n, K] int64, the K candidates of positions 1..n, and ``T`` [n, K, K] float32
where ``T[i, j, v]`` scores candidate v of position i+1 given candidate j of position i
(position 0 is the anchor: every j of ``T[0]`` is the same row). A tree node is a pair
(depth d, candidate index j of position d); its children are candidates of position d+1
scored by ``T[d, j]``.

- :func:`static_tree`: each node at depth d-1 gets ``widths[d-1]`` children (1 past the
  end), breadth first, until ``budget`` nodes. Greedy takes the top candidates of the
  row; sampling draws them without replacement from ``q = filter_probs(T[d, j])`` and
  gives each child the distribution it was drawn from (q with the earlier siblings
  removed, renormalized) for the verifier.
- :func:`dynamic_tree` (greedy only): best-first by path probability, the product of
  ``softmax(T[d, j])`` along the path, until ``budget`` nodes (EAGLE-2's expansion,
  Li et al. 2024, over dspine's conditional tables instead of a re-run drafter).

Both take an optional ``prior``, as :func:`dspine.drafter.final_stage.chain` does:
``prior(path: list[int], cand_d [K]) -> [K] float32`` added to a node's row of scores
given the tokens on the path from the root to it (the n-gram prior,
:class:`dspine.drafter.ngram_prior.NgramPrior`). A sampled child's q is then the filtered
softmax of the scored row, which is what it was drawn from, so verification stays exact.
"""
from __future__ import annotations

import heapq
from collections import deque

import torch

from dspine.config import SamplingConfig
from dspine.core.sampling import filter_probs, sample_index, uniform
from dspine.trees.tree import DraftTree, _check_widths


def _check(T: torch.Tensor, cand: torch.Tensor, depth: int, budget: int) -> None:
    for name, v in (("depth", depth), ("budget", budget)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"tree {name} must be an integer, got {v!r}")
    if T.dim() == 3 and T.shape[-1] == 0:
        raise ValueError("tables with no candidates (K = 0)")
    if T.dim() != 3 or cand.dim() != 2 or T.shape[:2] != cand.shape or T.shape[1] != T.shape[2]:
        raise ValueError(f"tables must be T [n, K, K] and cand [n, K], got {tuple(T.shape)} and {tuple(cand.shape)}")
    if not 0 <= depth <= T.shape[0]:
        raise ValueError(f"tree depth {depth} outside 0..{T.shape[0]}")
    if budget < 0:
        raise ValueError(f"tree budget must be >= 0, got {budget}")


def static_tree(T: torch.Tensor, cand: torch.Tensor, depth: int, widths: tuple[int, ...], budget: int,
                sampling: SamplingConfig, gen: torch.Generator | None, prior=None) -> DraftTree:
    """Breadth-first tree of the given widths, at most ``depth`` deep and ``budget`` nodes.

    Greedy (``sampling.greedy``): children are the row's top candidates, best first.
    Sampled: children drawn without replacement from the filtered row (one uniform of
    ``gen`` per child, in node order); a row with fewer nonzero entries than the width
    gives fewer children. Widths all 1 reproduce :func:`dspine.drafter.final_stage.chain`'s
    tokens, q and random draws exactly (with the same ``prior`` too).
    """
    _check(T, cand, depth, budget)
    widths = _check_widths(widths)
    toks, par, dep, qids, qps = [], [], [], [], []
    queue = deque([(-1, 0, 0, [])])  # (node, its depth, its candidate index, its path; the root: 0, 0, [])
    T = T.float()
    while queue and len(toks) < budget:
        node, d, j, path = queue.popleft()
        if d >= depth:
            continue
        w = widths[d] if d < len(widths) else 1
        row = T[d, j]  # [K]
        if prior is not None:
            row = row + prior(path, cand[d])
        if sampling.greedy:
            picks = torch.topk(row, min(w, row.shape[0])).indices.tolist()
            qs = [None] * len(picks)
        else:
            q = filter_probs(row, sampling)  # [K] float64
            picks, qs = [], []
            for _ in range(w):
                mass = float(q.sum())
                if mass <= 0.0:
                    break
                qk = q if not picks else q / mass  # the first draw: the row's q itself
                pick = sample_index(qk, uniform(gen))
                picks.append(pick)
                qs.append(qk)
                q = q.clone()
                q[pick] = 0.0
        for pick, qk in zip(picks, qs):
            if len(toks) >= budget:
                break
            idx = len(toks)
            toks.append(int(cand[d, pick]))
            par.append(node)
            dep.append(d + 1)
            if qk is not None:
                qids.append(cand[d])
                qps.append(qk)
            queue.append((idx, d + 1, pick, path + [toks[-1]]))
    return _tree(toks, par, dep, qids, qps)


def dynamic_tree(T: torch.Tensor, cand: torch.Tensor, depth: int, budget: int, prior=None) -> DraftTree:
    """Greedy best-first tree: the ``budget`` nodes of highest path probability (product of
    ``softmax(T[d, j])`` along the path, each row with ``prior``'s scores of the path added
    when given), at most ``depth`` deep. Parents precede children (a child's path
    probability never exceeds its parent's)."""
    _check(T, cand, depth, budget)
    logp = torch.log_softmax(T.double(), dim=-1)  # [n, K, K]
    heap: list = []
    tie = 0
    paths: list[list[int]] = []  # the tokens from the root to each node (with a prior only)

    def push(parent: int, d: int, j: int, score: float) -> None:
        nonlocal tie
        if d >= depth:
            return
        if prior is None:
            row = logp[d, j]
        else:
            path = paths[parent] if parent >= 0 else []
            row = torch.log_softmax(T[d, j].double() + prior(path, cand[d]).double(), dim=-1)
        for v, lp in enumerate(row.tolist()):
            heapq.heappush(heap, (-(score + lp), tie, parent, d, v))
            tie += 1

    toks, par, dep, logs = [], [], [], []
    push(-1, 0, 0, 0.0)
    while heap and len(toks) < budget:
        neg, _, parent, d, v = heapq.heappop(heap)
        idx = len(toks)
        toks.append(int(cand[d, v]))
        par.append(parent)
        dep.append(d + 1)
        logs.append(-neg)
        if prior is not None:
            paths.append((paths[parent] if parent >= 0 else []) + [toks[-1]])
        push(idx, d + 1, v, -neg)
    return _tree(toks, par, dep, [], [], path_prob=torch.tensor(logs, dtype=torch.float64).exp())


def _tree(toks, par, dep, qids, qps, path_prob=None) -> DraftTree:
    long = dict(dtype=torch.long)
    return DraftTree(torch.tensor(toks, **long), torch.tensor(par, **long), torch.tensor(dep, **long),
                     torch.stack(qids) if qids else None, torch.stack(qps) if qps else None,
                     path_prob=path_prob)


def graft(tree: DraftTree, tokens: list[int], merge: bool) -> tuple[DraftTree, int]:
    """Add the deterministic branch ``tokens`` (a copied continuation) below the root.

    ``merge`` (greedy decoding): follow existing nodes while their tokens match and append
    only the rest. Without (sampled decoding), the whole branch becomes new nodes placed
    *first* (node indices 0..m-1, so verification examines the copy before the drafter's
    siblings), each with a point-mass q (its token with probability 1, ``q_ids`` repeating
    the token): a copy is a function of the committed context alone, so that is exactly
    the distribution it was drawn from, and the drafter's nodes keep theirs. Returns the
    new tree and the number of nodes added.
    """
    long = dict(dtype=torch.long)
    tokens = [int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]
    if not tokens:
        return tree, 0
    if merge and tree.q_ids is not None:
        raise ValueError("graft(merge=True) is for greedy trees; a sampled tree needs merge=False "
                         "(every node keeps the q it was drawn from)")
    if merge:
        toks, par, dep = tree.tokens.tolist(), tree.parent.tolist(), tree.depth.tolist()
        node, added = -1, 0
        for t in tokens:
            if added == 0:  # still on existing nodes
                nxt = next((c for c in tree.children(node) if toks[c] == t), None)
                if nxt is not None:
                    node = nxt
                    continue
            toks.append(int(t))
            par.append(node)
            dep.append(1 if node < 0 else dep[node] + 1)
            node = len(toks) - 1
            added += 1
        if not added:
            return tree, 0
        pp = None
        if tree.path_prob is not None:  # copied nodes carry no drafter estimate
            pp = torch.cat([tree.path_prob, torch.full((added,), float("nan"), dtype=torch.float64)])
        return DraftTree(torch.tensor(toks, **long), torch.tensor(par, **long), torch.tensor(dep, **long),
                         tree.q_ids, tree.q_probs, path_prob=pp), added
    m = len(tokens)
    K = tree.q_ids.shape[1] if tree.q_ids is not None else 1
    new = torch.tensor([int(t) for t in tokens], **long)
    pm_ids = new[:, None].expand(m, K).clone()
    pm_p = torch.zeros(m, K, dtype=torch.float64)
    pm_p[:, 0] = 1.0
    old_par = tree.parent.clone()
    old_par[old_par >= 0] += m
    toks = torch.cat([new, tree.tokens])
    par = torch.cat([torch.arange(-1, m - 1), old_par])
    dep = torch.cat([torch.arange(1, m + 1), tree.depth])
    qids = pm_ids if tree.q_ids is None else torch.cat([pm_ids, tree.q_ids])
    qps = pm_p if tree.q_probs is None else torch.cat([pm_p, tree.q_probs])
    return DraftTree(toks, par, dep, qids, qps), m
