"""Final stage: serial refinement of the last bridge write (spec section 4).

1. Candidates: a row-scaled quantized copy of the head H (FP8 on CUDA, int8 here)
   scores the vocabulary, keeps K_c, the exact head rescores those, keeps K. The
   fallback scores with the exact head directly. Candidates only propose; they never
   decide the target's output.
2. Conditional states ``h_i(u) = h_i^pre + r_i W_L(sigmoid(G_r c_i + G_p a E[u]) * V_p a E[u])``.
3. Conditional score tables ``T_i[u, v] = H_v . norm_f(h_i(u))`` (K x K; 1 x K for row 1).
4. Chain: greedy argmax, or sampled from ``q_i`` = filtered softmax of the row in FP64;
   the sampled path returns the sparse q (candidate ids + probabilities).

The greedy DFlash-style baseline (no bridge, no final stage) takes its argmax through
the same candidate pass (:func:`parallel_argmax`), so both drafters pay the same head
cost for greedy drafting (docs/decisions.md); sampled, it keeps the dense q of spec
section 10.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspine.config import SamplingConfig
from dspine.drafter.model import DSpineDrafter
from dspine.core.sampling import filter_probs, sample_index, uniform
from dspine.runtime.lean_drafter import lean_tables


class QuantizedHead:
    """Row-scaled quantized copy of H [V, d] for the coarse candidate pass.

    int8 with a per-row float32 scale (``H_v ~= s_v * Hq_v / 127``); inputs are
    quantized per row too and multiplied with ``torch._int_mm`` (int32 accumulate).
    On CUDA with float8 support the copy is float8_e4m3fn instead.
    Memory: V*d bytes + 4*V bytes (scales).
    """

    def __init__(self, head: torch.Tensor):
        w = head.detach().float()  # [V, d]
        self.device = w.device
        self.fp8 = w.is_cuda and hasattr(torch, "float8_e4m3fn")
        amax = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)  # [V, 1]
        if self.fp8:
            self.scale = (amax / 448.0).squeeze(1)  # [V]
            self.q = (w / self.scale[:, None]).to(torch.float8_e4m3fn)
        else:
            self.scale = (amax / 127.0).squeeze(1)  # [V]
            self.q_t = torch.round(w / self.scale[:, None]).to(torch.int8).T.contiguous()  # [d, V]

    def nbytes(self) -> int:
        t = self.q if self.fp8 else self.q_t
        return t.numel() * t.element_size() + self.scale.numel() * 4

    def exact_for(self, x: torch.Tensor) -> bool:
        """Never: rounded scores, rescored on H (:func:`candidates`)."""
        return False

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Approximate ``x @ H.T``: x [m, d] float -> [m, V] float32."""
        x = x.float()
        if self.fp8:
            return (x @ self.q.float().T) * self.scale
        sx = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0  # [m, 1]
        xq = torch.round(x / sx).to(torch.int8)  # [m, d]
        m = xq.shape[0]
        if m <= 16:  # _int_mm needs m > 16 on some backends: pad rows
            xq = torch.cat([xq, xq.new_zeros(17 - m, xq.shape[1])])
        acc = torch._int_mm(xq, self.q_t)[:m]  # [m, V] int32
        return acc.float() * sx * self.scale


def candidates(drafter: DSpineDrafter, x: torch.Tensor, k: int, k_coarse: int,
               qhead: QuantizedHead | None) -> torch.Tensor:
    """Top-``k`` candidate ids per row of normed states x [m, d] -> [m, k] int64.

    With ``qhead``: coarse top-``k_coarse`` by the quantized head, then exact rescoring
    of those with H, keep ``k`` (a pass whose scores are exact, ``qhead.exact_for(x)``, keeps
    its own top ``k``: the same ids up to near-ties); a ``qhead`` over a draft vocabulary (its ``ids``,
    :mod:`dspine.drafter.vocab`) proposes only those ids. Without: exact head over the full
    vocabulary.
    """
    H = drafter.head
    if qhead is None:
        return torch.topk(x @ H.to(x.dtype).T, k, dim=-1).indices
    scores = qhead.scores(x)  # [m, V] (or [m, Vs] over a draft vocabulary)
    ids = getattr(qhead, "ids", None)
    if qhead.exact_for(x):  # the pass's scores are already exact: no rescoring
        top = torch.topk(scores, min(k, scores.shape[1]), dim=-1).indices  # [m, k]
        return top if ids is None else ids[top]
    coarse = torch.topk(scores, min(k_coarse, scores.shape[1]), dim=-1).indices  # [m, Kc]
    if ids is not None:  # columns of a draft vocabulary -> target ids (dspine.drafter.vocab)
        coarse = ids[coarse]
    exact = torch.einsum("md,mkd->mk", x, H[coarse].to(x.dtype))  # [m, Kc]
    top = torch.topk(exact, k, dim=-1).indices  # [m, k]
    return torch.gather(coarse, 1, top)


def conditional_tables(drafter: DSpineDrafter, h_pre: torch.Tensor, r: torch.Tensor, c: torch.Tensor,
                       anchor: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Conditional score tables for one block per batch element.

    h_pre [b, B, d], r [b, B, 1], c [b, B, dc] of the last layer; anchor [b];
    cand [b, B-1, K] candidate ids of rows 1..B-1. Returns T [b, B-1, K, K] float32
    where ``T[:, i-1, j, v]`` is row i's score of candidate v given predecessor
    candidate j of row i-1 (row 1: every j is the anchor x0, so all rows are equal).
    """
    b, Bm1, K = cand.shape
    lean = lean_tables(drafter, h_pre, cand, r, c)
    if lean is not None:  # one block on Q8_0 blocks: the same products in one C++ call
        return lean.conditional_tables(h_pre, r, c, anchor, cand)
    L = drafter.cfg.num_layers - 1
    pred = torch.cat([anchor[:, None, None].expand(b, 1, K), cand[:, :-1]], dim=1)  # [b, B-1, K]
    e = drafter.alpha * drafter.codebook(pred).to(h_pre.dtype)  # [b, B-1, K, dc]
    gate = torch.sigmoid(drafter.g_r(c[:, 1:, None]) + drafter.g_p(e))  # [b, B-1, K, dm]
    w = drafter.write[L](gate * drafter.v_p(e))  # [b, B-1, K, d]
    hu = h_pre[:, 1:, None] + r[:, 1:, None] * w  # [b, B-1, K(u), d]
    hv = drafter.head[cand].to(hu.dtype)  # [b, B-1, K(v), d]
    return torch.einsum("biud,bivd->biuv", drafter.norm_f(hu), hv).float()


def inject_copy(cand: torch.Tensor, copy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Make a copied continuation's tokens candidates (fuse the copy into the chain).

    cand [n, K] int64 candidates of rows 1..n; copy [m] int64 the copied continuation
    (c_1 proposed for row 1, ...). For rows i < min(n, m): ``c_i`` keeps its slot when it
    is already a candidate, else it replaces the last-ranked candidate (so the set stays
    K distinct ids). Returns (cand' [n, K], slot [min(n, m)] int64: the column of c_i).
    Must run *before* :func:`conditional_tables`, so row i+1's predecessor message sees
    the injected token.
    """
    cand = cand.clone()
    k = min(cand.shape[0], int(copy.shape[0]))
    slot = torch.empty(k, dtype=torch.long)
    for i in range(k):
        hit = (cand[i] == copy[i]).nonzero()
        if hit.numel():
            slot[i] = int(hit[0, 0])
        else:
            cand[i, -1] = copy[i]
            slot[i] = cand.shape[1] - 1
    return cand, slot


def copy_bonus(T: torch.Tensor, slot: torch.Tensor, bonus: float) -> torch.Tensor:
    """Add ``bonus`` to the score of following the copied continuation: row 1's score of
    ``c_1`` (every predecessor slot holds the anchor) and row i's score of ``c_i`` given
    the predecessor ``c_{i-1}`` (T [n, K, K] float32, slot from :func:`inject_copy`).
    Returns a new table; the chain's q is then the filtered softmax of these scores, which
    is the distribution the chain really samples from (spec section 4), so verification
    stays exact."""
    T = T.clone()
    if slot.numel():
        T[0, :, slot[0]] += bonus
        for i in range(1, slot.numel()):
            T[i, slot[i - 1], slot[i]] += bonus
    return T


def fused_tables(drafter: DSpineDrafter, h_pre: torch.Tensor, r: torch.Tensor, c: torch.Tensor,
                 anchor: torch.Tensor, cand: torch.Tensor, copies: list, bonus: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`conditional_tables` with copied continuations fused in.

    Same inputs as :func:`conditional_tables` (cand [b, n, K]) plus ``copies``: per batch
    element a list of copied token ids or None. Each copy is injected into that element's
    candidates (:func:`inject_copy`) *before* the tables are computed, then following it
    scores ``bonus`` more (:func:`copy_bonus`). Returns (cand' [b, n, K], T [b, n, K, K])."""
    slots = [None] * cand.shape[0]
    if any(copies):
        cand = cand.clone()
        for j, cp in enumerate(copies):
            if cp:
                cand[j], slots[j] = inject_copy(cand[j], torch.tensor(cp, dtype=torch.long, device=cand.device))
    T = conditional_tables(drafter, h_pre, r, c, anchor, cand)
    for j, sl in enumerate(slots):
        if sl is not None and bonus:
            T[j] = copy_bonus(T[j], sl, bonus)
    return cand, T


@dataclass
class Chain:
    """Proposals of one block: tokens [n] int64; for sampling also q over candidates.

    q_ids [n, K] int64 and q_probs [n, K] float64 (sparse q, spec section 4), or
    None for greedy chains.
    """

    tokens: torch.Tensor
    q_ids: torch.Tensor | None
    q_probs: torch.Tensor | None


def chain(T: torch.Tensor, cand: torch.Tensor, n: int, sampling: SamplingConfig,
          gen: torch.Generator | None, prior=None) -> Chain:
    """Serial chain over positions 1..n of one block: T [B-1, K, K], cand [B-1, K].

    Greedy: ``y_1 = argmax T_1[x0, .]``, ``y_i = argmax T_i[y_{i-1}, .]``. Sampling:
    ``q_i = filter_probs(T_i[y_{i-1}, .])`` (float64) and ``y_i ~ q_i``. ``prior``:
    optional ``prior(chosen: list[int], cand_i [K]) -> [K] float32`` added to row i's
    scores given the chain's earlier choices (:class:`dspine.drafter.ngram_prior.NgramPrior`);
    q_i is then the filtered softmax of the sum, still what the chain samples from.
    """
    j = 0  # row 1 conditions on the anchor (every predecessor slot holds x0)
    toks, qs = [], []
    chosen: list[int] = []
    for i in range(n):
        row = T[i, j]  # [K]
        if prior is not None:
            row = row + prior(chosen, cand[i])
        if sampling.greedy:
            j = int(torch.argmax(row))
        else:
            q = filter_probs(row, sampling)  # [K] float64
            j = sample_index(q, uniform(gen))
            qs.append(q)
        toks.append(cand[i, j])
        chosen.append(int(cand[i, j]))
    tokens = torch.stack(toks) if toks else cand.new_zeros(0)
    if sampling.greedy or n == 0:
        return Chain(tokens, None, None)
    return Chain(tokens, cand[:n].clone(), torch.stack(qs))


def parallel_argmax(drafter: DSpineDrafter, x: torch.Tensor, qhead: QuantizedHead | None) -> torch.Tensor:
    """Greedy DFlash-style proposals: argmax of the continuous logits ``H . x_i`` per row.

    x [n, d] normed states -> [n] int64. With ``qhead`` the argmax is taken over the
    exact-rescored coarse pool (the candidate pass above), which is the exact argmax
    whenever it lies in the top-``coarse_k`` of the quantized scores; without it, over
    the full vocabulary. Proposals never decide the output (the target verifies).
    """
    if x.shape[0] == 0:
        return x.new_zeros(0, dtype=torch.long)
    return candidates(drafter, x, 1, drafter.cfg.coarse_k, qhead)[:, 0]
