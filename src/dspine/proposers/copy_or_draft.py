"""The hybrid proposer: a copied continuation where the context repeats, the drafter elsewhere.

A learned drafter and a copy-based proposer win on different text: copies
are right for long stretches where the answer repeats the prompt (code edits, tool
calls, format conversion), the drafter on new text. Each cycle :meth:`HybridProposer.plan`
looks the context's suffix (anchor included) up in the request's n-gram index
(:mod:`.ngram`). Without a match the cycle drafts (source ``draft``, q the drafter's).
With one, the copy (source ``ngram`` for a match of 2+ tokens, ``ngram1`` for a single
token and, opt-in, ``ngram-contested`` when the matched suffix's two most recent earlier
occurrences were followed by different tokens, :meth:`NgramIndex.contested`; q a point
mass) and the drafter are both on offer, and the cost policy picks the
one with the higher expected tokens per second from each source's own observed
acceptance and cost (:meth:`dspine.control.per_source.PerSourcePolicy.pick`; a copy costs no drafter
forward); without a cost policy a copy is taken when its match has 2+ tokens. The choice reads only committed
tokens, the anchor and past cycles, so it is made before any proposal is drawn and
sampling stays exact (see :mod:`dspine.proposers.base`).

The drafter's context is committed every cycle, whichever source proposed: the target
forward that verifies a copy also yields the features of the committed positions.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from dspine.config import ConfigError, SamplingConfig
from dspine.proposers.base import Plan, Proposal, Proposer
from dspine.proposers.ngram import CACHE_SOURCE, NgramIndex, NgramProposer

MAX_COPY_BONUS = 1e4  # scores are logits (|T| ~ tens): 1e4 already means "always follow the copy"
FUSED_SOURCE = "fused"  # the drafter's chain with the copied continuation fused into its final stage
CONTESTED_SOURCE = "ngram-contested"  # a copy after a suffix the text continued in two ways (NgramIndex.contested)


class HybridState:
    """Per-request state: the drafter's (draft context K/V) and the n-gram index."""

    __slots__ = ("draft", "index", "chosen")

    def __init__(self, draft, index: NgramIndex):
        self.draft, self.index = draft, index
        self.chosen: tuple[int, str] | None = None  # (anchor, source) of the last plan


class HybridProposer(Proposer):
    """Copy when the context repeats, draft otherwise (decided per cycle from the context).

    Args:
        drafter: the learned drafter's proposer (:class:`~.drafter.DrafterProposer`).
        ngram: the copy proposer; its ``min_match`` is the shortest suffix match that
            offers a copy.
        strong_match: copies with a match of at least this many tokens are source
            ``ngram``, shorter ones ``ngram1`` (priced apart by the cost policy).
        split_contested: copies whose matched suffix was followed by different tokens at
            its two most recent earlier occurrences become source ``ngram-contested``, priced
            apart by the cost policy. Off by default: such copies are right far less often
            (13-36% of first tokens against 49-98%, measured offline), yet pricing them apart
            changed decode speed by no more than the noise (0.96-1.07x on five workloads in
            four runs, ``benchmarks/archive/contested_copies.py``, docs/decisions.md, 2026-12-04):
            the cost policy already verifies few of them.
        fuse_bonus: when set (``--copy-bonus``) and the drafter has a final stage, a cycle
            that drafts while a copy is on offer becomes source ``fused``: the copied
            continuation joins the candidates of each row and following it scores
            ``fuse_bonus`` more in the conditional tables, so the serial chain can take the
            copy where the drafter agrees or hesitates (q is the chain's own distribution
            over the fused tables: exact). Trees keep the copy as a grafted branch instead.
    Raises:
        ConfigError: ``fuse_bonus`` outside 0..:data:`MAX_COPY_BONUS` (naming ``SpeculativeConfig.copy_bonus``).
    """

    needs_features = True
    offers_alternatives = True

    def __init__(self, drafter: Proposer, ngram: NgramProposer | None = None, strong_match: int = 2,
                 fuse_bonus: float | None = None, split_contested: bool = False):
        self.drafter_proposer = drafter
        self.ngram = ngram or NgramProposer(drafter.block_size)
        self.strong_match = strong_match
        self.split_contested = bool(split_contested)
        if fuse_bonus is not None and (not isinstance(fuse_bonus, (int, float)) or isinstance(fuse_bonus, bool)
                                       or not 0 <= fuse_bonus <= MAX_COPY_BONUS):
            raise ConfigError(f"SpeculativeConfig.copy_bonus must be a number in 0..{MAX_COPY_BONUS:g} (a score bonus; "
                              f"float32 scores overflow far above that), got {fuse_bonus!r}", field="copy_bonus")
        # fuse copies into the final stage's chain (source ``fused``) where the drafter has one
        self.fuse_bonus = fuse_bonus if getattr(getattr(drafter, "cfg", None), "final_stage", False) else None
        self.block_size = drafter.block_size
        self.feature_layers = list(drafter.feature_layers)
        self.needs_features = drafter.needs_features
        self.source = drafter.source

    @property
    def drafter(self):
        """The drafter model (cost measurement and profile keys read it)."""
        return getattr(self.drafter_proposer, "drafter", None)

    @property
    def supports_tree(self) -> bool:
        return bool(self.drafter_proposer.supports_tree)

    def new_state(self, prompt_ids: list[int]) -> HybridState:
        return HybridState(self.drafter_proposer.new_state(prompt_ids),
                           self.ngram.new_state(prompt_ids, contested=self.split_contested))

    def commit(self, state: HybridState, features: torch.Tensor, start_pos: int) -> None:
        self.drafter_proposer.commit(state.draft, features, start_pos)

    def commit_many(self, states: list, features: list[torch.Tensor], starts: list[int]) -> None:
        self.drafter_proposer.commit_many([s.draft for s in states], features, starts)

    def observe(self, state: HybridState, tokens: list[int], start_pos: int) -> None:
        self.drafter_proposer.observe(state.draft, tokens, start_pos)
        self.ngram.observe(state.index, tokens, start_pos)

    def set_tenant(self, state: HybridState, tenant: str | None) -> None:
        """The request's tenant for the cross-request cache (:meth:`NgramProposer.set_tenant`)."""
        self.ngram.set_tenant(state.index, tenant)

    def finish(self, state: HybridState, prompt_ids: list[int], out_ids: list[int], reason: str | None) -> None:
        """A request finished: its output joins the cache (:meth:`NgramProposer.finish`)."""
        if state is not None:
            self.ngram.finish(state.index, prompt_ids, out_ids, reason)

    @property
    def sources(self) -> list[str]:
        """Every source this proposer may plan, the drafter's first (the cost policy keeps
        one policy per source)."""
        copies = ["ngram", "ngram1"] + ([CONTESTED_SOURCE] if self.split_contested else []) \
            + ([CACHE_SOURCE] if self.ngram.cache is not None else [])
        fused = [FUSED_SOURCE] if self.fuse_bonus is not None else []
        return [self.drafter_proposer.source] + copies + fused

    def copy_source(self, match: int, origin: str = "own", contested: bool = False) -> str:
        """The source name of a copy with a suffix match of ``match`` tokens: ``cache`` for a
        copy from the cross-request cache, ``ngram-contested`` for a ``contested`` match
        (when split), else ``ngram`` for ``match >= strong_match``, ``ngram1`` below (kept
        apart: a one-token or contested match is right far less often, and the cost policy
        prices each source by its own record)."""
        if origin == "cache":
            return CACHE_SOURCE
        if contested and self.split_contested:
            return CONTESTED_SOURCE
        return "ngram" if match >= self.strong_match else "ngram1"

    def alternatives(self, state: HybridState, anchor: int, n_max: int) -> list[Plan]:
        """The sources available this cycle: the copy (when the context's suffix matched
        the request's own text or, longer, the tenant's earlier outputs) first, then the
        drafter."""
        k, cont, origin = state.index.lookup_any(anchor, n_max, self.ngram.min_match)
        contested = bool(cont) and origin == "own" and self.split_contested and state.index.contested(anchor, k)
        out = [Plan(self.copy_source(k, origin, contested), len(cont), k)] if cont else []
        drafting = self.drafter_proposer.plan(state.draft, anchor, n_max)
        if cont and self.fuse_bonus is not None:  # the drafter's chain with the copy fused in
            drafting = Plan(FUSED_SOURCE, drafting.max_n, k)
        return out + [drafting]

    def plan(self, state: HybridState, anchor: int, n_max: int, pick=None) -> Plan:
        """``pick``'s choice among the alternatives; without ``pick`` (no cost policy) a copy
        with an uncontested match of ``strong_match`` tokens or more, else the drafter. The choice is kept
        in ``state`` for :meth:`propose`."""
        alts = self.alternatives(state, anchor, n_max)
        if pick is not None and len(alts) > 1:
            chosen = pick(alts)
        else:
            chosen = next(a for a in alts if a.source not in ("ngram1", CONTESTED_SOURCE))
        state.chosen = (anchor, chosen.source)
        return chosen

    def _source(self, state: HybridState, anchor: int, n: int) -> str:
        """The planned source for this anchor, or (no plan made) the choice without a policy."""
        if state.chosen is not None and state.chosen[0] == anchor:
            return state.chosen[1]
        return self.plan(state, anchor, n).source

    def _fused_copy(self, state: HybridState, anchor: int, n: int) -> list[int]:
        """The copied continuation a ``fused`` cycle injects into the final stage."""
        return state.index.lookup_any(anchor, n, self.ngram.min_match)[1]

    def propose(self, state: HybridState, anchor: int, anchor_pos: int, n: int, sampling: SamplingConfig,
                gen: torch.Generator | None) -> Proposal:
        """Propose ``n`` tokens from the source :meth:`plan` chose for this context."""
        src = self._source(state, anchor, n)
        state.chosen = None
        if src == FUSED_SOURCE:
            p = self.drafter_proposer.propose(state.draft, anchor, anchor_pos, n, sampling, gen,
                                              copy=self._fused_copy(state, anchor, n), bonus=self.fuse_bonus)
            p.source = src
            return p
        if src != self.drafter_proposer.source:
            p = self.ngram.propose(state.index, anchor, anchor_pos, n, sampling, gen)
            p.source = src
            return p
        p = self.drafter_proposer.propose(state.draft, anchor, anchor_pos, n, sampling, gen)
        p.source = p.source or self.drafter_proposer.source
        return p

    def propose_tree(self, state: HybridState, anchor: int, anchor_pos: int, depth: int, spec,
                     sampling: SamplingConfig, gen: torch.Generator | None, trim=None) -> Proposal | None:
        """The drafter's tree when this cycle drafts, with the copied continuation (a suffix
        match of ``strong_match``+ tokens) grafted on as one more branch
        (:func:`dspine.trees.build.graft`: merged into matching nodes when greedy, a separate
        point-mass branch when sampling); None (a chain, :meth:`propose`) when it copies.
        The copy reads only the committed context and the anchor, so its q is exact."""
        src = self._source(state, anchor, depth)
        if src not in (self.drafter_proposer.source, FUSED_SOURCE):
            return None
        p = self.drafter_proposer.propose_tree(state.draft, anchor, anchor_pos, depth, spec, sampling, gen, trim)
        if p is None:
            return None
        state.chosen = None
        p.source = src
        k, cont, _ = state.index.lookup_any(anchor, depth, self.ngram.min_match)
        if cont and k >= self.strong_match:  # the copied continuation joins the tree as one more branch
            from dspine.trees.build import graft

            tree, added = graft(p.tree, cont, merge=sampling.greedy)
            if added:
                p.tree, p.tokens, p.q_ids, p.q_probs = tree, tree.tokens, tree.q_ids, tree.q_probs
        return p

    def propose_many(self, reqs: list, positions: list[int], ns: list[int]) -> list[Proposal]:
        """Copies one by one; the drafter's requests together (one drafter forward)."""
        out: list[Proposal | None] = [None] * len(reqs)
        draft_idx = []
        srcs = {}
        for j, (r, p, n) in enumerate(zip(reqs, positions, ns)):
            src = self._source(r.draft_state, r.anchor, n)
            if src not in (self.drafter_proposer.source, FUSED_SOURCE):
                out[j] = self.propose(r.draft_state, r.anchor, p, n, r.sampling, r.gen)
            else:
                r.draft_state.chosen = None
                draft_idx.append(j)
                srcs[j] = src
        if draft_idx:
            shim = []
            for j in draft_idx:
                r = reqs[j]
                copy = self._fused_copy(r.draft_state, r.anchor, ns[j]) if srcs[j] == FUSED_SOURCE else None
                shim.append(SimpleNamespace(draft_state=r.draft_state.draft, anchor=r.anchor, sampling=r.sampling,
                                            gen=r.gen, copy=copy, bonus=self.fuse_bonus or 0.0))
            got = self.drafter_proposer.propose_many(shim, [positions[j] for j in draft_idx],
                                                     [ns[j] for j in draft_idx])
            for j, p in zip(draft_idx, got):
                p.source = srcs[j]
                out[j] = p
        return out

    def state_nbytes(self, state: HybridState) -> int:
        """Bytes of the drafter's context K/V (the n-gram index is small Python objects)."""
        return self.drafter_proposer.state_nbytes(state.draft)

    def kernel_info(self) -> dict:
        info = dict(self.drafter_proposer.kernel_info()) if hasattr(self.drafter_proposer, "kernel_info") else {}
        info.update(self.ngram.kernel_info())
        info["proposer"] = "hybrid"
        info["copy_bonus"] = self.fuse_bonus  # None: copies are not fused into the final stage
        return info
