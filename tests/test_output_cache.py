"""The cross-request output cache of the copy proposer.

- the index equals a brute-force search over the tenant's stored outputs (longest suffix
  match in min_match..max_ngram, most recent occurrence, continuation within its entry);
- tenants never see each other's entries; the token bound holds and evicted entries are
  never proposed;
- greedy: ``hybrid`` (shipped DSpine drafter, cost policy) and ``ngram`` with a cache
  emit exactly the ``ar`` ids of the real default target, with a cache holding the exact
  answer (its copies are accepted) and one holding unrelated text;
- sampling: exact-distribution test on a tiny random target with copies from the cache
  (point-mass q), and a negative control that must fail (cache copies verified with a
  wrong q);
- the server: tenants from the Authorization header, ``/health`` counters, settings
  refused with the setting named.
"""
from __future__ import annotations

import random

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ar_continuation
from dspine.config import SpeculativeConfig
from dspine.core.batch import BatchEngine
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import load_drafter, random_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.tune.controller import make_policy
from dspine.proposers import NgramProposer, OutputCache, make_proposer, output_cache_of
from test_policy import SAMPLING, exact_distribution, sources_chi_square

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the index --------------------------------------------------------------------------------
def brute_lookup(entries: list[list[int]], suffix: list[int], n: int, max_ngram: int, min_match: int):
    """Longest k in [min_match, max_ngram] whose last-k suffix occurs (with a continuation)
    in an entry; the most recent occurrence (latest entry, then latest position)."""
    for k in range(min(max_ngram, len(suffix)), min_match - 1, -1):
        key = suffix[len(suffix) - k:]
        for toks in reversed(entries):
            for i in range(len(toks) - 1, k - 1, -1):  # continuation starts at i
                if toks[i - k:i] == key:
                    return k, toks[i:i + n]
    return 0, []


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=25), min_size=1, max_size=5),
       st.lists(st.integers(0, 4), min_size=1, max_size=6), st.integers(1, 6), st.integers(2, 4),
       st.integers(1, 4))  # max_ngram >= 2: the cache refuses 1 (it proposes on 2+ token matches)
def test_cache_lookup_equals_brute_force(entries, suffix, n, max_ngram, min_match):
    min_match = min(min_match, max_ngram)
    c = OutputCache(10_000, max_ngram, min_match)
    for e in entries:
        c.add("t", e)
    kept = [e for e in entries if len(e) >= 2]
    assert c.lookup("t", suffix, n) == brute_lookup(kept, suffix, n, max_ngram, min_match)


def test_tenants_are_isolated_and_the_bound_holds():
    rng = random.Random(0)
    c = OutputCache(300, 4)
    a = [rng.randrange(50) for _ in range(120)]
    c.add("A", a)
    assert c.lookup("A", a[10:13], 5) == (3, a[13:18])
    assert c.lookup("B", a[10:13], 5) == (0, [])  # another tenant sees nothing of A's
    for i in range(10):  # 10 x 100 tokens of tenant B: A's entry and older B entries go
        c.add("B", [1000 + 100 * i + j for j in range(100)])
        assert c.stats()["tokens"] <= 300
    assert c.lookup("A", a[10:13], 5) == (0, [])  # evicted: never proposed again
    assert c.lookup("B", [1900, 1901], 3) == (2, [1902, 1903, 1904])
    assert c.lookup("B", [1000, 1001], 3) == (0, [])
    live = {eid for eid in c._entries}
    assert all(eid in live for idx in c._index.values() for eid, _ in idx.values())
    c.add("B", list(range(5000, 6000)))  # longer than the bound: its last 300 tokens
    assert c.stats()["tokens"] == 300 and c.lookup("B", [5700, 5701], 2) == (2, [5702, 5703])
    assert c.lookup("B", [5000, 5001], 2) == (0, [])


def test_memory_bound_holds_and_is_reported():
    from dspine.drafter.memory import drafter_config, estimate
    from dspine.proposers.cache import bytes_bound

    rng = random.Random(5)
    c = OutputCache(5000, 4)
    for _ in range(20):
        c.add("t", [rng.randrange(300) for _ in range(400)])  # repetitive: many shared n-grams
        c.add("u", [rng.randrange(50_000) for _ in range(400)])  # mostly unique n-grams
        assert c.stats()["tokens"] <= 5000 and c.nbytes() <= bytes_bound(5000, 4)
    rep = estimate(drafter_config("small"), None, ngram_cache_tokens=5000)
    assert rep["ngram_cache"] == bytes_bound(5000, 4) and rep.total("dspine") >= bytes_bound(5000, 4)


def test_settings_refused():
    with pytest.raises(ValueError, match="SpeculativeConfig.ngram_cache_tokens"):
        OutputCache(0)
    with pytest.raises(ValueError, match="SpeculativeConfig.ngram_cache_tokens"):
        make_proposer("ngram", None, cache_tokens=-1)
    with pytest.raises(ValueError, match="ngram_cache_tokens needs SpeculativeConfig.proposer hybrid or ngram"):
        make_proposer("drafter", NgramProposer(), cache_tokens=100)
    with pytest.raises(ValueError, match="SpeculativeConfig.ngram_max"):
        NgramProposer(16, max_ngram=3, cache=OutputCache(10, 4))
    for bad in (1, 2.5, float("nan"), "10"):  # an entry needs 2 tokens; no silent truncation
        with pytest.raises(ValueError, match="SpeculativeConfig.ngram_cache_tokens"):
            OutputCache(bad)
    with pytest.raises(ValueError, match="SpeculativeConfig.ngram_max in 2..16"):
        OutputCache(100, max_ngram=1)
    with pytest.raises(ValueError, match="token ids"):
        OutputCache(100).add("t", [1, 2, "3"])
    with pytest.raises(ValueError, match="token ids"):
        OutputCache(100).add("t", [1, 2.0])


def test_build_engine_refuses_cache_without_copies():
    from dspine.build import build_engine
    from dspine.config import ConfigError

    with pytest.raises(ConfigError, match="ngram_cache_tokens needs SpeculativeConfig.proposer hybrid or ngram"):
        build_engine(SpeculativeConfig(target="random:llama", drafter="random", mode="dspine",
                                       proposer="drafter", ngram_cache_tokens=100, verify_policy="fixed",
                                       linear_backend="aten", tree_budget=0))
    with pytest.raises(ConfigError, match="ngram_cache_tokens needs SpeculativeConfig.proposer hybrid or ngram"):
        build_engine(SpeculativeConfig(target="random:llama", drafter=None, mode="ar", proposer="hybrid",
                                       ngram_cache_tokens=100, verify_policy="fixed", linear_backend="aten",
                                       tree_budget=0))
    with pytest.raises(ConfigError, match="SpeculativeConfig.ngram_cache_tokens -5 must be an integer >= 0"):
        build_engine(SpeculativeConfig(target="random:llama", drafter="random", mode="dspine",
                                       proposer="hybrid", ngram_cache_tokens=-5, verify_policy="fixed",
                                       linear_backend="aten", tree_budget=0))
    with pytest.raises(ConfigError, match="SpeculativeConfig.ngram_cache_tokens must be 0 \\(off\\) or >= 2"):
        build_engine(SpeculativeConfig(target="random:llama", drafter="random", mode="dspine",
                                       proposer="hybrid", ngram_cache_tokens=1, verify_policy="fixed",
                                       linear_backend="aten", tree_budget=0))
    with pytest.raises(ConfigError, match="ngram_cache_tokens needs SpeculativeConfig.ngram_max >= 2"):
        build_engine(SpeculativeConfig(target="random:llama", drafter="random", mode="dspine",
                                       proposer="ngram", ngram_max=1, ngram_min=1, ngram_cache_tokens=50,
                                       verify_policy="fixed", linear_backend="aten", tree_budget=0))
    with pytest.raises(ConfigError, match="SpeculativeConfig.copy_bonus must be in 0..10000"):
        build_engine(SpeculativeConfig(target="random:llama", drafter="random", mode="dspine",
                                       proposer="hybrid", copy_bonus=1e39, verify_policy="fixed",
                                       linear_backend="aten", tree_budget=0))


def test_cost_controller_prices_cache_copies_apart_from_prompt_lookup():
    """The n-gram proposer with a cache plans two sources; the cost controller must keep an
    estimate for each (a run of rejected prompt-lookup copies must not stop it from trying
    the long copies of an earlier answer, which are right far more often)."""
    from dspine.control.cost_curve import CostCurve
    from dspine.control.per_source import PerSourcePolicy

    curve = CostCurve([1e-3 * (1 + 0.1 * n) for n in range(16)], draft_s=0.0)
    with_cache = make_proposer("ngram", None, cache_tokens=256)
    assert with_cache.sources == ["ngram", "cache"]
    pol = make_policy("cost", proposer=with_cache, cost=curve)
    assert isinstance(pol, PerSourcePolicy) and set(pol.policies) == {"ngram", "cache"}
    ngram, cached = pol.policies["ngram"], pol.policies["cache"]
    for _ in range(40):  # prompt-lookup copies keep failing ...
        ngram.pooled.update(4, 0)
    rate = lambda p: p.confidence(p.pooled, 4)[0]  # noqa: E731 (row 1's estimated acceptance)
    assert rate(ngram) < 0.1 and rate(cached) == pytest.approx(cached.prior_accept)  # ... the cache's is untouched
    alone = make_proposer("ngram", None)
    assert alone.sources == ["ngram"] and not isinstance(make_policy("cost", proposer=alone, cost=curve), PerSourcePolicy)


# -- greedy equality on the real target --------------------------------------------------------------
M_REAL = 24


@pytest.fixture(scope="module")
def shipped_dspine(smol):
    from dspine.build import default_drafter_path

    return load_drafter(default_drafter_path("smollm2-135m", "dspine"), smol)


@pytest.mark.slow  # the output cache is opt-in; its distribution tests stay in the default suite
@pytest.mark.parametrize("name", ["hybrid", "ngram"])
def test_greedy_equals_ar_with_cache_real_target(smol, shipped_dspine, name):
    from dspine.control.cost_curve import CostCurve

    prop = make_proposer(name, DrafterProposer(shipped_dspine), cache_tokens=4096)
    cache = output_cache_of(prop)
    # a fixed cost curve (verification cheap, as on most CPUs): whether copies are tried must
    # not depend on a cost measurement taken while the machine is busy
    pol = make_policy("cost", smol, prop, cost=CostCurve([4e-3 * (1 + 0.1 * n) for n in range(16)], draft_s=2e-3))
    eng = Engine(smol, prop, "dspine", verify_policy=pol)
    cache.add("", [random.Random(1).randrange(smol.vocab_size) for _ in range(500)])  # unrelated text
    prompts = [smol.encode_prompt(t, chat=True) for t in
               ("Write a Python function that reverses a string.", "Name three prime numbers.")]
    saved = smol.eos_token_ids
    smol.eos_token_ids = frozenset()
    try:
        first = [eng.generate(ids, SamplingConfig(), M_REAL) for ids in prompts]
        again = eng.generate(prompts[0], SamplingConfig(), M_REAL)  # the cache now holds the answer
        other = eng.generate(prompts[0], SamplingConfig(), M_REAL, tenant="someone else")
    finally:
        smol.eos_token_ids = saved
    for ids, r in zip(prompts, first):
        assert r.token_ids == ar_continuation(smol, ids, M_REAL)
    assert again.token_ids == first[0].token_ids and other.token_ids == first[0].token_ids
    assert again.stats.sources["cache"]["accepted"] > 0, again.stats.sources  # copies of the earlier answer
    assert "cache" not in other.stats.sources, other.stats.sources  # another tenant: none of them
    if name == "hybrid":
        assert set(pol.policies) == {"draft", "ngram", "ngram1", "cache"}


def test_batched_engine_fills_and_reads_the_cache(smol, shipped_dspine):
    prop = make_proposer("hybrid", DrafterProposer(shipped_dspine), cache_tokens=4096)
    be = BatchEngine(Engine(smol, prop, "dspine", verify_policy=make_policy("cost", smol, prop)), max_running=2)
    ids = smol.encode_prompt("List three colors.", chat=True)
    saved = smol.eos_token_ids
    smol.eos_token_ids = frozenset()
    try:
        a = be.generate_many([ids], SamplingConfig(), 24)[0]
        b, c = be.generate_many([ids, ids], SamplingConfig(), 24)
    finally:
        smol.eos_token_ids = saved
    ref = ar_continuation(smol, ids, 24)
    assert a.token_ids == ref and b.token_ids == ref and c.token_ids == ref
    assert b.stats.sources["cache"]["accepted"] > 0, b.stats.sources
    assert output_cache_of(prop).stats()["entries"] == 3


# -- exact distribution (tiny random target) ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny8():
    from dspine.target.adapter import load_target

    t = load_target("random:llama", vocab_size=8, seed=0)
    t.eos_token_ids = frozenset()
    return t


PROMPT = [5, 6, 7]  # no repeats: copies come from the cache, the request's own text rarely matches
M = 5


@pytest.fixture(scope="module")
def exact(tiny8):
    return exact_distribution(tiny8, PROMPT, M, SamplingConfig(**SAMPLING))


def _filled_cache() -> OutputCache:
    rng = random.Random(3)
    c = OutputCache(2000, 3, min_match=2)
    for _ in range(6):  # earlier "outputs": every 2-3-gram of the vocabulary occurs
        c.add("", [rng.randrange(8) for _ in range(150)])
    return c


def chi_square(engine: Engine, exact: dict, n_samples: int):
    """``test_policy.sources_chi_square`` of PROMPT, M tokens."""
    return sources_chi_square(engine, PROMPT, M, exact, n_samples)


class FrozenCacheNgram(NgramProposer):
    """The copy proposer over a cache that does not grow during the test (``finish`` off),
    so every sample sees the same cache and the samples are i.i.d."""

    def finish(self, state, prompt_ids, out_ids, reason):
        pass


def test_distribution_cache_copies(tiny8, exact):
    eng = Engine(tiny8, FrozenCacheNgram(4, max_ngram=3, min_match=1, cache=_filled_cache()), "dspine")
    p, impossible, used = chi_square(eng, exact, 400)
    assert impossible == 0
    assert p > 1e-3, p
    assert used["cache"] > 200, used  # the cache's copies really were verified


class WrongQCacheNgram(FrozenCacheNgram):
    """BROKEN: reports q = 0.1 for the cache's copies (as if drawn from continuation
    frequencies) although they are deterministic (q = 1)."""

    def propose(self, state, anchor, anchor_pos, n, sampling, gen):
        p = super().propose(state, anchor, anchor_pos, n, sampling, gen)
        if p.source == "cache":
            p.q_probs = p.q_probs * 0.1
        return p


def test_distribution_cache_wrong_q_fails(tiny8, exact):
    """Negative control: the chi-square test must reject cache copies verified with a wrong q."""
    eng = Engine(tiny8, WrongQCacheNgram(4, max_ngram=3, min_match=1, cache=_filled_cache()), "dspine")
    p, _, used = chi_square(eng, exact, 600)
    assert used["cache"] > 300, used
    assert p < 1e-6, p


# -- the server ----------------------------------------------------------------------------------------
def test_server_tenants_by_api_key():
    from dspine.serve import ServerThread, create_app
    from dspine.target.adapter import load_target

    target = load_target("random:llama")
    prop = make_proposer("hybrid", DrafterProposer(random_drafter(target, "dspine", seed=0)), cache_tokens=10_000)
    cache = output_cache_of(prop)
    app = create_app(BatchEngine(Engine(target, prop, "dspine"), 4), "m", max_queue=4)
    body = {"prompt": "hello hello world", "max_tokens": 20, "temperature": 0}
    ref = Engine(target, None, "ar").generate(target.encode_prompt("hello hello world"), SamplingConfig(), 20)
    with ServerThread(app) as srv:
        def ask(key):
            r = httpx.post(f"{srv.url}/v1/completions", json={**body, "return_token_ids": True},
                           headers={"Authorization": f"Bearer {key}"}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        assert ask("key-A") == ref.token_ids
        hits = cache.stats()["hits"]
        assert ask("key-B") == ref.token_ids
        assert cache.stats()["hits"] == hits  # B never matched A's output
        assert ask("key-A") == ref.token_ids
        assert cache.stats()["hits"] > hits  # A's repeat did
        h = httpx.get(f"{srv.url}/health").json()
        assert h["ngram_cache"]["scope"] == "key" and h["ngram_cache"]["tenants"] == 2
        assert h["ngram_cache"]["entries"] == 3
        prom = httpx.get(f"{srv.url}/metrics").text
        assert "dspine_ngram_cache_entries 3.0" in prom and "dspine_ngram_cache_hits_total" in prom
    with pytest.raises(ValueError, match="--ngram-cache-scope"):
        create_app(BatchEngine(Engine(target, prop, "dspine"), 1), "m", cache_scope="everyone")
