"""Losslessness with the *trained* drafters that the defaults ship.

The core greedy-equality and distribution tests (test_greedy_equality.py,
test_distribution.py) use random and oracle drafters on which acceptance is
controlled; here the same properties are checked with the shipped checkpoints
``src/dspine/checkpoints/smollm2-135m-{dspine,dflash,dflash-engine}`` on the real default
target (``dflash-engine``: the engine-compatible DFlash-style drafter):

* greedy output equals the plain ``ar`` loop token for token, and the trained drafter
  really gets proposals accepted (so the accept path ran, not only corrections);
* sampled output (temperature 1, top-k 3) of DSpine's final-stage chain (sparse,
  conditional q) follows the target's exact distribution of the first three tokens,
  enumerated from the target's logits (Pearson chi-square, ALPHA as in
  test_distribution); the same test rejects a verifier that accepts every draft token
  inside the target's filtered support instead of testing u < p/q (negative control).
  (A verifier drawing corrections from p instead of the residual max(0, p - q) is
  rejected by test_distribution's controlled drafters; with this trained drafter on this
  prompt it shifts the first three tokens too little to be detected at N = 800.)
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import dspine.core.verify
from conftest import ar_continuation
from dspine.core.batch import BatchEngine
from dspine.build import default_drafter_path
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import load_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.core.sampling import filter_probs
from dspine.core.sampling import sample_index, uniform
from dspine.core.verify import Verdict
from test_distribution import ALPHA, _check_filter_margin, chi2_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY_PROMPTS = {
    "chat_code": ("Write a Python function that reverses a string.", True),
    "raw_code": ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', False),
}
M_GREEDY = 32
SAMPLE_PROMPT = "def is_prime(n):\n"  # raw code completion; first tokens have spread at top-k 3
CFG = SamplingConfig(temperature=1.0, top_k=3)
N = 800
N_NEG = 800


@pytest.fixture(scope="module")
def shipped(smol):
    out = {}
    for mode in ("dspine", "dflash", "dflash-engine"):
        path = default_drafter_path("smollm2-135m", mode)
        assert path is not None and (path / "model.safetensors").is_file(), f"no shipped {mode} drafter"
        out[mode] = DrafterProposer(load_drafter(path, smol))
    return out


@pytest.mark.parametrize("mode", ["dspine", pytest.param("dflash", marks=pytest.mark.slow),  # suite time;
                                  "dflash-engine"])  # the DFlash-style path runs through dflash-engine
def test_shipped_drafter_greedy_equals_ar(smol, shipped, mode):
    eng = Engine(smol, shipped[mode], shipped[mode].drafter.cfg.mode)
    accepted = 0
    for text, chat in GREEDY_PROMPTS.values():
        ids = smol.encode_prompt(text, chat=chat)
        res = eng.generate(ids, SamplingConfig(), M_GREEDY)
        assert res.token_ids == ar_continuation(smol, ids, M_GREEDY)[:len(res.token_ids)]
        assert len(res.token_ids) == M_GREEDY or res.finish_reason == "stop"
        accepted += round(res.stats.accepted_length_mean * res.stats.cycles) - res.stats.cycles
    assert accepted > 0, f"the trained {mode} drafter had no proposal accepted on either prompt"


def exact_first_three(target, prompt: list[int], cfg: SamplingConfig) -> dict[tuple[int, int, int], float]:
    """P[y1, y2, y3] of the plain sampler over its support (top-k keeps it small)."""
    def probs(prefixes):
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        logits = target.forward(ids, None, None).logits[:, -1].double()  # [n, V]
        _check_filter_margin(logits, cfg)
        return filter_probs(logits, cfg)

    p1 = probs([()])[0]
    s1 = p1.nonzero().flatten().tolist()
    p2 = probs([(a,) for a in s1])
    pairs = [(a, b) for i, a in enumerate(s1) for b in p2[i].nonzero().flatten().tolist()]
    p3 = probs(pairs)
    P = {}
    for j, (a, b) in enumerate(pairs):
        pab = float(p1[a]) * float(p2[s1.index(a), b])
        for c in p3[j].nonzero().flatten().tolist():
            P[(a, b, c)] = pab * float(p3[j, c])
    assert abs(sum(P.values()) - 1.0) < 1e-9
    return P


def _counts(eng: Engine, prompt: list[int], n: int, cells: list) -> np.ndarray:
    """Counts per cell (last entry: outputs outside the exact support).

    Runs seeds 0..n-1 through the batched engine (8 requests per target forward, the
    serving path; float32 batched == single is tested in test_batch), 4 tokens each: the
    first from the prefill, then a cycle drafting n = 2 (the chain's conditional row 2).
    """
    where = {c: i for i, c in enumerate(cells)}
    counts = np.zeros(len(cells) + 1, dtype=np.int64)
    results = BatchEngine(eng, 8).generate_many([prompt] * n, [replace(CFG, seed=s) for s in range(n)], 4)
    for res in results:
        assert len(res.token_ids) == 4 or res.finish_reason == "stop"
        counts[where.get(tuple(res.token_ids[:3]), len(cells))] += 1
    return counts


def _patch_verify(monkeypatch, fn) -> None:
    monkeypatch.setattr(dspine.core.verify, "verify", fn)  # behind verify_proposal, every engine


@pytest.fixture(scope="module")
def exact(smol):
    prompt = smol.encode_prompt(SAMPLE_PROMPT, chat=False)
    P = exact_first_three(smol, prompt, CFG)
    cells = sorted(P)
    return prompt, cells, np.array([P[c] for c in cells] + [0.0])


@pytest.mark.slow  # ~3 min on an AVX2-only 2-core CPU (with its negative control below); the default
# suite keeps the enumeration tests of tests/test_distribution.py, test_runtime.py and test_dense_runtime.py
def test_shipped_dspine_sampling_matches_target(smol, shipped, exact, monkeypatch):
    prompt, cells, P = exact
    seen = {"accepted": 0, "rejected": 0}
    real_verify = dspine.core.verify.verify

    def recording_verify(tokens, q_probs, q_ids, logits, sampling, gen):
        v = real_verify(tokens, q_probs, q_ids, logits, sampling, gen)
        seen["accepted"] += v.accepted
        seen["rejected"] += int(v.accepted < tokens.shape[0])
        return v

    _patch_verify(monkeypatch, recording_verify)
    counts = _counts(Engine(smol, shipped["dspine"], "dspine"), prompt, N, cells)
    pv = chi2_pvalue(counts, P)
    assert pv > ALPHA, f"shipped DSpine drafter, top-k 3: chi-square p-value {pv:.2e} <= {ALPHA}"
    # both paths ran: accepted drafts of the trained chain, and residual corrections
    assert seen["accepted"] > N // 20 and seen["rejected"] > N // 20, seen


def _verify_support_only(tokens, q_probs, q_ids, logits, sampling, gen):
    """BROKEN verifier: accepts every draft token the target's filtered p allows (a
    support check instead of the ratio test u < p/q), then corrects from p."""
    p = filter_probs(logits, sampling)
    n = tokens.shape[0]
    for i in range(n):
        if float(p[i, int(tokens[i])]) <= 0.0:
            return Verdict(i, sample_index(p[i], uniform(gen)))
    return Verdict(n, sample_index(p[n], uniform(gen)))


@pytest.mark.slow  # ~3.5 min on an AVX2-only 2-core CPU; the enumeration negative controls of
# tests/test_distribution.py and tests/test_runtime.py stay in the default suite
def test_shipped_dspine_negative_control(smol, shipped, exact, monkeypatch):
    prompt, cells, P = exact
    _patch_verify(monkeypatch, _verify_support_only)
    counts = _counts(Engine(smol, shipped["dspine"], "dspine"), prompt, N_NEG, cells)
    pv = chi2_pvalue(counts, P)
    assert pv < ALPHA, f"broken verifier not detected with the shipped drafter (p-value {pv:.3g})"


def test_exact_support_is_spread(exact):
    """The test distribution is not a point mass (else the chi-square test is vacuous)."""
    _, cells, P = exact
    assert len(cells) >= 9 and P.max() < 0.8
