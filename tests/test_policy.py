"""Tests of dspine.control.policy: verification-length policies (spec section 5).

- policies return n in [0, n_max]; the cost model picks the n that maximizes expected
  tokens per second for known acceptance/cost, and learns it from past cycles;
- greedy output with the cost policy equals the plain ``ar`` output;
- distribution test (tiny random target, exact enumeration of the target's sampled
  sequences vs chi-square): passes with the cost policy on; an *anticipating* rule (a
  proposer wrapper that drops the block from the first sampled token equal to some
  value, i.e. decides whether to verify a token after looking at it) fails. Stopping
  the chain right *after* such a token (keeping it; "stop the chain at the step
  itself", spec s.5) is not anticipating and passes.
"""
from __future__ import annotations

import collections
import random
import weakref

import pytest
import torch
from scipy import stats

from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import random_drafter
from dspine.proposers.base import Proposal, Proposer
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine, EngineError
from dspine.core.request import Request
from dspine.control.base import Controller, FixedPolicy
from dspine.control.cost_curve import CostCurve
from dspine.control.estimator import AcceptanceStats
from dspine.control.per_source import PerSourcePolicy
from dspine.control.policy import CostModelPolicy
from dspine.tune.controller import make_policy, POLICIES
from dspine.tune.cost import measure_cost
from dspine.core.sampling import filter_probs, sample_index, uniform
from dspine.target.adapter import load_target

V = 8  # tiny vocabulary: sequences can be enumerated exactly
PROMPT = [3, 1, 4, 1, 5]
M = 4  # new tokens per sampled sequence (first from the prefill, then cycles with n <= 2)
SAMPLING = dict(temperature=1.0, top_p=0.95)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    t = load_target("random:llama", vocab_size=V, seed=0)
    t.eos_token_ids = frozenset()  # every sample has exactly M tokens
    return t


@pytest.fixture(scope="module")
def tiny256():
    return load_target("random:llama", vocab_size=256, seed=1)


# -- helpers -------------------------------------------------------------------------------
class _Cycle:
    def __init__(self, n, emitted):
        self.n, self.emitted = n, emitted


class _Req:
    """Stand-in for engine.Request: the policy reads ``cycles`` and keeps its state in
    ``control_state``."""

    def __init__(self):
        self.cycles = []
        self.control_state = weakref.WeakKeyDictionary()


class ScriptedProposer(Proposer):
    """Proposes the target's greedy continuation for the first ``good`` positions of
    each block and a wrong token after them (so acceptance is exactly ``good``)."""

    feature_layers = [0]  # features are captured but unused (works with any engine version)

    def __init__(self, cont: list[int], prompt_len: int, block_size: int, good: int, vocab: int):
        self.cont, self.P, self.block_size, self.good, self.vocab = cont, prompt_len, block_size, good, vocab

    def propose(self, state, anchor, anchor_pos, n, sampling, gen):
        k = anchor_pos - self.P + 1
        toks = [self.cont[j] if j < len(self.cont) else 0 for j in range(k, k + n)]
        toks = [t if i < self.good else (t + 1) % self.vocab for i, t in enumerate(toks)]
        return Proposal(torch.tensor(toks, dtype=torch.long))


class PeakedProposer(Proposer):
    """Draws every proposal from a fixed q with mass ``mass`` on token ``v`` (sparse q
    over the whole vocabulary). Cheap, and far from the target: a good test bed."""

    feature_layers = [0]  # features are captured but unused (works with any engine version)
    block_size = 4

    def __init__(self, v: int, mass: float = 0.7):
        self.q = torch.full((V,), (1 - mass) / (V - 1), dtype=torch.float64)
        self.q[v] = mass

    def propose(self, state, anchor, anchor_pos, n, sampling, gen):
        toks = [sample_index(self.q, uniform(gen)) for _ in range(n)]
        return Proposal(torch.tensor(toks, dtype=torch.long), torch.arange(V).expand(n, V).clone(),
                        self.q.expand(n, V).clone())


class CutAtToken(Proposer):
    """Wrapper that ends the block at the first proposal equal to ``value``.

    ``keep=False`` drops that proposal (and the rest): whether y_k is verified is decided
    *after* y_k was drawn -- anticipating, biased. ``keep=True`` keeps it and drops the
    rest: the chain stops at the step itself, positions after k are never drawn -- fine.
    """

    def __init__(self, inner: Proposer, value: int, keep: bool):
        self.inner, self.value, self.keep = inner, value, keep
        self.block_size = inner.block_size
        self.feature_layers = inner.feature_layers
        self.needs_features = inner.needs_features

    def new_state(self, prompt_ids):
        return self.inner.new_state(prompt_ids)

    def commit(self, state, features, start_pos):
        self.inner.commit(state, features, start_pos)

    def propose(self, state, anchor, anchor_pos, n, sampling, gen):
        p = self.inner.propose(state, anchor, anchor_pos, n, sampling, gen)
        hit = (p.tokens == self.value).nonzero()
        if hit.numel():
            k = int(hit[0]) + int(self.keep)
            p = Proposal(p.tokens[:k], None if p.q_ids is None else p.q_ids[:k],
                         None if p.q_probs is None else p.q_probs[:k], p.draft_s, p.final_s)
        return p


@torch.no_grad()
def exact_distribution(target, prompt: list[int], m: int, sampling: SamplingConfig,
                       eos: frozenset = frozenset()) -> dict[tuple, float]:
    """P(output) under the target's plain sampler, by enumeration: the first m sampled
    tokens, or fewer when an output reaches a token in ``eos`` (it ends there)."""
    done: dict[tuple, float] = {}
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(m):
        pref = list(probs)
        ids = torch.tensor([prompt + list(p) for p in pref])
        p = filter_probs(target.model(input_ids=ids).logits[:, -1].float(), sampling)  # [n, V]
        nxt: dict[tuple, float] = {}
        for i, pr in enumerate(pref):
            for v in range(V):
                if p[i, v] > 0:
                    (done if v in eos else nxt)[pr + (v,)] = probs[pr] * float(p[i, v])
        probs = nxt
    return {**done, **probs}


def pooled_chi_square(counts: collections.Counter, exact: dict, n_samples: int) -> tuple[float, int]:
    """(p-value, samples outside the support) of sampled sequence ``counts`` vs ``exact``.
    Cells with expected count < 5 are pooled into one."""
    impossible = sum(c for k, c in counts.items() if k not in exact)
    obs, exp, ro, re = [], [], 0, 0.0
    for k, pk in sorted(exact.items(), key=lambda kv: -kv[1]):
        e = pk * n_samples
        if e >= 5:
            obs.append(counts[k])
            exp.append(e)
        else:
            ro += counts[k]
            re += e
    obs.append(ro)
    exp.append(re)
    assert len(obs) >= 8, "too few cells for a meaningful test"
    return float(stats.chisquare(obs, exp).pvalue), impossible


def sources_chi_square(engine: Engine, prompt: list[int], m: int, exact: dict,
                       n_samples: int) -> tuple[float, int, collections.Counter]:
    """(p-value, samples outside the support, proposals verified per proposer source) of
    ``n_samples`` sequences of ``m`` tokens after ``prompt`` sampled by ``engine`` with
    :data:`SAMPLING` (seeds 0..n-1), vs ``exact`` (:func:`pooled_chi_square`)."""
    counts, used = collections.Counter(), collections.Counter()
    for s in range(n_samples):
        r = engine.generate(prompt, SamplingConfig(seed=s, **SAMPLING), max_new_tokens=m)
        counts[tuple(r.token_ids)] += 1
        used.update({k: v["proposed"] for k, v in r.stats.sources.items()})
    return (*pooled_chi_square(counts, exact, n_samples), used)


def chi_square(engine: Engine, exact: dict, n_samples: int) -> tuple[float, int]:
    """:func:`pooled_chi_square` of n_samples sequences of PROMPT sampled by ``engine``."""
    counts = collections.Counter()
    for s in range(n_samples):
        r = engine.generate(PROMPT, SamplingConfig(seed=s, **SAMPLING), max_new_tokens=M)
        counts[tuple(r.token_ids)] += 1
    return pooled_chi_square(counts, exact, n_samples)


def varied_cost_policy() -> CostModelPolicy:
    """Cost policy with a synthetic curve on which n depends on the acceptance history,
    exploring every second cycle (so n varies within and across requests)."""
    return CostModelPolicy(CostCurve([1.0, 1.15, 1.3, 1.45]), prior_accept=0.5, explore_every=2)


# -- policy API -----------------------------------------------------------------------------
def test_fixed_policy():
    assert FixedPolicy()(_Req(), 7) == 7
    assert FixedPolicy(3)(_Req(), 7) == 3 and FixedPolicy(3)(_Req(), 2) == 2
    with pytest.raises(ValueError):
        FixedPolicy(-1)
    assert POLICIES == ("fixed", "cost")
    with pytest.raises(ValueError, match="SpeculativeConfig.verify_policy 'greedy' is unknown; accepted: fixed, cost"):
        make_policy("greedy")


def test_cost_policy_returns_n_in_range():
    rng = random.Random(0)
    for trial in range(40):
        n_max_curve = rng.randint(1, 15)
        curve = CostCurve(sorted(rng.uniform(0.01, 0.1) for _ in range(n_max_curve + 1)),
                          draft_s=rng.uniform(0, 0.05), final_per_row_s=rng.uniform(0, 0.005))
        pol = CostModelPolicy(curve, prior_accept=rng.random(), explore_every=rng.choice([0, 3]))
        req = _Req()
        for _ in range(12):
            n_max = rng.randint(1, 15)
            n = pol(req, n_max)
            assert 0 <= n <= n_max and isinstance(n, int)
            req.cycles.append(_Cycle(n, rng.randint(1, n + 1)))


def test_cost_policy_maximizes_expected_rate():
    curve = CostCurve([1.0, 1.1, 1.2, 1.3, 1.4, 1.5], draft_s=0.5)
    pol = CostModelPolicy(curve, explore_every=0)
    # acceptance 1 up to position 3, then 0: E = 4 tokens for any n >= 3 -> n = 3
    assert pol.choose([1.0, 1.0, 1.0, 0.0, 0.0], 5) == 3
    # nothing is ever accepted: drafting only costs -> plain step
    assert pol.choose([0.0] * 5, 5) == 0
    # free verification and certain acceptance: verify everything allowed
    assert CostModelPolicy(CostCurve([1.0] * 6)).choose([1.0] * 5, 4) == 4
    assert pol.expected_tokens([0.5, 0.5]) == [1.0, 1.5, 1.75]


def test_depth_prior_carries_the_shallower_estimate():
    """``depth_prior``: a position never verified is priced at the estimate of the one before
    it; the flat prior (the default) prices it at ``prior_accept`` whatever came before."""
    curve = CostCurve([1.0] * 8)
    st = AcceptanceStats(half_life=float("inf"))
    for _ in range(40):
        st.update(n=3, accepted=3)  # positions 1..3 always accepted; 4.. never verified
    flat = CostModelPolicy(curve, explore_every=0).confidence(st, 6)
    deep = CostModelPolicy(curve, explore_every=0, depth_prior=True).confidence(st, 6)
    assert flat[0] == deep[0] and min(flat[:3] + deep[:3]) > 0.9  # measured positions: data dominates
    assert flat[3:] == [0.6] * 3  # the flat prior
    assert all(d > 0.9 for d in deep[3:])  # carried down from position 3
    st0 = AcceptanceStats(half_life=float("inf"))  # nothing seen: both are the prior everywhere
    assert CostModelPolicy(curve, depth_prior=True).confidence(st0, 4) == pytest.approx([0.6] * 4)


def test_acceptance_stats_are_censored():
    st = AcceptanceStats(half_life=float("inf"))
    st.update(n=3, accepted=3)  # positions 1..3 accepted
    st.update(n=1, accepted=1)  # position 1 accepted; 2, 3 not verified (not a rejection)
    st.update(n=3, accepted=0)  # position 1 rejected; 2, 3 never reached
    assert st.counts(0) == (2.0, 3.0)
    assert st.counts(1) == (1.0, 1.0) and st.counts(2) == (1.0, 1.0)
    assert st.counts(5) == (0.0, 0.0)


def test_cost_policy_learns_acceptance_from_past_cycles(tiny256):
    """A proposer right for exactly 3 positions: once measured, the policy verifies 3."""
    from dspine.core.engine import Engine as E

    prompt = list(range(10, 30))
    tiny256.eos_token_ids, saved = frozenset(), tiny256.eos_token_ids
    try:
        cont = E(tiny256, None, "ar").generate(prompt, SamplingConfig(), 60).token_ids
        prop = ScriptedProposer(cont, len(prompt), block_size=8, good=3, vocab=256)
        pol = CostModelPolicy(CostCurve([1.0 + 0.1 * n for n in range(8)], draft_s=0.5), explore_every=0,
                              observe_costs=False)  # the synthetic curve, not this machine's times
        eng = Engine(tiny256, prop, "dspine", verify_policy=pol)
        res = eng.generate(prompt, SamplingConfig(), 60)
    finally:
        tiny256.eos_token_ids = saved
    ns = res.stats.verification_lengths
    assert ns[0] > 3  # the prior (0.6 per position) makes drafting past 3 look worthwhile
    assert all(n == 3 for n in ns[4:-3]), ns  # learned: positions > 3 are never accepted
    assert res.token_ids == cont[: len(res.token_ids)]


def test_cost_curve_fit_is_monotone():
    from dspine.tune.cost import _interp

    curve = _interp({0: 1.0, 1: 2.0, 2: 1.5, 4: 3.0, 8: 2.9, 15: 4.0}, 15)
    assert len(curve) == 16 and curve[0] == 1.0 and curve[-1] == 4.0
    assert all(b >= a for a, b in zip(curve, curve[1:]))
    assert curve[1] == curve[2] == 1.75  # a noisy pair is pooled, not lifted to the max


def test_measure_cost_is_cached_and_monotone(tiny256):
    prop = DrafterProposer(random_drafter(tiny256, block_size=8))
    c1 = measure_cost(tiny256, prop, n_max=7, context=32, repeats=1)
    assert len(c1.verify_s) == 8 and c1.n_max == 7
    assert all(b >= a > 0 for a, b in zip(c1.verify_s, c1.verify_s[1:]))
    assert c1.draft_s > 0 and c1.final_per_row_s >= 0
    # proposal cost per verification length (DSpine drafts n + 1 rows): measured, monotone
    assert len(c1.propose_s) == 8 and c1.propose_s[0] == 0.0 and c1.propose_s[1] > 0
    assert all(b >= a for a, b in zip(c1.propose_s, c1.propose_s[1:]))
    assert c1.cycle_s(3) == c1.verify_s[3] + c1.propose_s[3]
    assert measure_cost(tiny256, prop, n_max=7, context=32, repeats=1) is c1
    assert CostCurve.from_dict(c1.to_dict()) == c1
    assert c1.cycle_s(0) == c1.verify_s[0] < c1.cycle_s(3)


def test_cheap_short_proposals_make_short_verification_pay():
    """With a proposal cost that grows with n, the policy picks a short n where a flat
    full-block draft cost would make drafting not pay at all."""
    verify = [1.0 + 0.06 * n for n in range(16)]
    conf = [0.45] * 15
    flat = CostModelPolicy(CostCurve(verify, draft_s=0.6), explore_every=0)
    scaled = CostModelPolicy(CostCurve(verify, draft_s=0.6, propose_s=[0.0] + [0.03 + 0.02 * n for n in range(1, 16)]),
                             explore_every=0)
    assert flat.choose(conf, 15) == 0
    n = scaled.choose(conf, 15)
    assert 1 <= n <= 4
    e = scaled.expected_tokens(conf)
    assert e[n] / scaled.cost.cycle_s(n) > 1.0 / verify[0]  # faster than the plain step


class _TimedCycle(_Cycle):
    def __init__(self, n, emitted, seconds):
        super().__init__(n, emitted)
        self.draft_s, self.final_s, self.verify_s = 0.25 * seconds, 0.25 * seconds, 0.5 * seconds


def test_observed_cycle_times_correct_a_wrong_cost_curve():
    """The measured curve says verifying is nearly free (C(n>=1) = 1.1 C(0)); the real
    cycles say a verifying cycle costs 3x a plain step (and emits 2 tokens). With observed times the policy
    moves to plain steps; with ``observe_costs=False`` (negative control) it keeps
    verifying, the losing choice. A plain step is probed when none was observed."""
    curve = CostCurve([1.0] + [1.05] * 15, draft_s=0.05)  # wrong: too cheap for n >= 1
    conf_accept = 2  # every verifying cycle: 1 of n proposals accepted (emitted 2)

    def run(observe):
        pol = CostModelPolicy(curve, prior_accept=0.4, explore_every=16, observe_costs=observe)
        req = _Req()
        for _ in range(48):
            n = pol(req, 15)
            emitted = 1 if n == 0 else conf_accept
            req.cycles.append(_TimedCycle(n, emitted, 1.0 if n == 0 else 3.0))
        return pol, [pol(req, 15) for _ in range(1)] + pol.decisions[-16:]

    pol, late = run(True)
    assert 0 in pol.decisions[:16]  # the probe of a plain step (only verifying cycles seen until then)
    assert sum(n == 0 for n in late) >= 14, late  # learned: a plain step is faster here
    assert pol.cycle_cost(0) == pytest.approx(1.0, rel=0.05) and pol.cycle_cost(3) > 2.5
    ctrl, late_c = run(False)
    assert all(n > 0 for n in late_c), late_c  # the measured curve alone keeps verifying
    assert ctrl.cycle_cost(3) == curve.cycle_s(3)


def test_unobserved_lengths_scale_with_the_observed_ratio():
    """An observed n costs its decayed observed mean; an n never observed is the measured
    curve times the observed/measured ratio at the nearest observed n."""
    curve = CostCurve([1.0, 2.0, 3.0, 4.0], draft_s=0.0)
    pol = CostModelPolicy(curve, cost_half_life=float("inf"))
    assert pol.cycle_cost(2) == 3.0  # nothing observed: the curve
    pol.observe(1, 4.0)
    pol.observe(1, 6.0)  # mean 5.0 at n = 1: 2.5x the curve
    pol.observe(3, 4.0)  # 1x the curve at n = 3
    assert pol.cycle_cost(1) == pytest.approx(5.0) and pol.cycle_cost(3) == pytest.approx(4.0)
    assert pol.cycle_cost(0) == pytest.approx(2.5)  # nearest observed: n = 1
    assert pol.cycle_cost(2) == pytest.approx(3.0 * 2.5)  # tie between 1 and 3: the lower n
    pol.observe(9, 1.0)  # out of range and bad values are ignored
    pol.observe(0, float("nan"))
    assert [pol.times.weight(n) for n in range(4)] == [0.0, 2.0, 0.0, 1.0]
    decayed = CostModelPolicy(curve, cost_half_life=1.0)
    decayed.observe(0, 5.0)
    decayed.observe(1, 2.0)
    decayed.observe(1, 2.0)  # n = 0's weight fell to 0.25: estimated from n = 1 again
    assert decayed.times.weight(0) == pytest.approx(0.25) and decayed.cycle_cost(0) == pytest.approx(1.0)


def test_swapping_policies_back_does_not_recount_cycles():
    a, b = CostModelPolicy(CostCurve([1.0, 1.2, 1.4])), CostModelPolicy(CostCurve([1.0, 1.2, 1.4]))
    req = _Req()
    for k in range(6):
        (a if k % 2 == 0 else b)(req, 2)  # a, b, a, b, ...: each sees every completed cycle once
        req.cycles.append(_Cycle(2, 2))
    a(req, 2)
    assert a.pooled.cycles == 6 and b.pooled.cycles == 5


def test_cost_curve_validated_on_construction():
    """A curve whose costs are negative or not finite would make some n look free."""
    for bad in (dict(verify_s=[]), dict(verify_s=[1.0, float("nan")]), dict(verify_s=[1.0, -2.0]),
                dict(verify_s=[1.0, 2.0], draft_s=float("inf")), dict(verify_s=[1.0, 2.0], propose_s=[0.0])):
        with pytest.raises(ValueError, match="CostCurve"):
            CostCurve(**bad)
    c = CostCurve([1.0, 2.0], propose_s=[0.0, 0.5])
    assert CostCurve.from_dict(c.to_dict()) == c


def test_cost_correction_edge_cases():
    """A zero-cost curve point, a batched cycle (its forward is shared by the batch, not
    this request's cost) and a bad half-life do not break the policy."""
    pol = CostModelPolicy(CostCurve([0.0, 1.0, 2.0, 3.0]))
    pol.observe(0, 0.5)
    assert 0 <= pol(_Req(), 3) <= 3 and pol.cycle_cost(3) == 3.0  # no division by the 0 point
    req = _Req()
    c = _TimedCycle(2, 2, 1.0)
    c.batched = True
    req.cycles.append(c)
    pol2 = CostModelPolicy(CostCurve([1.0, 1.5, 2.0, 2.5]))
    pol2(req, 3)
    assert not pol2.times.cells and pol2.pooled.cycles == 1  # acceptance counted, cost not
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="cost_half_life"):
            CostModelPolicy(CostCurve([1.0, 2.0]), cost_half_life=bad)


# -- greedy equality ------------------------------------------------------------------------
def test_greedy_with_cost_policy_equals_ar(tiny256):
    prompt = [72, 101, 108, 108, 111, 44, 32, 119]
    ar = Engine(tiny256, None, "ar").generate(prompt, SamplingConfig(), 40)
    prop = DrafterProposer(random_drafter(tiny256, block_size=8))
    measured = make_policy("cost", tiny256, prop)  # measured cost curve on this machine
    eng = Engine(tiny256, prop, "dspine", verify_policy=measured)
    assert eng.generate(prompt, SamplingConfig(), 40).token_ids == ar.token_ids
    # a curve on which n varies (cheap verification, exploration): output unchanged
    pol = CostModelPolicy(CostCurve([1.0 + 0.05 * n for n in range(8)], draft_s=0.1), explore_every=3)
    res = Engine(tiny256, prop, "dspine", verify_policy=pol).generate(prompt, SamplingConfig(), 40)
    assert res.token_ids == ar.token_ids
    assert len(set(res.stats.verification_lengths)) >= 2


def test_engine_calls_policy_before_proposing(tiny256):
    """Non-anticipation at the interface: the policy is asked before the proposer runs
    and sees only completed cycles."""
    events = []
    prop = DrafterProposer(random_drafter(tiny256, block_size=4))
    orig = prop.propose

    def propose(*a, **k):
        events.append("propose")
        return orig(*a, **k)

    prop.propose = propose

    class Recording(Controller):
        def __call__(self, req: Request, n_max: int) -> int:
            events.append(("policy", len(req.cycles)))
            return 2

    eng = Engine(tiny256, prop, "dspine", verify_policy=Recording())
    res = eng.generate([65, 66, 67], SamplingConfig(), 8)
    assert events[0] == ("policy", 0) and events[1] == "propose"
    pol_calls = [e for e in events if e != "propose"]
    assert [c for _, c in pol_calls] == list(range(len(pol_calls)))
    assert all(n <= 2 for n in res.stats.verification_lengths)


# -- distribution tests ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exact(tiny):
    return exact_distribution(tiny, PROMPT, M, SamplingConfig(**SAMPLING))


def _likely_second_token(exact: dict) -> int:
    m = collections.Counter()
    for k, p in exact.items():
        m[k[1]] += p
    return max(m, key=m.get)


def test_distribution_with_cost_policy_dspine_drafter(tiny, exact):
    pol = varied_cost_policy()
    eng = Engine(tiny, DrafterProposer(random_drafter(tiny, block_size=4)), "dspine", verify_policy=pol)
    p, impossible = chi_square(eng, exact, 600)
    assert impossible == 0
    assert len(set(pol.decisions)) >= 2  # the policy really varied n
    assert p > 1e-3, p


def test_distribution_anticipating_truncation_fails(tiny, exact):
    """Negative control: dropping the block from the first proposal equal to v (decided
    after seeing it) biases the output; the chi-square test must reject it."""
    v = _likely_second_token(exact)
    eng = Engine(tiny, CutAtToken(PeakedProposer(v), v, keep=False), "dspine")
    p, _ = chi_square(eng, exact, 400)
    assert p < 1e-6, p


def test_distribution_stop_after_token_passes(tiny, exact):
    """Stopping the chain right after the sampled v (keeping it) never decides whether
    to verify a drawn token from its own value: exact, like the cost policy."""
    v = _likely_second_token(exact)
    pol = varied_cost_policy()
    eng = Engine(tiny, CutAtToken(PeakedProposer(v), v, keep=True), "dspine", verify_policy=pol)
    p, impossible = chi_square(eng, exact, 400)
    assert impossible == 0
    assert p > 1e-3, p


# -- CLI -------------------------------------------------------------------------------------------
def test_cli_generate_verify_policy(capsys):
    import json

    from dspine.cli.main import main

    for pol in ("fixed", "cost"):
        rc = main(["generate", "Hi", "--target", "random:llama", "--drafter", "random", "--max-new-tokens", "12",
                   "--verify-policy", pol, "--json"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
        assert len(out["token_ids"]) == 12
        assert all(0 <= n <= 15 for n in out["stats"]["verification_lengths"])
    rc = main(["generate", "Hi", "--target", "random:llama", "--drafter", "random", "--verify-policy", "oracle"])
    assert rc == 2
    assert "--verify-policy 'oracle' is unknown; accepted: fixed, cost" in capsys.readouterr().err


def test_engine_refuses_a_controller_it_would_have_to_probe(tiny256):
    """The engine calls a declared interface (dspine.control.base.Controller); a bare
    callable is refused with the setting named, not probed for optional methods."""
    prop = DrafterProposer(random_drafter(tiny256, block_size=4))
    with pytest.raises(EngineError, match="verify_policy must be a dspine.control.base.Controller"):
        Engine(tiny256, prop, "dspine", verify_policy=lambda req, n: n)
    assert Engine(tiny256, prop, "dspine").verify_policy.name == "fixed"  # None: the whole block


def test_bad_controller_settings_are_refused_when_built():
    """Refused at construction, not at the first request in the middle of decoding."""
    import math

    curve = CostCurve([1.0, 1.5])
    for kw in (dict(half_life=-1), dict(half_life=math.nan), dict(prior_weight=-1),
               dict(global_weight_cap=math.nan), dict(explore_every=1.5)):
        with pytest.raises(ValueError):
            CostModelPolicy(curve, **kw)
    with pytest.raises(ValueError, match="CostCurve"):
        CostModelPolicy(None)
    with pytest.raises(ValueError, match="n must be >= 0"):
        curve.cycle_s(-1)
    assert CostModelPolicy(curve, half_life=8.0, explore_every=4)  # good settings still build


def test_a_plain_step_is_priced_from_every_sources_cycles():
    """A plain step (n = 0) is the same target step whichever proposer source planned it, so
    a per-source policy prices it from every source's cycles. A one-token copy source that
    almost always verifies (chat) saw only its own n = 1 cycles and priced n = 0 as the curve
    scaled by its n = 1 overhead (1.25 here instead of the 1.0 every plain step took): it then
    kept verifying one-token copies accepted 1 time in 4 at 1.5x a plain step, which loses.
    The copy source's acceptance statistics still count its own cycles only."""
    curve = CostCurve([1.0, 1.2, 1.4, 1.6], draft_s=0.0)
    draft = CostModelPolicy(curve, source="draft", explore_every=0, cost_half_life=float("inf"))
    copy = CostModelPolicy(curve, source="ngram1", explore_every=0, prior_accept=0.25,
                           cost_half_life=float("inf"))
    req = _Req()
    for k in range(40):
        c = _TimedCycle(0, 1, 1.0) if k % 2 else _TimedCycle(1, 2 if k % 8 == 0 else 1, 1.5)
        c.source = "draft" if k % 2 else "ngram1"
        req.cycles.append(c)
    pol = PerSourcePolicy({"draft": draft, "ngram1": copy}, "draft")
    req.source = "ngram1"
    n = pol(req, 3)
    assert copy.cycle_cost(0) == pytest.approx(1.0) and copy.cycle_cost(1) == pytest.approx(1.5)
    assert copy.pooled.cycles == 20  # its own cycles only
    assert n == 0  # (1 + 0.25) / 1.5 < 1 / 1.0: a plain step

