"""A cross-request cache of earlier outputs for copy proposals.

Requests of one user often repeat each other: the same tool-call scaffolding, the same
boilerplate, the same answer to a resent question. SuffixDecoding (Oliaro et al.,
NeurIPS 2025) and Arctic Inference keep a global index over earlier *outputs* beside
the per-request index over the prompt; this is that global part for dspine's copy
proposer (:mod:`.ngram`): when the request's own text offers no match (or a shorter
one), the continuation of the most recent earlier output whose n-gram matches the
context's suffix is proposed instead.

- **Tenants.** Every entry belongs to one tenant (the server derives it from the API
  key, ``dspine serve --ngram-cache-scope``); a lookup only ever sees its own tenant's
  entries, so nothing one API key generated is proposed to another unless the server is
  configured to share (``global`` scope: every request is the same tenant).
- **Bounded.** At most ``max_tokens`` tokens in all tenants together; the oldest entry
  (in any tenant) goes first. An n-gram's slot points at its most recent occurrence;
  evicting an entry removes the slots that still point into it (an older occurrence in
  a surviving entry is not recovered: the index is lossy, never wrong).
- **What is stored.** The last ``max_ngram`` prompt tokens (so the start of a response,
  e.g. after the chat template's assistant header, can match) and the output tokens of a
  request that finished by EOS, a stop string or its length limit; cancelled and failed
  requests are not stored.

Exactness: a proposal from the cache is a deterministic function of the request's
committed context and of entries written before this cycle (by requests whose outputs do
not depend on this request's future random draws), so it is verified with a point-mass
q like any copy (:func:`.ngram.point_mass`); greedy output stays the target's own.
Memory: ~``max_ngram`` dict slots per stored token (:meth:`OutputCache.nbytes`
estimates ~:data:`BYTES_PER_SLOT` bytes each).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from dspine.config import ConfigError

SCOPES = ("key", "global")  # --ngram-cache-scope
MIN_TOKENS = 2  # the smallest useful bound: one entry of 2 tokens
BYTES_PER_SLOT = 170  # tuple key + dict entry + (entry, pos) tuple: ~166 B measured with tracemalloc (random ids)


def bytes_bound(max_tokens: int, max_ngram: int = 4) -> int:
    """Most bytes a cache of ``max_tokens`` tokens holds by the :meth:`OutputCache.nbytes`
    estimate: each token stored once (8 B) and at most ``max_ngram`` index slots per token
    (``dspine memory --ngram-cache-tokens``)."""
    return int(max_tokens) * (8 + int(max_ngram) * BYTES_PER_SLOT)


class OutputCache:
    """Earlier outputs per tenant, indexed by hashed n-grams (n = 1..``max_ngram``).

    Args:
        max_tokens: most tokens stored over all tenants (``SpeculativeConfig.ngram_cache_tokens``, >= 1).
        max_ngram: longest n-gram indexed (the copy proposer's ``SpeculativeConfig.ngram_max``).
        min_match: shortest suffix match that proposes from the cache (default 2: a
            one-token match over many outputs is mostly noise).
    Raises:
        ConfigError: a setting out of range (naming it; :attr:`~dspine.config.ConfigError.field`
            where it is a :class:`~dspine.config.SpeculativeConfig` field).

    Thread safety: one lock around every public method (the server's scheduler thread
    writes and reads; ``/health`` reads :meth:`stats`).
    """

    def __init__(self, max_tokens: int, max_ngram: int = 4, min_match: int = 2):
        F = "SpeculativeConfig."
        for name, v, fld in ((f"{F}ngram_cache_tokens", max_tokens, "ngram_cache_tokens"),
                             (f"{F}ngram_max", max_ngram, "ngram_max"), ("min_match", min_match, None)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"{name} must be an integer, got {v!r}", field=fld)
        if max_tokens < MIN_TOKENS:
            raise ConfigError(f"{F}ngram_cache_tokens must be >= {MIN_TOKENS} to enable the cache (an entry "
                              f"needs 2 tokens), got {max_tokens}", field="ngram_cache_tokens")
        if not 2 <= max_ngram <= 16:
            raise ConfigError(f"{F}ngram_cache_tokens needs {F}ngram_max in 2..16 (the cache proposes on matches "
                              f"of 2+ tokens), got {F}ngram_max {max_ngram}", field="ngram_cache_tokens")
        if not 1 <= min_match <= max_ngram:
            raise ConfigError(f"cache min_match {min_match} must be in 1..{F}ngram_max ({max_ngram})")
        self.max_tokens, self.max_ngram, self.min_match = int(max_tokens), int(max_ngram), int(min_match)
        self._entries: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()  # id -> (tenant, tokens), oldest first
        self._index: dict[str, dict[tuple[int, ...], tuple[int, int]]] = {}  # tenant -> ngram -> (id, pos)
        self._next = 0
        self._tokens = 0
        self._slots = 0
        self.hits = 0
        self.lookups = 0
        self._lock = threading.Lock()

    # -- writing --------------------------------------------------------------------------------
    def add(self, tenant: str, tokens: list[int]) -> None:
        """Store ``tokens`` (one finished request's prompt tail + output) for ``tenant``;
        keeps the last ``max_tokens`` of a longer one; evicts the oldest entries beyond
        the bound. Entries shorter than 2 tokens (no continuation to offer) are skipped."""
        toks = list(tokens)[-self.max_tokens:]
        bad = [t for t in toks if not isinstance(t, int) or isinstance(t, bool) or t < 0]
        if bad:
            raise ValueError(f"output cache entries are token ids (ints >= 0), got {bad[0]!r}")
        if len(toks) < 2:
            return
        with self._lock:
            eid = self._next
            self._next += 1
            self._entries[eid] = (tenant, toks)
            self._tokens += len(toks)
            idx = self._index.setdefault(tenant, {})
            for i in range(1, len(toks)):  # the n-grams ending at i-1 continue at i
                for k in range(1, min(self.max_ngram, i) + 1):
                    key = tuple(toks[i - k:i])
                    if key not in idx:
                        self._slots += 1
                    idx[key] = (eid, i)
            while self._tokens > self.max_tokens:
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        eid, (tenant, toks) = self._entries.popitem(last=False)
        self._tokens -= len(toks)
        idx = self._index.get(tenant, {})
        for i in range(1, len(toks)):
            for k in range(1, min(self.max_ngram, i) + 1):
                key = tuple(toks[i - k:i])
                slot = idx.get(key)
                if slot is not None and slot[0] == eid:
                    del idx[key]
                    self._slots -= 1
        if not idx:
            self._index.pop(tenant, None)

    def clear(self) -> None:
        """Forget every entry of every tenant."""
        with self._lock:
            self._entries.clear()
            self._index.clear()
            self._tokens = self._slots = 0

    # -- reading --------------------------------------------------------------------------------
    def lookup(self, tenant: str, suffix: list[int], n: int) -> tuple[int, list[int]]:
        """Longest match (``min_match``..``max_ngram`` tokens) of the end of ``suffix`` (the
        request's last committed tokens and its anchor) in ``tenant``'s earlier outputs;
        returns (match length, up to ``n`` tokens that followed its most recent
        occurrence, within that entry), or (0, [])."""
        with self._lock:
            self.lookups += 1
            idx = self._index.get(tenant)
            if not idx or n < 1:
                return 0, []
            for k in range(min(self.max_ngram, len(suffix)), self.min_match - 1, -1):
                slot = idx.get(tuple(int(t) for t in suffix[len(suffix) - k:]))
                if slot is None:
                    continue
                eid, pos = slot
                cont = self._entries[eid][1][pos:pos + n]
                if cont:
                    self.hits += 1
                    return k, list(cont)
            return 0, []

    def nbytes(self) -> int:
        """Estimated bytes held: stored tokens (8 B each in lists) + index slots."""
        return 8 * self._tokens + BYTES_PER_SLOT * self._slots

    def stats(self) -> dict:
        """Counters for ``/health`` and ``--json``: tenants, entries, tokens, slots, bytes,
        lookups, hits, the bound."""
        with self._lock:
            return {"tenants": len(self._index), "entries": len(self._entries), "tokens": self._tokens,
                    "max_tokens": self.max_tokens, "index_slots": self._slots, "bytes_estimate": self.nbytes(),
                    "lookups": self.lookups, "hits": self.hits}


class CacheView:
    """One request's handle on the cache: its tenant and the cache (a lookup sees that
    tenant's entries only)."""

    __slots__ = ("cache", "tenant")

    def __init__(self, cache: OutputCache, tenant: str):
        self.cache, self.tenant = cache, tenant

    def lookup(self, suffix: list[int], n: int) -> tuple[int, list[int]]:
        return self.cache.lookup(self.tenant, suffix, n)
