"""The proposer interface: what the engine asks of anything that proposes tokens.

A *proposer* turns a request's state (committed context, anchor) into a block of
proposals ``y_1..y_n`` and the distribution q they were drawn from (spec section 5).
Verification and commit do not care which proposer made them: the verifier accepts
``y_i`` with probability ``min(1, p_i(y_i) / q_i(y_i))``, so every proposer only has
to report q exactly. A deterministic proposer (greedy drafter, copied continuation)
reports a point mass (``q_ids`` [n, 1], ``q_probs`` ones), which the verifier handles
like any sparse q.

Per cycle the engine calls, in this order:

1. :meth:`Proposer.plan` (state, anchor, n_max, pick) -> :class:`Plan`: which *source*
   this cycle uses and how many proposals it can offer at most. It reads only the
   committed context and the anchor, never a random draw, so the choice is
   non-anticipating and sampling stays exact whatever the plan is (the same argument as
   the verification length policy, :mod:`dspine.control.policy`). A proposer with several
   sources (the hybrid) lists the ones available and lets ``pick`` (the cost policy's
   :meth:`~dspine.control.per_source.PerSourcePolicy.pick`, from past cycles only) choose.
2. the verification-length policy, ``policy(request, plan.max_n) -> n`` (it sees the
   plan's source as ``request.source``);
3. :meth:`Proposer.propose` (n >= 1) -> :class:`Proposal`, from the planned source;
4. after verification, :meth:`Proposer.commit` (target features of the committed
   positions) and :meth:`Proposer.observe` (their token ids).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspine.config import SamplingConfig


@dataclass
class Proposal:
    """One block of proposals for one request.

    tokens [n] int64; q_ids [n, K] (sparse) or None (dense / greedy);
    q_probs [n, K] or [n, V] float64, or None for greedy. Times in seconds.
    ``source``: the proposer source that made it (``draft``, ``ngram``, ...).
    """

    tokens: torch.Tensor
    q_ids: torch.Tensor | None = None
    q_probs: torch.Tensor | None = None
    draft_s: float = 0.0
    final_s: float = 0.0
    source: str = ""
    # of ``draft_s``: projecting the draft context of positions committed in earlier cycles
    # (deferred commits, DraftContextCache.flush), and how many positions that was
    context_s: float = 0.0
    context_rows: int = 0
    # a draft tree (dspine.trees.DraftTree) when the proposer made one (Proposer.propose_tree);
    # ``tokens`` / ``q_*`` are then the tree's nodes, not a chain
    tree: object = None


@dataclass(frozen=True)
class Plan:
    """What one cycle will propose, decided before any proposal token is drawn.

    source: the source's name (``draft`` for a learned drafter, ``ngram`` for a copied
        continuation); statistics and the cost policy are kept per source.
    max_n: the most proposals this source can offer this cycle (<= the engine's n_max).
    match: length of the context suffix the copy source matched (0 when not copying).
    """

    source: str
    max_n: int
    match: int = 0


class Proposer:
    """Interface of a proposer at run time (one state object per request).

    Attributes:
        block_size: proposals per cycle at most + 1 (the anchor's row).
        needs_features: whether :meth:`commit` needs target features (the engine
            captures ``feature_layers`` of the target only then).
        source: the name of this proposer's default source (see :class:`Plan`).
        sources: every source :meth:`plan` may name (the cost controller keeps one
            estimate per source when there are several), the default first.
        feature_layers: the target layers whose outputs :meth:`commit` reads (empty: none).
        offers_alternatives: whether :meth:`plan` chooses among sources with ``pick``.
        supports_tree: whether :meth:`propose_tree` can return a draft tree.
    """

    block_size: int = 16
    needs_features: bool = True
    source: str = "draft"
    feature_layers: tuple[int, ...] | list[int] = ()
    offers_alternatives: bool = False
    supports_tree: bool = False  # whether :meth:`propose_tree` can return a tree

    @property
    def sources(self) -> list[str]:
        """Every source :meth:`plan` may name, the default (:attr:`source`) first."""
        return [self.source]

    def new_state(self, prompt_ids: list[int]):
        return None

    def commit(self, state, features: torch.Tensor, start_pos: int) -> None:
        """Add features [n, F*d] of accepted positions start_pos..start_pos+n-1."""

    def commit_many(self, states: list, features: list[torch.Tensor], starts: list[int]) -> None:
        """:meth:`commit` for several requests (the batched engine's commit step)."""
        for s, f, p in zip(states, features, starts):
            self.commit(s, f, p)

    def observe(self, state, tokens: list[int], start_pos: int) -> None:
        """Token ids of the committed positions start_pos..start_pos+len(tokens)-1 (the
        prompt at prefill; the anchor and accepted proposals after each cycle)."""

    def set_tenant(self, state, tenant: str | None) -> None:
        """Whose part of a cross-request cache ``state`` reads and writes (None: the default)."""

    def finish(self, state, prompt_ids: list[int], out_ids: list[int], reason: str | None) -> None:
        """The request ended (``reason``: "stop", "length", ...); e.g. its output joins a cache."""

    def plan(self, state, anchor: int, n_max: int, pick=None) -> Plan:
        """This cycle's source and its most proposals (see :class:`Plan`).

        ``pick``: optional ``pick(plans) -> Plan`` (the cost policy's choice among
        alternatives, from past statistics only); a proposer with a single source
        ignores it."""
        return Plan(self.source, n_max)

    def propose(self, state, anchor: int, anchor_pos: int, n: int, sampling: SamplingConfig,
                gen: torch.Generator | None) -> Proposal:
        raise NotImplementedError

    def propose_tree(self, state, anchor: int, anchor_pos: int, depth: int, spec, sampling: SamplingConfig,
                     gen: torch.Generator | None, trim=None) -> Proposal | None:
        """A draft tree at most ``depth`` deep under ``spec`` (:class:`dspine.trees.TreeSpec`),
        as a :class:`Proposal` with ``tree`` set, or None when this proposer (or this
        cycle's planned source) makes chains only; the engine then calls :meth:`propose`.
        Every node must carry the exact q it was drawn from (see :mod:`dspine.trees`).
        ``trim``: optional ``trim(tree, draft_s) -> tree`` applied to a greedy best-first
        tree before anything is grafted on (:meth:`dspine.control.tree_sizer.TreeSizer.trim`)."""
        return None

    def propose_many(self, reqs: list, positions: list[int], ns: list[int]) -> list[Proposal]:
        """:meth:`propose` for several requests (``reqs``: engine requests with
        ``draft_state``, ``anchor``, ``sampling``, ``gen``; every ``ns[j] >= 1``).
        Proposers that can share work across requests override this."""
        return [self.propose(r.draft_state, r.anchor, p, n, r.sampling, r.gen)
                for r, p, n in zip(reqs, positions, ns)]

    def state_nbytes(self, state) -> int:
        """Bytes held by one request's ``state`` (the drafter's context K/V); 0 here."""
        return 0

    def kernel_info(self) -> dict:
        """What this proposer runs, for ``--json`` stats."""
        return {}
