"""Training batch construction and losses (spec section 9).

For each training sequence the target runs once (teacher forcing, no grad) and its
feature-layer outputs become the draft context. Many random anchors per sequence
form blocks: row 0 is the anchor token x_a, rows 1..B-1 are supervised with the
true next tokens x_{a+1..a+B-1}; the context keys visible to a block are the
positions strictly before its anchor (inside the window).

Losses:
* continuous CE on rows 1..B-1, row k weighted by ``exp(-(k-1)/gamma)``;
* final-stage K-way CE over the conditional score row ``T_i[u*, S_i]`` with the
  true predecessor u* (the anchor for row 1), the true token injected into S_i when
  the top-K misses it (only when the config has a final stage).

Soft labels (``--soft-labels K``): the target's own distribution at the
position before each supervised token, kept as its top-K probabilities from the same
teacher-forcing forward that gives the features. Row k's CE becomes
``(1 - lam) * CE(hard label) + lam * CE(p_topK)``, where ``CE(p) = -sum_v p(v) log q(v)``
over the K ids renormalized (forward KL to the truncated target distribution up to its
entropy, the distillation loss of Hinton et al. 2015; EAGLE-3 and DFlash train on hard
labels). With a one-hot ``p`` it equals the hard-label CE. With a vocabulary subset the
ids outside it are dropped before renormalizing; a row none of whose top-K ids is in the
subset keeps the plain hard-label CE.

Optionally the CE runs over a reduced vocabulary ``vocab_subset`` (the most frequent
target tokens, as EAGLE-3 does) to cut the cost of the frozen 49k head; rows whose
label lies outside the subset are skipped (project choice, docs/decisions.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as Fn

from dspine.drafter.model import DSpineDrafter


@dataclass
class Batch:
    """A padded batch of sequences.

    ids [b, T] int64 (pad 0), valid [b, T] bool, resp_start [b] int64 (first response
    position; anchors are drawn from the response only).
    """

    ids: torch.Tensor
    valid: torch.Tensor
    resp_start: torch.Tensor

    def to(self, device: torch.device | str) -> "Batch":
        """The same batch on ``device`` (a copy; ``self`` is unchanged)."""
        return Batch(self.ids.to(device), self.valid.to(device), self.resp_start.to(device))


def fit_window(ids: list[int], response_start: int, max_len: int) -> tuple[list[int], int]:
    """The ``max_len``-token training window of one (ids, response start) row: the prompt
    is cut from the left, never the response. A response longer than
    ``max_len - 1`` keeps one prompt token and its first ``max_len - 1`` tokens.

    Returns (window ids, response start within the window).
    Raises:
        ValueError: ``max_len`` < 2, or ``response_start`` outside 0..len(ids).
    """
    if max_len < 2:
        raise ValueError(f"--max-len {max_len} must be at least 2")
    if not 0 <= response_start <= len(ids):
        raise ValueError(f"response start {response_start} is outside the row's {len(ids)} tokens")
    if len(ids) <= max_len:
        return ids, response_start
    r = response_start
    if r == 0:  # no prompt: the response's first max_len tokens
        return ids[:max_len], 0
    if len(ids) - r + 1 <= max_len:  # the whole response fits: drop prompt tokens from the left
        cut = len(ids) - max_len
        return ids[cut:], r - cut
    return ids[r - 1:r - 1 + max_len], 1


def collate(seqs: list[tuple[list[int], int]], max_len: int) -> Batch:
    """Right-pad (ids, response_start) pairs to a batch, truncating to ``max_len``."""
    T = min(max_len, max(len(s) for s, _ in seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    valid = torch.zeros(len(seqs), T, dtype=torch.bool)
    rs = torch.zeros(len(seqs), dtype=torch.long)
    for i, (s, r) in enumerate(seqs):
        s = s[:T]
        ids[i, : len(s)] = torch.tensor(s)
        valid[i, : len(s)] = True
        rs[i] = min(r, len(s) - 2) if len(s) >= 2 else 0
    return Batch(ids, valid, rs)


def sample_anchors(batch: Batch, nb: int, gen: torch.Generator | None, u: torch.Tensor | None = None) -> torch.Tensor:
    """Anchor positions [b, nb] int64, uniform over [resp_start, len-2] of each sequence.

    ``u`` [b, nb] float64 uniforms may be given instead of ``gen`` (data parallel: the
    global batch's draws are sliced per rank so anchors do not depend on the rank).
    """
    lens = batch.valid.sum(1)  # [b]
    lo = batch.resp_start.clamp_min(1)  # anchors need at least one context position
    hi = (lens - 2).clamp_min(lo)
    if u is None:
        u = torch.rand(batch.ids.shape[0], nb, generator=gen, dtype=torch.float64)
    return (lo[:, None] + (u * (hi - lo + 1)[:, None]).floor().long()).clamp(max=hi[:, None])


def block_labels(batch: Batch, anchors: torch.Tensor, B: int) -> torch.Tensor:
    """Tokens at anchor+0..anchor+B-1 [b, nb, B]; -100 beyond the sequence."""
    pos = anchors[:, :, None] + torch.arange(B, device=anchors.device)  # [b, nb, B]
    T = batch.ids.shape[1]
    inside = pos < T
    g = torch.gather(batch.ids, 1, pos.clamp(max=T - 1).reshape(pos.shape[0], -1)).view_as(pos)
    ok = torch.gather(batch.valid, 1, pos.clamp(max=T - 1).reshape(pos.shape[0], -1)).view_as(pos) & inside
    return torch.where(ok, g, torch.full_like(g, -100))


def weight_sum(batch: Batch, anchors: torch.Tensor, B: int, gamma: float) -> float:
    """Sum of row weights over supervised rows of a batch (the CE normaliser)."""
    ok = block_labels(batch, anchors, B)[:, :, 1:] >= 0
    return float((row_weights(B, gamma) * ok).sum())


def row_weights(B: int, gamma: float, device=None) -> torch.Tensor:
    """Weights [B-1] = exp(-(k-1)/gamma) for rows k = 1..B-1 (spec section 9)."""
    k = torch.arange(1, B, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def target_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-``k`` next-token ids [..., k] int32 and probabilities [..., k]
    float16 (softmax over the whole vocabulary, not renormalized) from ``logits`` [..., V]."""
    p = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(p, k, dim=-1)
    return top.indices.to(torch.int32), top.values.to(torch.float16)


def soft_block_targets(soft: tuple[torch.Tensor, torch.Tensor], anchors: torch.Tensor, B: int,
                       remap: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The soft targets of rows 1..B-1 of each block: the target's top-K at positions
    anchor + 0 .. anchor + B-2 (row k's token follows position anchor + k - 1).

    soft: (ids [b, T, K] int, probs [b, T, K]) per sequence position; anchors [b, nb];
    remap [V] (full id -> subset index, -100 outside the subset) or None.
    Returns (ids [b, nb, B-1, K] int64 in subset indices, clamped to >= 0, and weights
    [b, nb, B-1, K] float32 summing to 1 over K where any id is in the subset, else 0).
    """
    ids, probs = soft
    b, T, K = ids.shape
    pos = (anchors[:, :, None] + torch.arange(B - 1, device=anchors.device)).clamp(max=T - 1)  # [b, nb, B-1]
    flat = pos.reshape(b, -1)
    g_ids = torch.gather(ids.long(), 1, flat[..., None].expand(-1, -1, K)).view(*pos.shape, K)
    g_p = torch.gather(probs.float(), 1, flat[..., None].expand(-1, -1, K)).view(*pos.shape, K)
    if remap is not None:
        g_ids = remap[g_ids]
        g_p = torch.where(g_ids >= 0, g_p, torch.zeros_like(g_p))
    tot = g_p.sum(-1, keepdim=True)
    w = torch.where(tot > 0, g_p / tot.clamp_min(1e-12), torch.zeros_like(g_p))
    return g_ids.clamp_min(0), w


def drafter_losses(drafter: DSpineDrafter, feats: torch.Tensor, batch: Batch, anchors: torch.Tensor,
                   gamma: float, vocab_subset: torch.Tensor | None = None,
                   fs_weight: float = 1.0, denom: float | None = None,
                   soft: tuple[torch.Tensor, torch.Tensor] | None = None,
                   soft_weight: float = 0.5, row1_anchors: torch.Tensor | None = None,
                   row1_weight: float = 1.0) -> dict[str, torch.Tensor]:
    """Losses for one batch.

    feats [b, T, F*d] target features; anchors [b, nb]. ``soft``: the target's top-K per
    position (ids [b, T, K], probs [b, T, K], :func:`target_topk`), mixed into each row's
    CE with weight ``soft_weight`` (module docstring). Returns a dict with ``loss``
    (scalar to backprop), ``ce``, ``fs`` (final-stage CE, 0 without final stage),
    ``acc1`` (row-1 top-1 accuracy of the continuous logits) and ``rows``.
    ``denom`` overrides the weight normaliser (data parallel: global weight sum / world
    size, so averaged gradients equal those of one process over the global batch).

    ``row1_anchors`` [b, n1] int64 (optional): extra anchors trained on row 1 only, a
    dense row-1 term as an EAGLE-style head is trained at every position. Each runs a
    two-row block (the anchor and row 1; exact for a block-causal drafter, see
    :meth:`DSpineDrafter.forward_blocks`) over the same context K/V; its continuous CE
    and final-stage CE (mean over the supervised rows of this process) are added with
    weight ``row1_weight``, and reported as ``r1``. Raises ValueError for a
    bidirectional (DFlash-style) drafter, which cannot run two of its rows.
    """
    cfg = drafter.cfg
    B = cfg.block_size
    b, T = batch.ids.shape
    dev = feats.device
    pos = torch.arange(T, device=dev)[None].expand(b, T)
    ctx = drafter.context_kv(feats, pos)
    x0 = torch.gather(batch.ids, 1, anchors)  # [b, nb]
    out = drafter.forward_blocks(x0, anchors, ctx, pos, batch.valid)
    labels = block_labels(batch, anchors, B)[:, :, 1:]  # [b, nb, B-1]
    w = row_weights(B, gamma, dev).expand_as(labels)
    H = drafter.head
    remap = None
    if vocab_subset is not None:
        Hs = H[vocab_subset]  # [Vs, d]
        remap = torch.full((H.shape[0],), -100, dtype=torch.long, device=dev)
        remap[vocab_subset] = torch.arange(vocab_subset.shape[0], device=dev)
        tgt = torch.where(labels >= 0, remap[labels.clamp_min(0)], labels)
    else:
        Hs, tgt = H, labels
    hn = drafter.norm_f(out.h[:, :, 1:])  # [b, nb, B-1, d]
    z = hn @ Hs.to(hn.dtype).T  # [b, nb, B-1, Vs]
    ok = tgt >= 0
    ce_rows = Fn.cross_entropy(z.float().reshape(-1, z.shape[-1]), tgt.reshape(-1), ignore_index=-100,
                               reduction="none").view_as(tgt)
    if soft is not None and soft_weight > 0:
        s_ids, s_w = soft_block_targets(soft, anchors, B, remap)
        logq = torch.log_softmax(z.float(), dim=-1)  # [b, nb, B-1, Vs]
        soft_rows = -(torch.gather(logq, -1, s_ids) * s_w).sum(-1)  # [b, nb, B-1]
        has = s_w.sum(-1) > 0  # a row whose top-K lies wholly outside the subset keeps its hard CE
        ce_rows = torch.where(has, (1 - soft_weight) * ce_rows + soft_weight * soft_rows, ce_rows)
    wsum = (w * ok).sum().clamp_min(1.0) if denom is None else torch.tensor(max(denom, 1e-6), device=dev)
    ce = (ce_rows * w * ok).sum() / wsum
    with torch.no_grad():
        acc1 = ((z[:, :, 0].argmax(-1) == tgt[:, :, 0]) & ok[:, :, 0]).sum() / ok[:, :, 0].sum().clamp_min(1)
    fs = torch.zeros((), device=dev)
    if cfg.final_stage:
        fs = final_stage_loss(drafter, out, z.detach(), tgt, labels, x0, Hs, w, ok, cfg.head_topk, wsum)
    loss = ce + fs_weight * fs
    r1 = torch.zeros((), device=dev)
    if row1_anchors is not None and row1_weight > 0:
        r1 = row1_loss(drafter, ctx, pos, batch, row1_anchors, Hs, remap, fs_weight)
        loss = loss + row1_weight * r1
    return {"loss": loss, "ce": ce.detach(), "fs": fs.detach(), "acc1": acc1,
            "rows": ok.sum(), "r1": r1.detach()}


def row1_loss(drafter: DSpineDrafter, ctx, pos: torch.Tensor, batch: Batch, anchors: torch.Tensor,
              Hs: torch.Tensor, remap: torch.Tensor | None, fs_weight: float = 1.0) -> torch.Tensor:
    """Row-1 loss of two-row blocks at ``anchors`` [b, n1]: continuous CE plus
    ``fs_weight`` times the final stage's K-way CE, each the mean over supervised rows.

    ctx: the drafter's per-layer context K/V of the batch; pos [b, T]; Hs [Vs, d] the
    (subset) head; remap [V] full id -> subset index (-100 outside) or None.
    """
    x0 = torch.gather(batch.ids, 1, anchors)
    out = drafter.forward_blocks(x0, anchors, ctx, pos, batch.valid, rows=2)
    labels = block_labels(batch, anchors, 2)[:, :, 1:]  # [b, n1, 1]
    tgt = labels if remap is None else torch.where(labels >= 0, remap[labels.clamp_min(0)], labels)
    z = drafter.norm_f(out.h[:, :, 1:]) @ Hs.to(out.h.dtype).T  # [b, n1, 1, Vs]
    ok = tgt >= 0
    n = ok.sum().clamp_min(1)
    ce = (Fn.cross_entropy(z.float().reshape(-1, z.shape[-1]), tgt.reshape(-1), ignore_index=-100,
                           reduction="none").view_as(tgt) * ok).sum() / n
    if not drafter.cfg.final_stage:
        return ce
    w = torch.ones_like(tgt, dtype=torch.float32)
    fs = final_stage_loss(drafter, out, z.detach(), tgt, labels, x0, Hs, w, ok, drafter.cfg.head_topk,
                          n.float())
    return ce + fs_weight * fs


def final_stage_loss(drafter: DSpineDrafter, out, z: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor,
                     x0: torch.Tensor, Hs: torch.Tensor, w: torch.Tensor, ok: torch.Tensor, K: int,
                     wsum: torch.Tensor | None = None) -> torch.Tensor:
    """K-way CE over ``T_i[u*, S_i]`` (spec sections 4 and 9).

    z [b, nb, B-1, Vs] detached continuous logits (candidate choice); tgt: labels in
    subset indices; labels: true token ids (predecessors); x0 [b, nb] anchors.
    """
    Lw = drafter.cfg.num_layers - 1
    cand = torch.topk(z, K, dim=-1).indices  # [b, nb, B-1, K] subset indices
    hit = (cand == tgt[..., None]).any(-1)  # [b, nb, B-1]
    inject = ok & ~hit
    cand[..., -1] = torch.where(inject, tgt.clamp_min(0), cand[..., -1])  # true token injected
    pos_in = (cand == tgt[..., None]).float().argmax(-1)  # [b, nb, B-1]
    pred = torch.cat([x0[:, :, None], labels[:, :, :-1].clamp_min(0)], dim=2)  # true predecessor ids
    e = drafter.alpha * drafter.codebook(pred).to(out.h_pre.dtype)  # [b, nb, B-1, dc]
    c_i = out.c[:, :, 1:]
    m = torch.sigmoid(drafter.g_r(c_i) + drafter.g_p(e)) * drafter.v_p(e)
    hu = out.h_pre[:, :, 1:] + out.r[:, :, 1:] * drafter.write[Lw](m)  # [b, nb, B-1, d]
    hv = Hs[cand].to(hu.dtype)  # [b, nb, B-1, K, d]
    scores = torch.einsum("bnid,bnikd->bnik", drafter.norm_f(hu), hv).float()
    ce = Fn.cross_entropy(scores.reshape(-1, K), pos_in.reshape(-1), reduction="none").view_as(pos_in)
    return (ce * w * ok).sum() / ((w * ok).sum().clamp_min(1.0) if wsum is None else wsum)


LR_SCHEDULES = ("cosine", "constant")


def cosine_lr(step: int, total: int, warmup: int, base: float, floor: float = 0.1,
              schedule: str = "cosine") -> float:
    """Learning rate at ``step``: linear warmup over ``warmup`` steps to ``base``, then
    (``schedule`` "cosine") cosine decay to ``floor * base`` at ``total`` (``--min-lr-ratio``;
    0 decays to zero), or (``schedule`` "constant") ``base`` from then on, whatever ``total``
    is: the open-ended schedule of a run that each working period extends with
    ``--resume --steps`` (the rate of a step never depends on where the run will end).

    Raises:
        ValueError: an unknown ``schedule`` (names ``--lr-schedule``).
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"--lr-schedule {schedule!r}: choose one of {', '.join(LR_SCHEDULES)}")
    if step < warmup:
        return base * (step + 1) / warmup
    if schedule == "constant":
        return base
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))
