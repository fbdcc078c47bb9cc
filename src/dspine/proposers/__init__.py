"""Proposers: everything that proposes tokens for the target to verify.

- :mod:`.base`: the interface (:class:`Proposer`, :class:`Proposal`, :class:`Plan`);
- :mod:`.drafter`: the learned DSpine and DFlash-style drafters;
- :mod:`.ngram`: copies of the request's own earlier text (prompt lookup, no model);
- :mod:`.hybrid`: a copy where the context repeats, the drafter elsewhere;
- :mod:`.cache`: a bounded per-tenant cache of earlier outputs the copies also read.

:func:`make_proposer` builds one by its ``--proposer`` name.
"""
from __future__ import annotations

from dspine.argtypes import PROPOSER_NAMES as PROPOSERS  # the --proposer values
from dspine.config import ConfigError
from dspine.proposers.base import Plan, Proposal, Proposer
from dspine.proposers.cache import MIN_TOKENS, OutputCache
from dspine.proposers.draft_context import DraftContextCache
from dspine.proposers.drafter import DrafterProposer, propose_batch
from dspine.proposers.copy_or_draft import MAX_COPY_BONUS, HybridProposer, HybridState
from dspine.proposers.ngram import NgramIndex, NgramProposer


def check_copy_settings(name: str, mode: str = "dspine", cache_tokens: int = 0, ngram_max: int = 4,
                        copy_bonus: float | None = None) -> None:
    """Refuse copy settings (``ngram_cache_tokens``, ``copy_bonus``) that cannot work with
    proposer ``name`` and ``mode`` (checked before anything is loaded). Messages name the
    :class:`~dspine.config.SpeculativeConfig` fields; the command line shows its flags.

    Raises:
        ConfigError: with the field at fault: an unknown proposer, a cache below its minimum,
            without copies or with ``ngram_max`` < 2, a copy bonus out of range or without
            the hybrid.
    """
    F = "SpeculativeConfig."
    if name not in PROPOSERS:
        raise ConfigError(f"{F}proposer {name!r} is unknown; accepted: {', '.join(PROPOSERS)}", field="proposer")
    if cache_tokens < 0:
        raise ConfigError(f"{F}ngram_cache_tokens must be >= 0 (0 = no cache), got {cache_tokens}",
                          field="ngram_cache_tokens")
    if cache_tokens:
        if mode == "ar" or name == "drafter":
            none = f"{F}mode ar" if mode == "ar" else f"{F}proposer drafter"
            raise ConfigError(f"{F}ngram_cache_tokens needs {F}proposer hybrid or ngram (copies); {none} makes none",
                              field="ngram_cache_tokens")
        if cache_tokens < MIN_TOKENS:
            raise ConfigError(f"{F}ngram_cache_tokens must be 0 (off) or >= {MIN_TOKENS}, got {cache_tokens}",
                              field="ngram_cache_tokens")
        if ngram_max < 2:
            raise ConfigError(f"{F}ngram_cache_tokens needs {F}ngram_max >= 2 (the cache proposes on matches of "
                              f"2+ tokens), got {F}ngram_max {ngram_max}", field="ngram_cache_tokens")
    if copy_bonus is not None:
        if not isinstance(copy_bonus, (int, float)) or isinstance(copy_bonus, bool) \
                or not 0 <= copy_bonus <= MAX_COPY_BONUS:
            raise ConfigError(f"{F}copy_bonus must be in 0..{MAX_COPY_BONUS:g} (a score bonus; float32 scores "
                              f"overflow far above that), got {copy_bonus!r}", field="copy_bonus")
        if mode == "ar" or name != "hybrid":
            none = f"{F}mode ar" if mode == "ar" else f"{F}proposer {name}"
            raise ConfigError(f"{F}copy_bonus needs {F}proposer hybrid (it fuses copies into the drafter's chain); "
                              f"{none} has none", field="copy_bonus")


def make_proposer(name: str, drafter: Proposer | None, block_size: int = 16, ngram_max: int = 4,
                  ngram_min: int = 1, cache_tokens: int = 0, copy_bonus: float | None = None) -> Proposer:
    """The proposer ``name`` (see :data:`PROPOSERS`) over ``drafter`` (a
    :class:`DrafterProposer`; unused for ``ngram``). ``cache_tokens`` > 0 gives the copy
    proposer a cross-request cache of earlier outputs of that many tokens
    (:class:`OutputCache`, ``ngram_cache_tokens``). ``copy_bonus``: the hybrid fuses copies
    into the DSpine final stage's chain with this score bonus (``copy_bonus``; None = off).

    Raises:
        ConfigError: unknown name (naming ``SpeculativeConfig.proposer``), no drafter where
            one is needed, a cache with proposer ``drafter`` (it makes no copies), or
            ``copy_bonus`` without the hybrid.
    """
    check_copy_settings(name, cache_tokens=cache_tokens, ngram_max=ngram_max, copy_bonus=copy_bonus)
    cache = OutputCache(cache_tokens, ngram_max) if cache_tokens else None
    bs = drafter.block_size if drafter is not None else block_size
    if name == "ngram":
        return NgramProposer(bs, ngram_max, ngram_min, cache=cache)
    if drafter is None:
        raise ConfigError(f"SpeculativeConfig.proposer {name} needs a drafter", field="proposer")
    if name == "drafter":
        return drafter
    return HybridProposer(drafter, NgramProposer(bs, ngram_max, ngram_min, cache=cache), fuse_bonus=copy_bonus)


def output_cache_of(proposer) -> OutputCache | None:
    """The cross-request output cache a proposer's copies read, or None."""
    ngram = proposer if isinstance(proposer, NgramProposer) else getattr(proposer, "ngram", None)
    return getattr(ngram, "cache", None)


__all__ = ["PROPOSERS", "DraftContextCache", "check_copy_settings", "DrafterProposer", "HybridProposer", "HybridState",
           "NgramIndex", "NgramProposer", "OutputCache", "Plan", "Proposal", "Proposer", "make_proposer", "output_cache_of",
           "propose_batch"]
