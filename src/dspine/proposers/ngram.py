"""Copy proposals: an n-gram index over the request's own tokens (prompt lookup).

When the text being written repeats earlier text (code edits, format conversion, tool
calls quoting their arguments), the continuation of the latest earlier occurrence of
the context's suffix is a strong proposal that costs no model at all. This is prompt
lookup decoding (Saxena 2023; ``prompt_lookup_num_tokens`` in HF transformers, vLLM's
``ngram`` method) over prompt *and* generated tokens, with the index updated
incrementally as tokens are committed, as SuffixDecoding (Oliaro et al., NeurIPS 2025)
does with a suffix tree.

Index: hashed n-grams (Python dict of token tuples, n = 1..``max_ngram``) mapping each
n-gram to where the continuation of its most recent occurrence starts, plus how often
it occurred. Appending a token costs ``max_ngram`` dict writes and a lookup
``max_ngram`` reads, independent of the context length; a suffix automaton gives the
longest match of any length, which past ~4 tokens changes little for proposals (the
match only has to be long enough to be right). Memory: ~``max_ngram`` entries per token.

Proposals are deterministic given the context, so q is a point mass on each proposed
token (``q_ids`` [n, 1], ``q_probs`` ones): the verifier accepts ``y`` with probability
``p(y)`` and on rejection samples from ``p`` without ``y``, renormalized (spec section
5 with q = delta_y), which is exact.
"""
from __future__ import annotations

import time

import torch

from dspine.config import ConfigError, SamplingConfig
from dspine.proposers.base import Plan, Proposal, Proposer
from dspine.proposers.cache import CacheView, OutputCache

CACHE_SOURCE = "cache"  # the source name of copies from the cross-request cache (.cache)


class NgramIndex:
    """Hashed n-gram index over one request's committed token ids.

    Attributes:
        tokens: committed token ids (positions 0..len-1), prompt included.
        last: n-gram (tuple, 1..max_ngram tokens) -> index in ``tokens`` where the
            continuation after its most recent occurrence starts.
        count: n-gram -> occurrences with a known continuation.
        prev: n-gram -> where the continuation of its occurrence before the most recent
            one starts (n-grams that occurred at least twice), for :meth:`contested`; None
            unless the index was built with ``contested=True`` (kept only when asked for:
            the default hybrid does not read it).
        shared: the request's view of the cross-request cache of earlier outputs
            (:class:`.cache.CacheView`), or None.
    """

    MAX_NGRAM = 16  # longer matches change nothing measurable (benchmarks/archive/ngram_tuning.json); memory ~ max x context

    def __init__(self, max_ngram: int = 4, contested: bool = False):
        if not 1 <= max_ngram <= self.MAX_NGRAM:
            raise ConfigError(f"SpeculativeConfig.ngram_max {max_ngram} must be in 1..{self.MAX_NGRAM}", field="ngram_max")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}
        self.count: dict[tuple[int, ...], int] = {}
        self.prev: dict[tuple[int, ...], int] | None = {} if contested else None
        self.shared: CacheView | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        """Commit one token: every n-gram ending just before it now has a continuation."""
        i, toks = len(self.tokens), self.tokens
        for k in range(1, min(self.max_ngram, i) + 1):
            key = tuple(toks[i - k:i])
            if self.prev is not None:
                j = self.last.get(key)
                if j is not None:
                    self.prev[key] = j
            self.last[key] = i
            self.count[key] = self.count.get(key, 0) + 1
        toks.append(int(token))

    def observe(self, tokens: list[int], start_pos: int) -> None:
        """Commit ``tokens`` at positions start_pos.. (a start before the end rebuilds
        the index from the kept prefix, as after a rollback; one past the end is an error).

        Raises:
            ValueError: ``start_pos`` beyond the committed length (a gap).
        """
        if start_pos > len(self.tokens):
            raise ValueError(f"n-gram index holds {len(self.tokens)} tokens; cannot commit at position {start_pos}")
        if start_pos < len(self.tokens):
            kept = self.tokens[:start_pos]
            self.tokens, self.last, self.count = [], {}, {}
            self.prev = {} if self.prev is not None else None
            for t in kept:
                self.append(t)
        for t in tokens:
            self.append(t)

    def lookup(self, anchor: int, n: int, min_match: int = 1) -> tuple[int, list[int]]:
        """Longest suffix match of ``tokens + [anchor]`` (at most ``max_ngram`` tokens, at
        least ``min_match``) with an earlier occurrence; returns (match length, up to
        ``n`` tokens that followed its most recent occurrence), or (0, []) without one.
        The continuation may run into the suffix itself (repetitive text)."""
        toks, L = self.tokens, len(self.tokens)
        for k in range(min(self.max_ngram, L + 1), max(min_match, 1) - 1, -1):
            key = self._key(anchor, k)
            j = self.last.get(key)
            if j is None:
                continue
            cont = toks[j:j + n]
            if len(cont) < n and j + len(cont) == L:  # the copy reaches the anchor itself
                cont = cont + [int(anchor)]
            return k, cont[:n]
        return 0, []

    def _key(self, anchor: int, k: int) -> tuple[int, ...]:
        """The context's last ``k`` tokens, the anchor included (1 <= k <= len + 1)."""
        return tuple(self.tokens[len(self.tokens) - k + 1:]) + (int(anchor),) if k > 1 else (int(anchor),)

    def contested(self, anchor: int, k: int) -> bool:
        """Whether the context's last ``k`` tokens (the anchor included), a suffix
        :meth:`lookup` matched, were followed by different tokens at their two most recent
        earlier occurrences: the text has gone on in more than one way after this suffix,
        so a copy of the most recent way is right far less often (measured on the committed
        target-written data, the first 800 chat and 800 code answers: a first copied token
        right 13% / 22% of the time after a contested one-token match against 49% / 63%
        after a repeat followed alike, 30% / 36% against 98% for longer matches;
        ``benchmarks/archive/contested_offline.py``, docs/decisions.md).
        False when the suffix occurred fewer than two times. Reads committed tokens and the
        anchor only.

        Raises:
            ValueError: the index was not built with ``contested=True``.
        """
        if self.prev is None:
            raise ValueError("NgramIndex.contested needs an index built with contested=True")
        key = self._key(anchor, k)
        j, p = self.last.get(key), self.prev.get(key)
        if j is None or p is None:
            return False
        follow = self.tokens[j] if j < len(self.tokens) else int(anchor)  # j = len: the anchor follows
        return self.tokens[p] != follow

    def lookup_any(self, anchor: int, n: int, min_match: int = 1) -> tuple[int, list[int], str]:
        """:meth:`lookup` in the request's own text and, when a cross-request cache is
        attached (``shared``), in the tenant's earlier outputs; the cache's continuation
        is taken only when its match is strictly longer. Returns (match length,
        continuation, origin ``"own"`` or ``"cache"``)."""
        k, cont = self.lookup(anchor, n, min_match)
        if self.shared is not None:
            tail = self.tokens[len(self.tokens) - self.max_ngram + 1:] if self.max_ngram > 1 else []
            kc, cc = self.shared.lookup(tail + [int(anchor)], n)
            if kc > k:
                return kc, cc, "cache"
        return k, cont, "own"


def point_mass(tokens: list[int], t0: float, source: str) -> Proposal:
    """Proposal of deterministic ``tokens`` with q = delta (q_ids [n, 1], q_probs [n, 1] ones)."""
    toks = torch.tensor(tokens, dtype=torch.long)
    return Proposal(toks, toks[:, None].clone(), torch.ones(len(tokens), 1, dtype=torch.float64),
                    draft_s=time.perf_counter() - t0, source=source)


class NgramProposer(Proposer):
    """Prompt-lookup proposer over the request's prompt and output (no model, no features).

    Args:
        block_size: proposals per cycle at most + 1 (default 16, as the drafters).
        max_ngram: longest suffix matched (``SpeculativeConfig.ngram_max``).
        min_match: shortest suffix match that proposes (``SpeculativeConfig.ngram_min``); shorter
            matches give a plain target step.
        cache: an optional cross-request cache of earlier outputs
            (:class:`.cache.OutputCache`, ``SpeculativeConfig.ngram_cache_tokens``): requests are attached
            to their tenant's part by :meth:`set_tenant` and add their output by
            :meth:`finish`; its copies are source ``cache``.
    Raises:
        ValueError: a setting out of range (naming it).
    """

    needs_features = False
    feature_layers: list[int] = []
    source = "ngram"

    def __init__(self, block_size: int = 16, max_ngram: int = 4, min_match: int = 1,
                 cache: OutputCache | None = None):
        if not 2 <= block_size <= 64:
            raise ConfigError(f"SpeculativeConfig.block_size {block_size} must be in 2..64 for the n-gram proposer "
                              f"(at most block size - 1 copied tokens per cycle)", field="block_size")
        if not 1 <= max_ngram <= NgramIndex.MAX_NGRAM:
            raise ConfigError(f"SpeculativeConfig.ngram_max {max_ngram} must be in 1..{NgramIndex.MAX_NGRAM}",
                              field="ngram_max")
        if not 1 <= min_match <= max_ngram:
            raise ConfigError(f"SpeculativeConfig.ngram_min {min_match} must be in 1..SpeculativeConfig.ngram_max "
                              f"({max_ngram})", field="ngram_min")
        if cache is not None and cache.max_ngram != max_ngram:
            raise ConfigError(f"the output cache indexes {cache.max_ngram}-grams but SpeculativeConfig.ngram_max is "
                              f"{max_ngram}", field="ngram_max")
        self.block_size, self.max_ngram, self.min_match = block_size, max_ngram, min_match
        self.cache = cache

    def new_state(self, prompt_ids: list[int], contested: bool = False) -> NgramIndex:
        """A request's index; ``contested``: it also keeps what :meth:`NgramIndex.contested` reads."""
        return NgramIndex(self.max_ngram, contested=contested)

    def set_tenant(self, state: NgramIndex, tenant: str | None) -> None:
        """Attach the request to ``tenant``'s part of the cross-request cache (no-op
        without a cache). ``None`` is the default tenant ``""``."""
        if self.cache is not None:
            state.shared = CacheView(self.cache, tenant or "")

    def finish(self, state: NgramIndex, prompt_ids: list[int], out_ids: list[int], reason: str | None) -> None:
        """A request finished: store its prompt's last ``max_ngram`` tokens and its output
        in its tenant's part of the cache (only when it ended by EOS / stop / length)."""
        if self.cache is not None and state is not None and state.shared is not None \
                and reason in ("stop", "length") and out_ids:
            self.cache.add(state.shared.tenant, list(prompt_ids[-self.max_ngram:]) + list(out_ids))

    @property
    def sources(self) -> list[str]:
        """``ngram`` (copies of the request's own text), then ``cache`` when there is a
        cross-request cache: its long copies of earlier answers are right far more often than
        prompt lookup, so the cost controller prices them apart."""
        return [self.source] + ([CACHE_SOURCE] if self.cache is not None else [])

    def copy_source(self, origin: str) -> str:
        """This proposer's source name for a copy from ``origin`` (``own`` / ``cache``)."""
        return CACHE_SOURCE if origin == "cache" else self.source

    def observe(self, state: NgramIndex, tokens: list[int], start_pos: int) -> None:
        state.observe(tokens, start_pos)

    def plan(self, state: NgramIndex, anchor: int, n_max: int, pick=None) -> Plan:
        k, cont, origin = state.lookup_any(anchor, n_max, self.min_match)
        return Plan(self.copy_source(origin), len(cont), k)

    def propose(self, state: NgramIndex, anchor: int, anchor_pos: int, n: int, sampling: SamplingConfig,
                gen: torch.Generator | None) -> Proposal:
        """Copy up to ``n`` tokens (fewer when the match's continuation is shorter)."""
        t0 = time.perf_counter()
        _, cont, origin = state.lookup_any(anchor, n, self.min_match)
        return point_mass(cont, t0, self.copy_source(origin))

    def kernel_info(self) -> dict:
        info = {"proposer": "ngram", "ngram": {"max": self.max_ngram, "min_match": self.min_match}}
        if self.cache is not None:
            info["ngram"]["cache"] = {"max_tokens": self.cache.max_tokens, "min_match": self.cache.min_match}
        return info
