"""Proposers: everything that proposes tokens for the target to verify (issue 20).

- :mod:`.base`: the interface (:class:`Proposer`, :class:`Proposal`, :class:`Plan`);
- :mod:`.drafter`: the learned DSpine and DFlash-style drafters;
- :mod:`.ngram`: copies of the request's own earlier text (prompt lookup, no model);
- :mod:`.hybrid`: a copy where the context repeats, the drafter elsewhere.

:func:`make_proposer` builds one by its ``--proposer`` name.
"""
from __future__ import annotations

from ..argtypes import PROPOSER_NAMES as PROPOSERS  # the --proposer values
from .base import Plan, Proposal, Proposer
from .drafter import DraftContextCache, DrafterProposer, propose_batch
from .hybrid import HybridProposer, HybridState
from .ngram import NgramIndex, NgramProposer


def make_proposer(name: str, drafter: Proposer | None, block_size: int = 16, ngram_max: int = 4,
                  ngram_min: int = 1) -> Proposer:
    """The proposer ``name`` (see :data:`PROPOSERS`) over ``drafter`` (a
    :class:`DrafterProposer`; unused for ``ngram``).

    Raises:
        ValueError: unknown name (naming ``--proposer``), or no drafter where one is needed.
    """
    if name not in PROPOSERS:
        raise ValueError(f"--proposer {name!r} is unknown; accepted: {', '.join(PROPOSERS)}")
    bs = drafter.block_size if drafter is not None else block_size
    if name == "ngram":
        return NgramProposer(bs, ngram_max, ngram_min)
    if drafter is None:
        raise ValueError(f"--proposer {name} needs a drafter")
    if name == "drafter":
        return drafter
    return HybridProposer(drafter, NgramProposer(bs, ngram_max, ngram_min))


__all__ = ["PROPOSERS", "DraftContextCache", "DrafterProposer", "HybridProposer", "HybridState",
           "NgramIndex", "NgramProposer", "Plan", "Proposal", "Proposer", "make_proposer", "propose_batch"]
