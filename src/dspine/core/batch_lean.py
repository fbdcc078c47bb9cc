"""The batched engine's verification forward on the lean decode path.

Every running request's inputs of a cycle (its anchor and its proposals: a chain, or a
flattened draft tree, :class:`dspine.trees.DraftTree`) are packed without padding into
calls of the lean path's C++ forward (:meth:`dspine.runtime.lean.LeanDecode.forward_ragged`)
over the rows of the batched slot cache (:class:`dspine.core.kv.SlotKV`). Input ``j`` of a
request writes its K/V at column ``start + j`` of the request's row; a chain's input sits
at position ``start + j`` and sees the columns up to its own, a tree node at ``start +
depth`` and sees the committed columns and its ancestors (``DraftTree.attention_mask``).
Calls hold at most :func:`lean_chunk` inputs; a request's inputs may span two calls (its
earlier inputs' K/V are in the cache by then). The kernels are batch-invariant, so each
request's logits and features are bitwise those of its own one-request lean forward,
whatever else runs in the batch (``tests/test_batch_lean.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Inputs:
    """One request's inputs of a cycle.

    tokens: [T] int64, the anchor first.
    offsets: [T] int64 positions relative to the anchor (a tree's depths, 0 for the anchor),
        or None for a chain (0..T-1).
    mask: [T, T] bool, input r sees input c (a tree's ancestors and itself), or None (causal).
    """

    tokens: torch.Tensor
    offsets: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def __post_init__(self):
        t = int(self.tokens.shape[0]) if self.tokens.dim() == 1 else -1
        if t < 1:
            raise ValueError(f"Inputs.tokens must be [T] with T >= 1, got shape {tuple(self.tokens.shape)}")
        if (self.mask is None) != (self.offsets is None):
            raise ValueError("Inputs: a tree needs both offsets and mask (a chain neither)")
        if self.mask is not None and (tuple(self.mask.shape) != (t, t) or tuple(self.offsets.shape) != (t,)):
            raise ValueError(f"Inputs: a tree of {t} inputs needs offsets [{t}] and mask [{t}, {t}], got "
                             f"{tuple(self.offsets.shape)} and {tuple(self.mask.shape)}")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def lean_chunk(target, plan) -> int:
    """Most inputs per lean call: the lean path's measured rows, and no more than the output
    head's kernels take (so a request's logits are those of its one-request forward)."""
    return min(plan.rows, getattr(target.model.lm_head, "rows", plan.rows))


def lean_forward(target, plan, kv, inputs: list[Inputs], starts: list[int], feature_layers: list[int] | None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """One cycle's target forward for every request (module docstring).

    Args:
        target: the dense-runtime target (``target.runtime``, ``target.model.lm_head``).
        plan: its :class:`~dspine.runtime.lean.LeanDecode`.
        kv: the batched :class:`~dspine.core.kv.SlotKV`; request i is row i, its committed
            length ``starts[i]``.
        inputs: per request, its :class:`Inputs` (at least one token each).
        feature_layers: the target layers whose outputs the drafter reads, or None.
    Returns:
        per request, logits [T_i, V] float32 and features [T_i, F*d] (None without feature
        layers).
    Raises:
        RuntimeError: from the kernel, when an input falls outside the cache or its mask.
    """
    rt = target.runtime
    sizes = [len(q) for q in inputs]
    kv._ensure(max(s + t for s, t in zip(starts, sizes)))
    tok = torch.cat([q.tokens.reshape(-1).long().cpu() for q in inputs])
    row = torch.cat([torch.full((t,), i, dtype=torch.long) for i, t in enumerate(sizes)])
    slot = torch.cat([torch.arange(s, s + t) for s, t in zip(starts, sizes)])
    tree = None
    if any(q.mask is not None for q in inputs):  # masks for all: a chain's is causal
        W = max(sizes)
        mask = torch.zeros(len(tok), W, dtype=torch.bool)
        rope, base, o = [], [], 0
        for q, s, t in zip(inputs, starts, sizes):
            mask[o:o + t, :t] = q.mask if q.mask is not None else torch.ones(t, t, dtype=torch.bool).tril()
            rope.append(s + (q.offsets.long().cpu() if q.offsets is not None else torch.arange(t)))
            base.append(torch.full((t,), s, dtype=torch.long))
            o += t
        tree = (torch.cat(rope), torch.cat(base), mask)
    cap, M = lean_chunk(target, plan), len(tok)
    logits = feats = None
    for lo in range(0, M, cap):
        hi = min(M, lo + cap)
        part = None if tree is None else tuple(t[lo:hi] for t in tree)
        x, by = plan.forward_ragged(rt, tok[lo:hi], row[lo:hi], slot[lo:hi], kv.k, kv.v,
                                    list(feature_layers or ()), part)
        lg, ft = rt._finish(x, by, feature_layers, 0)  # [1, m, V], [1, m, F*d]
        if logits is None:
            logits = torch.empty(M, lg.shape[-1], dtype=torch.float32)
            feats = None if ft is None else torch.empty(M, ft.shape[-1], dtype=ft.dtype)
        logits[lo:hi] = lg[0]
        if feats is not None:
            feats[lo:hi] = ft[0]
    offs = [0]
    for t in sizes:
        offs.append(offs[-1] + t)
    split = lambda a: [a[offs[i]:offs[i + 1]] for i in range(len(sizes))]  # noqa: E731
    return split(logits), (split(feats) if feats is not None else None)
