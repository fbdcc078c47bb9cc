"""The hybrid proposer: a copied continuation where the context repeats, the drafter elsewhere.

A learned drafter and a copy-based proposer win on different text (issue 20): copies
are right for long stretches where the answer repeats the prompt (code edits, tool
calls, format conversion), the drafter on new text. Each cycle :meth:`HybridProposer.plan`
looks the context's suffix (anchor included) up in the request's n-gram index
(:mod:`.ngram`): a match of at least ``min_match`` tokens with a continuation makes this
a copy cycle (source ``ngram``, q a point mass), otherwise a drafter cycle (source
``draft``, q the drafter's). The choice reads only committed tokens and the anchor, so
it is made before any proposal is drawn and sampling stays exact (see
:mod:`dspine.proposers.base`); the verification length is then priced per source by
the cost policy (:class:`dspine.policy.PerSourcePolicy`), from each source's own
observed acceptance and cost (a copy costs no drafter forward).

The drafter's context is committed every cycle, whichever source proposed: the target
forward that verifies a copy also yields the features of the committed positions.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ..config import SamplingConfig
from .base import Plan, Proposal, Proposer
from .ngram import NgramIndex, NgramProposer


class HybridState:
    """Per-request state: the drafter's (draft context K/V) and the n-gram index."""

    __slots__ = ("draft", "index")

    def __init__(self, draft, index: NgramIndex):
        self.draft, self.index = draft, index

    def nbytes(self) -> int:
        """Bytes of the drafter's context K/V (the index is small Python objects)."""
        return int(getattr(self.draft, "nbytes", lambda: 0)())


class HybridProposer(Proposer):
    """Copy when the context repeats, draft otherwise (decided per cycle from the context).

    Args:
        drafter: the learned drafter's proposer (:class:`~.drafter.DrafterProposer`).
        ngram: the copy proposer; its ``min_match`` is the shortest suffix match that
            makes a cycle a copy cycle.
    """

    needs_features = True

    def __init__(self, drafter: Proposer, ngram: NgramProposer | None = None):
        self.drafter_proposer = drafter
        self.ngram = ngram or NgramProposer(drafter.block_size)
        self.block_size = drafter.block_size
        self.feature_layers = list(getattr(drafter, "feature_layers", []) or [])
        self.needs_features = getattr(drafter, "needs_features", True)
        self.source = drafter.source

    @property
    def drafter(self):
        """The drafter model (cost measurement and profile keys read it)."""
        return getattr(self.drafter_proposer, "drafter", None)

    def new_state(self, prompt_ids: list[int]) -> HybridState:
        return HybridState(self.drafter_proposer.new_state(prompt_ids), self.ngram.new_state(prompt_ids))

    def commit(self, state: HybridState, features: torch.Tensor, start_pos: int) -> None:
        self.drafter_proposer.commit(state.draft, features, start_pos)

    def commit_many(self, states: list, features: list[torch.Tensor], starts: list[int]) -> None:
        self.drafter_proposer.commit_many([s.draft for s in states], features, starts)

    def observe(self, state: HybridState, tokens: list[int], start_pos: int) -> None:
        self.drafter_proposer.observe(state.draft, tokens, start_pos)
        self.ngram.observe(state.index, tokens, start_pos)

    def plan(self, state: HybridState, anchor: int, n_max: int) -> Plan:
        p = self.ngram.plan(state.index, anchor, n_max)
        if p.max_n > 0:
            return p
        return self.drafter_proposer.plan(state.draft, anchor, n_max)

    def propose(self, state: HybridState, anchor: int, anchor_pos: int, n: int, sampling: SamplingConfig,
                gen: torch.Generator | None) -> Proposal:
        """Propose ``n`` tokens from the source :meth:`plan` chooses for this context."""
        if self.ngram.plan(state.index, anchor, n).max_n > 0:
            return self.ngram.propose(state.index, anchor, anchor_pos, n, sampling, gen)
        p = self.drafter_proposer.propose(state.draft, anchor, anchor_pos, n, sampling, gen)
        p.source = p.source or self.drafter_proposer.source
        return p

    def propose_many(self, reqs: list, positions: list[int], ns: list[int]) -> list[Proposal]:
        """Copies one by one; the drafter's requests together (one drafter forward)."""
        out: list[Proposal | None] = [None] * len(reqs)
        draft_idx = []
        for j, (r, p, n) in enumerate(zip(reqs, positions, ns)):
            if self.ngram.plan(r.draft_state.index, r.anchor, n).max_n > 0:
                out[j] = self.ngram.propose(r.draft_state.index, r.anchor, p, n, r.sampling, r.gen)
            else:
                draft_idx.append(j)
        if draft_idx:
            shim = [SimpleNamespace(draft_state=reqs[j].draft_state.draft, anchor=reqs[j].anchor,
                                    sampling=reqs[j].sampling, gen=reqs[j].gen) for j in draft_idx]
            got = self.drafter_proposer.propose_many(shim, [positions[j] for j in draft_idx],
                                                     [ns[j] for j in draft_idx])
            for j, p in zip(draft_idx, got):
                p.source = p.source or self.drafter_proposer.source
                out[j] = p
        return out

    def kernel_info(self) -> dict:
        info = dict(self.drafter_proposer.kernel_info()) if hasattr(self.drafter_proposer, "kernel_info") else {}
        info.update(self.ngram.kernel_info())
        info["proposer"] = "hybrid"
        return info
