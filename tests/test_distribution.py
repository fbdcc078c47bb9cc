"""Sampling losslessness: speculative sampling reproduces the target's own sampler.

On the tiny random target (vocab 8, EOS off) we enumerate the exact probability of
every 3-token continuation of a fixed prompt under the plain filtered sampler
(``filter_probs`` of the target's logits after every prefix), run the engine with a
drafter for seeds 0..N-1 (4 tokens per run, so the first cycle drafts and verifies
y2, y3 as one chain; the 4th token is discarded: the marginal of the first three must
match too) and compare the empirical distribution with the exact one
by Pearson's chi-square test (cells with expected count < 5 pooled; a sample in a
zero-probability cell fails at once).

False-alarm rate: ALPHA = 1e-3 per comparison. The seeds are fixed, so each test is
deterministic on a given platform: a correct runtime passes it reproducibly, and the
broken runtimes (negative controls) must be rejected at the same ALPHA:
  * a verifier whose correction is drawn from p instead of max(0, p - q);
  * a dense drafter whose q is taken before top-k/top-p/min-p while its tokens are drawn
    after them.
Power, measured while writing these tests (in-memory mutations of the runtime): the
default tests also reject a final-stage chain that hands the verifier q_i(. | x0)
instead of q_i(. | y_{i-1}) (3 of the 4 DSpine settings), and an acceptance test
using 1.2 p/q instead of p/q (1 of 5; test_verify catches it directly). The slow
versions (N_SLOW runs, every setting for both drafters) are stronger.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

import dspine.core.verify
from conftest import OracleProposer, random_proposer
from dspine.config import SamplingConfig
from dspine.core.engine import Engine
from dspine.drafter.checkpoint import random_drafter
from dspine.proposers.base import Proposal
from dspine.proposers.drafter import DrafterProposer
from dspine.core.sampling import filter_probs, sample_index, uniform
from dspine.core.verify import Verdict, verify_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHA = 1e-3
PROMPT = [1, 2, 3, 4, 5]
LENGTH = 3  # tokens whose joint distribution is tested
GEN_LEN = 4  # tokens generated: after the prefill token, the first cycle drafts n = 2
BLOCK = 4  # (y2, y3 from one drafted chain, so the conditional rows of q are exercised)
N = 1000  # runs per default comparison (N_SLOW for the slow, stronger versions)
N_SLOW = 4000
DRAFTER_SEED = 2
N_NEG = 500  # negative controls: rejected with p ~ 1e-6 or smaller at this size

SETTINGS = {
    "t1.0": SamplingConfig(temperature=1.0),
    "t0.7_k3": SamplingConfig(temperature=0.7, top_k=3),
    "p0.8": SamplingConfig(temperature=1.0, top_p=0.8),
    "minp0.2": SamplingConfig(temperature=1.0, min_p=0.2),
}


# -- exact distribution -----------------------------------------------------------------------

def _check_filter_margin(logits: torch.Tensor, cfg: SamplingConfig, eps: float = 1e-6) -> None:
    """The filters' keep/drop decisions must not sit within ``eps`` of a boundary, so
    float noise between the batched (here) and incremental (engine) forwards cannot
    flip them (a check on the test itself)."""
    x = logits.double() / cfg.temperature
    if cfg.top_k:
        s = torch.sort(x, dim=-1, descending=True).values
        assert (s[..., cfg.top_k - 1] - s[..., cfg.top_k]).abs().min() > eps
    p = filter_probs(logits, replace(cfg, top_p=1.0, min_p=0.0))
    if cfg.top_p < 1.0:
        sp = torch.sort(p, dim=-1, descending=True).values
        assert (torch.cumsum(sp, -1) - cfg.top_p).abs().min() > eps
    if cfg.min_p > 0.0:
        p = filter_probs(logits, replace(cfg, min_p=0.0))
        ratio = p / p.max(-1, keepdim=True).values
        assert (ratio - cfg.min_p).abs().min() > eps


def exact_distribution(target, prompt: list[int], cfg: SamplingConfig) -> np.ndarray:
    """P[y1, y2, y3] under the plain sampler, by enumerating all V^2 two-token prefixes."""
    V = target.vocab_size
    y1, y2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    ids = torch.cat([torch.tensor(prompt).expand(V * V, -1), y1.reshape(-1, 1), y2.reshape(-1, 1)], 1)
    logits = target.forward(ids, None, None).logits[:, -3:].double()  # [V*V, 3, V]
    _check_filter_margin(logits, cfg)
    p = filter_probs(logits, cfg)  # [V*V, 3, V]
    p1 = p[0, 0]  # [V] (same for every row: the prompt)
    p2 = p[:, 1].reshape(V, V, V)[:, 0]  # [y1, y2]
    p3 = p[:, 2].reshape(V, V, V)  # [y1, y2, y3]
    P = p1[:, None, None] * p2[:, :, None] * p3
    assert abs(float(P.sum()) - 1.0) < 1e-9
    return P.numpy()


_EXACT: dict = {}


def exact(target, name):
    if name not in _EXACT:
        _EXACT[name] = exact_distribution(target, PROMPT, SETTINGS[name])
    return _EXACT[name]


def sample_counts(engine: Engine, cfg: SamplingConfig, n: int, V: int) -> np.ndarray:
    counts = np.zeros((V,) * LENGTH, dtype=np.int64)
    for s in range(n):
        res = engine.generate(PROMPT, replace(cfg, seed=s), GEN_LEN)
        assert len(res.token_ids) == GEN_LEN
        counts[tuple(res.token_ids[:LENGTH])] += 1
    return counts


def chi2_pvalue(counts: np.ndarray, P: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of ``counts`` against probabilities ``P``.

    A count in a cell of exact probability 0 gives p-value 0 (impossible output).
    """
    n = counts.sum()
    counts, P = counts.reshape(-1), P.reshape(-1)
    if counts[P <= 0].sum() > 0:
        return 0.0
    exp = n * P
    big = exp >= min_expected
    obs_b = list(counts[big]) + [counts[~big & (P > 0)].sum()]
    exp_b = list(exp[big]) + [exp[~big & (P > 0)].sum()]
    if exp_b[-1] == 0:
        obs_b, exp_b = obs_b[:-1], exp_b[:-1]
    assert len(obs_b) >= 3
    return float(stats.chisquare(np.array(obs_b, float), np.array(exp_b, float)).pvalue)


BRIDGE_GAIN = 40.0


def strong_bridge_drafter(tiny, seed: int, msg_dim: int | None = None, **proposer_kwargs):
    """The real DSpine random drafter, sparse q over K=4 of 8 tokens (coarse pool 6), with
    the bridge's value and write projections scaled by BRIDGE_GAIN each. Untrained
    bridge weights (std 0.02) make q_i(. | y_{i-1}) almost independent of the
    predecessor; amplified, the conditional rows of the final stage differ strongly,
    so a chain that pairs a token with the wrong conditional q is detected.
    ``msg_dim``: the bridge's message size (32 lets every linear pack into Q8_0 blocks);
    ``proposer_kwargs`` go to :class:`DrafterProposer` (e.g. ``linears``, ``vocab``)."""
    extra = {} if msg_dim is None else {"msg_dim": msg_dim}
    d = random_drafter(tiny, mode="dspine", block_size=BLOCK, seed=seed, head_topk=4, coarse_k=6, **extra)
    with torch.no_grad():
        for w in d.write:
            w.weight.mul_(BRIDGE_GAIN)
        d.v_p.weight.mul_(BRIDGE_GAIN)
    return DrafterProposer(d, **proposer_kwargs)


def assert_exact_and_broken_verifier_fails(tiny, make_proposer, monkeypatch, setting: str = "t1.0") -> None:
    """Sampled output with ``make_proposer()`` is the target's exact distribution (chi-square,
    N runs), and the same with a verifier whose residual is p instead of norm(p - q)
    (the negative control, N_NEG runs) is rejected."""
    counts = sample_counts(Engine(tiny, make_proposer(), "dspine"), SETTINGS[setting], N, tiny.vocab_size)
    assert chi2_pvalue(counts, exact(tiny, setting)) > ALPHA
    monkeypatch.setattr(dspine.core.verify, "verify", _verify_residual_is_p)
    counts = sample_counts(Engine(tiny, make_proposer(), "dspine"), SETTINGS[setting], N_NEG, tiny.vocab_size)
    assert chi2_pvalue(counts, exact(tiny, setting)) < ALPHA


@pytest.fixture(scope="module")
def drafters(tiny):
    """(a) DSpine random drafter with sparse q (strong bridge, seed 3); (b) DFlash-style
    random drafter with dense q (seed 2).

    Seeds chosen so that proposals are accepted 20-50% of the time in every setting
    (e.g. seed 0's DSpine drafter is never accepted at top-k 3, so the accept path
    would go untested there).
    """
    return {
        "dspine": strong_bridge_drafter(tiny, seed=3),
        "dflash": random_proposer(tiny, "dflash", BLOCK, seed=DRAFTER_SEED),
    }


# -- the runtime reproduces the target distribution -------------------------------------------

# the default suite keeps plain temperature and min-p for DSpine and temperature for DFlash-style;
# top-k / top-p run in the slow variant below (with more samples) and top-p also in
# test_policy / test_trees / test_proposers (SAMPLING = top_p 0.95): suite time
DEFAULT = [("dspine", "t1.0"), ("dspine", "minp0.2"), ("dflash", "t1.0")]
SLOW = [(m, s) for m in ("dspine", "dflash") for s in SETTINGS]


def _check(tiny, drafters, mode, name, n=N):
    eng = Engine(tiny, drafters[mode], mode)
    counts = sample_counts(eng, SETTINGS[name], n, tiny.vocab_size)
    pv = chi2_pvalue(counts, exact(tiny, name))
    assert pv > ALPHA, f"{mode} {name}: chi-square p-value {pv:.2e} <= {ALPHA}"
    return eng, counts


@pytest.mark.parametrize("mode,name", DEFAULT)
def test_speculative_sampling_matches_target(tiny, drafters, monkeypatch, mode, name):
    seen = {"accepted": 0, "rejected": 0, "outside": 0, "chain": 0}
    real_verify = dspine.core.verify.verify

    def recording_verify(tokens, q_probs, q_ids, logits, sampling, gen):
        v = real_verify(tokens, q_probs, q_ids, logits, sampling, gen)
        seen["accepted"] += v.accepted
        seen["chain"] += int(v.accepted >= 2)  # a conditional row q_2(. | y_2) was accepted
        if v.accepted < tokens.shape[0]:
            seen["rejected"] += 1
            if q_ids is not None:
                seen["outside"] += int(v.token not in q_ids[v.accepted].tolist())
            else:
                seen["outside"] += int(float(q_probs[v.accepted, v.token]) == 0.0)
        return v

    monkeypatch.setattr(dspine.core.verify, "verify", recording_verify)
    _check(tiny, drafters, mode, name)
    # both paths were exercised: accepted proposals, and rejections whose correction is
    # a token the drafter's q gave probability 0 (outside the K candidates when sparse)
    assert seen["accepted"] > N // 20 and seen["rejected"] > N // 20 and seen["chain"] > N // 50, seen
    if mode == "dspine" or name != "t1.0":
        assert seen["outside"] > 0, seen


@pytest.mark.slow
@pytest.mark.parametrize("mode,name", SLOW)
def test_speculative_sampling_matches_target_slow(tiny, drafters, mode, name):
    _check(tiny, drafters, mode, name, n=N_SLOW)


def test_point_mass_proposer_matches_target(tiny):
    """A deterministic proposer (q = point mass on the greedy token) is also lossless."""
    eng = Engine(tiny, OracleProposer(tiny, PROMPT, BLOCK, horizon=8), "dspine")
    counts = sample_counts(eng, SETTINGS["t1.0"], N // 2, tiny.vocab_size)
    assert chi2_pvalue(counts, exact(tiny, "t1.0")) > ALPHA


def test_exact_distribution_is_not_degenerate(tiny):
    """The target is far from uniform and the filters bite (otherwise the negative
    controls below could not be detected)."""
    P1 = exact(tiny, "t1.0")
    assert P1.max() > 10 * P1.mean()
    for name in ("t0.7_k3", "p0.8", "minp0.2"):
        assert (exact(tiny, name) == 0).sum() > 0, name


# -- negative controls: the same test must reject broken runtimes -----------------------------

def _verify_residual_is_p(tokens, q_probs, q_ids, logits, sampling, gen):
    """BROKEN copy of verify_sampling: the correction is drawn from p, not max(0, p - q)."""
    if sampling.greedy:
        return verify_greedy(tokens, logits)
    p = filter_probs(logits, sampling)
    n = tokens.shape[0]
    for i in range(n):
        y = int(tokens[i])
        if q_ids is None:
            qy = float(q_probs[i, y])
        else:
            hit = (q_ids[i] == y).nonzero()
            qy = float(q_probs[i, int(hit[0])]) if hit.numel() else 0.0
        u = uniform(gen)
        if qy > 0.0 and u < float(p[i, y]) / qy:
            continue
        return Verdict(i, sample_index(p[i], uniform(gen)))  # BUG: residual does not subtract q
    return Verdict(n, sample_index(p[n], uniform(gen)))


class QBeforeFilteringProposer(DrafterProposer):
    """BROKEN copy of the DFlash-style dense path of DrafterProposer.propose: y is drawn
    from the filtered q, but the q handed to the verifier is taken after temperature and
    before top-k / top-p / min-p (not the distribution y was drawn from)."""

    @torch.no_grad()
    def propose(self, state, anchor, anchor_pos, n, sampling, gen):
        d = self.drafter
        kv, cpos, cvalid = state.as_batch()
        out = d.forward_blocks(torch.tensor([[anchor]]), torch.tensor([[anchor_pos]]), kv, cpos, cvalid)
        z = d.logits(out.h[0, 0, 1:n + 1]).float()  # [n, V]
        q = filter_probs(z, sampling)
        toks = torch.tensor([sample_index(q[i], uniform(gen)) for i in range(n)])
        q_before = torch.softmax(z.double() / sampling.temperature, -1)  # BUG
        return Proposal(toks, None, q_before)


@pytest.mark.parametrize("mode", ["dspine", pytest.param("dflash", marks=pytest.mark.slow)])
def test_negative_control_residual_without_q(tiny, drafters, monkeypatch, mode):
    monkeypatch.setattr(dspine.core.verify, "verify", _verify_residual_is_p)
    eng = Engine(tiny, drafters[mode], mode)
    counts = sample_counts(eng, SETTINGS["t1.0"], N_NEG, tiny.vocab_size)
    pv = chi2_pvalue(counts, exact(tiny, "t1.0"))
    assert pv < ALPHA, f"broken verifier not detected (p-value {pv:.3g})"


@pytest.mark.parametrize("name,n", [("minp0.2", N_NEG), pytest.param("p0.8", 4 * N_NEG, marks=pytest.mark.slow)])
def test_negative_control_q_before_filtering(tiny, name, n):
    broken = QBeforeFilteringProposer(random_drafter(tiny, mode="dflash", block_size=BLOCK, seed=DRAFTER_SEED))
    eng = Engine(tiny, broken, "dflash")
    counts = sample_counts(eng, SETTINGS[name], n, tiny.vocab_size)
    pv = chi2_pvalue(counts, exact(tiny, name))
    assert pv < ALPHA, f"q taken before filtering not detected (p-value {pv:.3g})"


# -- determinism ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["dspine", "dflash"])
def test_same_seed_same_output(tiny, drafters, mode):
    eng = Engine(tiny, drafters[mode], mode)
    cfg = SamplingConfig(temperature=1.0, seed=1234)
    a = [eng.generate(PROMPT, replace(cfg, seed=s), 12).token_ids for s in range(20)]
    b = [eng.generate(PROMPT, replace(cfg, seed=s), 12).token_ids for s in range(20)]
    assert a == b
    assert len({tuple(x) for x in a}) > 10  # and different seeds give different outputs


def check_exact_with_negative_control(tiny, monkeypatch) -> None:
    """The strong-bridge DSpine drafter samples ``tiny``'s exact distribution (temperature
    1, enumerated with ``tiny`` as it is set up now: runtime, linear backend), and the
    negative control (residual without q) fails on the same setup. Used by the runtime
    tests (``tests/test_runtime.py``, ``tests/test_dense_runtime.py``)."""
    P = exact_distribution(tiny, PROMPT, SETTINGS["t1.0"])
    eng = Engine(tiny, strong_bridge_drafter(tiny, seed=3), "dspine")
    assert chi2_pvalue(sample_counts(eng, SETTINGS["t1.0"], N, tiny.vocab_size), P) > ALPHA
    monkeypatch.setattr(dspine.core.verify, "verify", _verify_residual_is_p)
    assert chi2_pvalue(sample_counts(eng, SETTINGS["t1.0"], N_NEG, tiny.vocab_size), P) < ALPHA
