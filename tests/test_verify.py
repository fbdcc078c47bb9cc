"""Verifier and sampler unit tests (spec section 5), no model needed.

* sparse q (K candidates) and the equivalent dense q (scattered into V zeros) give
  identical decisions, corrections and generator consumption for the same draws;
* a target token outside the candidate set can be emitted as a correction;
* one verification step emits a token distributed exactly as p (the speculative
  sampling lemma), for sparse and dense q;
* ``filter_probs`` against straightforward reference implementations (ours in plain
  Python, and Hugging Face's logits warpers), including top-k ties, the top-p
  boundary and min-p;
* the plain sampler draws with probability p (chi-square) and never picks a
  zero-probability entry.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from scipy import stats

from dspine.config import SamplingConfig
from dspine.core.sampling import filter_probs, make_generator, sample_index, sample_token, uniform
from dspine.core.verify import Verdict, verify, verify_greedy, verify_sampling

ALPHA = 1e-3

pytestmark = pytest.mark.usefixtures("one_thread")


def _random_cfg(rng: random.Random, V: int) -> SamplingConfig:
    return SamplingConfig(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.6]),
        top_k=rng.choice([0, 0, 1, 2, max(1, V // 2), V, V + 3]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.8, 0.5, 0.2]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.2, 0.5]),
    )


# -- sparse q == dense q -----------------------------------------------------------------------

def test_sparse_and_dense_q_identical_decisions():
    rng = random.Random(1234)
    outcomes = {"accept_all": 0, "reject": 0, "outside": 0}
    for case in range(400):
        V = rng.randint(2, 40)
        n = rng.choice([1, 1, 2, 3, 6])
        K = rng.randint(1, min(V, 16))
        cfg = _random_cfg(rng, V)
        g = torch.Generator().manual_seed(case)
        logits = torch.randn(n + 1, V, generator=g) * rng.choice([0.5, 2.0, 5.0])  # target
        q_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n)])  # [n, K]
        q_logits = torch.randn(n, K, generator=g) * 2.0
        q_cfg = _random_cfg(rng, K)
        q_probs = filter_probs(q_logits, q_cfg)  # [n, K] with zeros where filtered
        dense = torch.zeros(n, V, dtype=torch.float64).scatter(1, q_ids, q_probs)
        # proposals: drawn from q (mostly) or arbitrary tokens (may lie outside S)
        toks = []
        for i in range(n):
            if rng.random() < 0.8:
                toks.append(int(q_ids[i, sample_index(q_probs[i], rng.random())]))
            else:
                toks.append(rng.randrange(V))
        tokens = torch.tensor(toks)
        g_sparse, g_dense = make_generator(case), make_generator(case)
        v_sparse = verify(tokens, q_probs, q_ids, logits, cfg, g_sparse)
        v_dense = verify(tokens, dense, None, logits, cfg, g_dense)
        assert v_sparse == v_dense, (case, cfg)
        # both consumed the same number of uniforms
        assert uniform(g_sparse) == uniform(g_dense)
        # the emitted token is always allowed by the filtered target distribution
        p = filter_probs(logits, cfg)
        assert float(p[v_sparse.accepted, v_sparse.token]) > 0.0
        if v_sparse.accepted == n:
            outcomes["accept_all"] += 1
        else:
            outcomes["reject"] += 1
            outcomes["outside"] += int(v_sparse.token not in q_ids[v_sparse.accepted].tolist())
    # the loop exercised every path
    assert min(outcomes.values()) >= 15, outcomes


def test_lazy_row_filtering_equals_filtering_all_rows():
    """verify_sampling filters p_i only when it examines position i; the verdicts and the
    uniforms consumed equal those with all rows filtered up front (the p= argument), on a
    vocabulary large enough for the partial-sort top-p path."""
    from dspine.core.verify import verify_sampling

    rng = random.Random(7)
    seen = set()
    for case in range(60):
        V, n = 3000, rng.choice([1, 4, 15])
        cfg = SamplingConfig(temperature=rng.choice([0.5, 1.0]), top_p=rng.choice([1.0, 0.9, 0.95]),
                             top_k=rng.choice([0, 0, 40]), min_p=rng.choice([0.0, 0.05]))
        g = torch.Generator().manual_seed(case)
        logits = torch.randn(n + 1, V, generator=g) * 4.0
        full = filter_probs(logits, cfg)  # [n+1, V]
        assert all(torch.equal(filter_probs(logits[i], cfg), full[i]) for i in range(n + 1))  # bitwise
        q = filter_probs(logits[:n] + torch.randn(n, V, generator=g), cfg)  # a drafter's dense q
        tokens = torch.tensor([sample_index(q[i], rng.random()) for i in range(n)])
        g1, g2 = make_generator(case), make_generator(case)
        lazy = verify_sampling(tokens, q, None, logits, cfg, g1)
        eager = verify_sampling(tokens, q, None, logits, cfg, g2, p=full)
        assert lazy == eager, case
        assert uniform(g1) == uniform(g2)
        seen.add(lazy.accepted == n)
    assert seen == {True, False}  # both the bonus and the correction path ran


def test_uniform_consumption_order():
    """One uniform per examined position, then one for the correction or bonus."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0, 0.0, 0.0]] * 4)
    cfg = SamplingConfig(temperature=1.0)
    p = filter_probs(logits, cfg)
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]] * 3, dtype=torch.float64)  # point mass on 1
    tokens = torch.tensor([1, 1, 1])
    seen = set()
    for seed in range(60):
        g = make_generator(seed)
        v = verify_sampling(tokens, q, None, logits, cfg, g)
        seen.add(v.accepted)
        used = 4 if v.accepted == 3 else v.accepted + 2
        ref = make_generator(seed)
        us = [uniform(ref) for _ in range(used + 1)]
        # accepted positions drew u < p/q = p(1); the first rejected one did not
        assert all(u < float(p[0, 1]) for u in us[: v.accepted])
        if v.accepted < 3:
            assert us[v.accepted] >= float(p[0, 1])
            res = (p[v.accepted] - q[v.accepted]).clamp_min(0)
            assert v.token == sample_index(res, us[v.accepted + 1]) and v.token != 1
        else:
            assert v.token == sample_index(p[3], us[3])
        assert uniform(g) == us[used]  # nothing else was drawn
    assert seen == {0, 1, 2, 3}


def test_correction_outside_candidate_set():
    """p concentrated outside S: the correction is that token, with the exact probability."""
    V = 10
    S = torch.tensor([[0, 1, 2, 3]])
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1]], dtype=torch.float64)
    p_target = torch.tensor([0.02, 0.01, 0.01, 0.01, 0.0, 0.0, 0.0, 0.9, 0.0, 0.05], dtype=torch.float64)
    logits = torch.log(p_target).expand(2, V).clone().float()
    cfg = SamplingConfig(temperature=1.0)
    p = filter_probs(logits, cfg)[0]
    tokens = torch.tensor([0])  # the drafter's top candidate
    emitted = [verify(tokens, q, S, logits, cfg, make_generator(s)) for s in range(2000)]
    acc = sum(v.accepted for v in emitted)
    # accept with probability p(0) / q(0); otherwise the residual max(0, p - q) / Z
    pa = float(p[0]) / 0.4
    assert abs(acc / 2000 - pa) < 4 * math.sqrt(pa * (1 - pa) / 2000)
    res = (p - torch.zeros(V, dtype=torch.float64).scatter(0, S[0], q[0])).clamp_min(0)
    res = res / res.sum()
    corr = [v.token for v in emitted if v.accepted == 0]
    assert set(corr) <= {7, 9}  # exactly the tokens with p > q
    f7 = corr.count(7) / len(corr)
    assert abs(f7 - float(res[7])) < 4 * math.sqrt(float(res[7] * (1 - res[7])) / len(corr))
    assert corr.count(9) > 0  # also a low-probability token outside S


@pytest.mark.parametrize("sparse", [True, False])
def test_one_step_output_is_distributed_as_p(sparse):
    """y ~ q, then verify: the emitted token (y or the correction) is distributed as p."""
    V, trials = 7, 8000
    cfg = SamplingConfig(temperature=0.8, top_k=5)
    logits = torch.tensor([[2.0, 1.5, 0.2, -1.0, 0.7, 1.9, -0.5]] * 2)
    p = filter_probs(logits, cfg)[0].numpy()
    ids = torch.tensor([[0, 3, 6]])  # candidates: one likely, two unlikely/filtered for p
    q = torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float64)
    dense = torch.zeros(1, V, dtype=torch.float64).scatter(1, ids, q)
    P = filter_probs(logits, cfg)
    g = make_generator(7)
    counts = np.zeros(V)
    for _ in range(trials):
        y = int(ids[0, sample_index(q[0], uniform(g))])
        v = verify_sampling(torch.tensor([y]), q if sparse else dense, ids if sparse else None, logits, cfg,
                            g, p=P)
        counts[y if v.accepted == 1 else v.token] += 1
    assert counts[p == 0].sum() == 0
    keep = p > 0
    pv = stats.chisquare(counts[keep], trials * p[keep]).pvalue
    assert pv > ALPHA, pv


def test_verify_greedy():
    logits = torch.zeros(4, 5)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = logits[3, 3] = 1.0
    assert verify_greedy(torch.tensor([2, 4, 1]), logits) == Verdict(3, 3)  # bonus
    assert verify_greedy(torch.tensor([2, 4, 0]), logits) == Verdict(2, 1)  # correction
    assert verify_greedy(torch.tensor([0, 4, 1]), logits) == Verdict(0, 2)
    assert verify(torch.tensor([2, 0, 1]), None, None, logits, SamplingConfig(), None) == Verdict(1, 4)
    with pytest.raises(ValueError):
        verify(torch.tensor([2]), None, None, logits[:2], SamplingConfig(temperature=1.0), None)


# -- filter_probs against references -----------------------------------------------------------

def ref_filter(logits: list[float], cfg: SamplingConfig) -> list[float]:
    """Plain-Python reference: temperature -> top-k (ties kept) -> top-p (smallest prefix of
    the descending order, ties by index, whose mass reaches top_p) -> min-p."""
    n = len(logits)
    x = [l / cfg.temperature for l in logits]
    keep = [True] * n
    if 0 < cfg.top_k < n:
        kth = sorted(x, reverse=True)[cfg.top_k - 1]
        keep = [xi >= kth for xi in x]
    m = max(x[i] for i in range(n) if keep[i])
    e = [math.exp(x[i] - m) if keep[i] else 0.0 for i in range(n)]
    p = [v / sum(e) for v in e]
    if cfg.top_p < 1.0:
        order = sorted(range(n), key=lambda i: (-p[i], i))
        cum, kept = 0.0, set()
        for i in order:
            if cum >= cfg.top_p:
                break
            kept.add(i)
            cum += p[i]
        p = [p[i] if i in kept else 0.0 for i in range(n)]
        p = [v / sum(p) for v in p]
    if cfg.min_p > 0.0:
        top = max(p)
        p = [v if v >= cfg.min_p * top else 0.0 for v in p]
        p = [v / sum(p) for v in p]
    return p


def hf_filter(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Hugging Face's warpers in generate()'s order (temperature, top-k, top-p, min-p)."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    s = logits[None].double()
    s = TemperatureLogitsWarper(cfg.temperature)(None, s)
    if cfg.top_k:
        s = TopKLogitsWarper(cfg.top_k)(None, s)
    if cfg.top_p < 1.0:
        s = TopPLogitsWarper(cfg.top_p)(None, s)
    if cfg.min_p > 0.0:
        s = MinPLogitsWarper(cfg.min_p)(None, s)
    return torch.softmax(s, -1)[0]


def test_filter_probs_matches_references_random():
    rng = random.Random(5)
    g = torch.Generator().manual_seed(5)
    for case in range(300):
        V = rng.randint(1, 30)
        cfg = _random_cfg(rng, V)
        logits = torch.randn(V, generator=g, dtype=torch.float64) * rng.choice([0.5, 2.0, 6.0])
        ours = filter_probs(logits, cfg)
        ref = torch.tensor(ref_filter(logits.tolist(), cfg), dtype=torch.float64)
        assert torch.equal(ours > 0, ref > 0), (case, cfg)
        assert torch.allclose(ours, ref, atol=1e-12), (case, cfg)
        assert abs(float(ours.sum()) - 1.0) < 1e-12
        hf = hf_filter(logits, cfg)
        assert torch.equal(ours > 0, hf > 0), (case, cfg)
        assert torch.allclose(ours, hf, atol=1e-9), (case, cfg)
    # batched rows are filtered independently, like single rows
    L = torch.randn(5, 9, generator=g)
    cfg = SamplingConfig(temperature=0.9, top_k=6, top_p=0.7, min_p=0.1)
    assert torch.equal(filter_probs(L, cfg), torch.stack([filter_probs(r, cfg) for r in L]))


@pytest.mark.parametrize("temperature", [5e-324, 1e-320, 2e-308, 1e-12])
def test_tiny_temperature_is_the_argmax_limit(temperature):
    """A tiny positive temperature used to overflow logits/T to +-inf and give NaN (a crash
    in the sampler, and in a batched server cycle for every request): the limit is the
    argmax, split evenly over exact ties."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5], [0.5, 4.0, 4.0, -1.0]])
    for kw in ({}, {"top_p": 0.9}, {"top_k": 2, "min_p": 0.2}):
        p = filter_probs(logits, SamplingConfig(temperature=temperature, **kw))
        assert torch.equal(p, torch.tensor([[0, 1.0, 0, 0], [0, 0.5, 0.5, 0]], dtype=torch.float64)), kw
    g = make_generator(0)
    assert sample_token(logits[0], SamplingConfig(temperature=temperature), g) == 1
    assert {sample_token(logits[1], SamplingConfig(temperature=temperature), g) for _ in range(40)} == {1, 2}


def _sorted_top_p_keep(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference nucleus mask: full stable descending sort (the implementation before
    the partial sort)."""
    sp, idx = torch.sort(p, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sp, dim=-1) - sp
    return torch.zeros_like(sp, dtype=torch.bool).scatter(-1, idx, before < top_p)


@pytest.mark.parametrize("first", [1, 3, 1024])
def test_partial_sort_top_p_equals_full_sort(first):
    """top_p_keep sorts only the top values (growing x8): same set as the full stable sort,
    boundary ties included, from small vocabularies to a 49k one with many exact ties."""
    from dspine.core.sampling import top_p_keep

    rng = random.Random(first)
    g = torch.Generator().manual_seed(first)
    for case in range(200):
        V = rng.choice([1, 2, 5, 17, 64, 300])
        z = torch.randn(3, V, generator=g, dtype=torch.float64) * rng.choice([0.5, 2.0, 6.0])
        if case % 2:
            z = torch.round(z)  # many exact ties
        prob = torch.softmax(z, -1)
        tp = rng.choice([0.05, 0.3, 0.5, 0.9, 0.95, 0.999])
        assert torch.equal(top_p_keep(prob, tp, first), _sorted_top_p_keep(prob, tp)), (case, V, tp)
    z = torch.round(torch.randn(4, 49152, generator=g, dtype=torch.float64) * 3)  # ties at every value
    for T in (0.3, 1.0, 3.0):
        prob = torch.softmax(z / T, -1)
        for tp in (0.5, 0.9, 0.95):
            assert torch.equal(top_p_keep(prob, tp, first), _sorted_top_p_keep(prob, tp)), (T, tp)


def test_top_k_keeps_ties():
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, 0.0])
    for k, support in [(1, {1, 2, 4}), (2, {1, 2, 4}), (3, {1, 2, 4}), (4, {1, 2, 3, 4}), (6, set(range(6)))]:
        p = filter_probs(logits, SamplingConfig(temperature=1.0, top_k=k))
        assert set(torch.nonzero(p).flatten().tolist()) == support, k
        assert float(p[1]) == float(p[2]) == float(p[4])
        ref = ref_filter(logits.tolist(), SamplingConfig(temperature=1.0, top_k=k))
        assert torch.allclose(p, torch.tensor(ref, dtype=torch.float64), atol=1e-15)


def test_top_p_boundary():
    # equal logits: every probability is exactly 1/4, so the cumulative masses are exact
    flat = torch.zeros(4)

    def support(logits, top_p):
        p = filter_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p))
        assert abs(float(p.sum()) - 1.0) < 1e-15
        return set(torch.nonzero(p).flatten().tolist())

    assert support(flat, 0.25) == {0}  # the mass exactly reaching top_p ends the prefix
    assert support(flat, 0.5) == {0, 1}  # ties are taken in index order
    assert support(flat, 0.5 + 1e-12) == {0, 1, 2}
    assert support(flat, 0.75) == {0, 1, 2}
    assert support(flat, 1.0) == {0, 1, 2, 3}
    assert filter_probs(flat, SamplingConfig(temperature=1.0, top_p=0.5)).tolist() == [0.5, 0.5, 0.0, 0.0]
    # probabilities ~ 1/8, 1/2, 1/8, 1/4 (not exactly representable after softmax: test off-boundary)
    logits = torch.log(torch.tensor([0.125, 0.5, 0.125, 0.25], dtype=torch.float64))
    assert support(logits, 0.1) == {1}  # the top token is always kept
    assert support(logits, 0.5 - 1e-9) == {1}
    assert support(logits, 0.5 + 1e-9) == {1, 3}
    assert support(logits, 0.75 - 1e-9) == {1, 3}
    assert support(logits, 0.75 + 1e-9) == {0, 1, 3}  # tie 1/8 vs 1/8: the lower index first
    assert support(logits, 0.99) == {0, 1, 2, 3}
    p = filter_probs(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([0.0, 2 / 3, 0.0, 1 / 3], dtype=torch.float64), atol=1e-15)


def test_min_p():
    probs = torch.tensor([0.1, 0.5, 0.025, 0.25, 0.125], dtype=torch.float64)
    logits = torch.log(probs)
    for min_p, support in [(0.25, {1, 3, 4}), (0.2, {0, 1, 3, 4}), (0.6, {1}), (0.04, {0, 1, 2, 3, 4})]:
        p = filter_probs(logits, SamplingConfig(temperature=1.0, min_p=min_p))
        assert set(torch.nonzero(p).flatten().tolist()) == support, min_p
        kept = probs * (p > 0)
        assert torch.allclose(p, kept / kept.sum(), atol=1e-15)


def test_min_p_boundary_is_kept():
    """min-p keeps p >= min_p * max p (the boundary itself is kept, as in HF's MinP)."""
    logits = torch.log(torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64))
    full = filter_probs(logits, SamplingConfig(temperature=1.0))
    if not (float(full[1]) == 0.5 * float(full[0]) and float(full[2]) == 0.25 * float(full[0])):
        pytest.skip("softmax not exact on this platform")
    p = filter_probs(logits, SamplingConfig(temperature=1.0, min_p=0.5))
    assert torch.nonzero(p).flatten().tolist() == [0, 1]
    p = filter_probs(logits, SamplingConfig(temperature=1.0, min_p=0.25))
    assert torch.nonzero(p).flatten().tolist() == [0, 1, 2]


def test_filter_order_top_k_before_top_p():
    """top-p sees the distribution renormalized after top-k (temperature first)."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    cfg = SamplingConfig(temperature=0.5, top_k=2, top_p=0.8)
    p = filter_probs(logits, cfg)
    # after temperature 0.5 and top-2: p = softmax([4, 2]) = [0.881, 0.119]: 0.881 >= 0.8
    assert set(torch.nonzero(p).flatten().tolist()) == {0}
    assert torch.allclose(p, torch.tensor(ref_filter(logits.tolist(), cfg), dtype=torch.float64))
    with pytest.raises(ValueError):
        filter_probs(logits, SamplingConfig())  # greedy has no distribution


# -- the plain sampler ---------------------------------------------------------------------------

def test_sample_index_never_picks_zero_probability():
    probs = torch.tensor([0.0, 0.0, 0.3, 0.0, 0.7, 0.0], dtype=torch.float64)
    assert sample_index(probs, 0.0) == 2
    assert sample_index(probs, 0.3 - 1e-12) == 2
    assert sample_index(probs, 0.3 + 1e-12) == 4
    assert sample_index(probs, 1.0 - 1e-17) == 4
    assert sample_index(probs, 1.0) == 4  # u * total rounded up to total
    assert sample_index(probs * 3.0, 0.5) == 4  # unnormalized input
    for u in np.linspace(0.0, 1.0, 101):
        assert sample_index(probs, float(u)) in (2, 4)


def test_plain_sampler_draws_p():
    logits = torch.tensor([1.0, 0.3, -0.2, 2.2, 0.0, -3.0, 1.1])
    for cfg in (SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4, min_p=0.05)):
        p = filter_probs(logits, cfg).numpy()
        g = make_generator(3)
        n = 15000
        counts = np.bincount([sample_token(logits, cfg, g) for _ in range(n)], minlength=7)
        assert counts[p == 0].sum() == 0
        pv = stats.chisquare(counts[p > 0], n * p[p > 0]).pvalue
        assert pv > ALPHA, (cfg, pv)
    # greedy: argmax, no randomness consumed
    assert sample_token(logits, SamplingConfig(), None) == 3
    # same seed, same draws
    a = [sample_token(logits, SamplingConfig(temperature=1.0), make_generator(9)) for _ in range(3)]
    assert len(set(a)) == 1
