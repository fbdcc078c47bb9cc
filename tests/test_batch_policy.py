"""Batch-level cost policy (dspine.control.batch_policy): one verification length per batched cycle.

- the choice maximizes the batch's expected tokens per second: with a forward whose cost
  grows with its tokens, one request verifies, eight do not (prior alone);
- observed batched cycle times correct a wrong prior (negative control: the prior alone
  keeps the losing choice);
- greedy outputs of the batched engine with the policy equal the plain ``ar`` loop
  (float32), and the batched sampled outputs follow the target's exact distribution
  while n varies (chi-square), with an anticipating rule as the negative control.
"""
from __future__ import annotations

import collections
import weakref

import pytest
import torch
from scipy import stats

from dspine.core.batch import BatchEngine
from dspine.control.batch_policy import BatchCostPolicy
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import random_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.control.cost_curve import CostCurve
from dspine.control.policy import CostModelPolicy
from dspine.target.adapter import load_target
from test_policy import M, PROMPT, SAMPLING, V, CutAtToken, PeakedProposer, _likely_second_token, exact_distribution

pytestmark = pytest.mark.usefixtures("one_thread")


class _Req:
    def __init__(self, cycles=()):
        self.cycles = list(cycles)
        self.control_state = weakref.WeakKeyDictionary()  # what the controllers keep per request


class _Cycle:
    def __init__(self, n, emitted):
        self.n, self.emitted = n, emitted


def _linear_curve(n_max: int = 15, per_token: float = 0.3) -> CostCurve:
    """A CPU-like curve: a forward over k tokens costs 1 + per_token * (k - 1)."""
    return CostCurve([1.0 + per_token * n for n in range(n_max + 1)], draft_s=0.05)


def test_prior_prices_the_shared_forward_by_its_tokens():
    pol = BatchCostPolicy(CostModelPolicy(_linear_curve(), prior_accept=0.6, explore_every=0), max_batch=8)
    assert pol.prior(1, 3) == pytest.approx(1.0 + 0.3 * 3 + 0.05)
    assert pol.prior(4, 3) == pytest.approx(1.0 + 0.3 * 15 + 4 * 0.05)  # 16 tokens: on the curve
    assert pol.prior(8, 3) == pytest.approx(1.0 + 0.3 * 31 + 8 * 0.05)  # 32 tokens: extrapolated
    assert pol.prior(8, 0) == pytest.approx(1.0 + 0.3 * 7)  # plain batched step: no drafting
    one = pol.choose([_Req()], [15])
    eight = pol.choose([_Req() for _ in range(8)], [15] * 8)
    assert one[0] > 0  # one request: verifying pays off
    assert eight == [0] * 8  # eight: the forward's extra tokens cost more than they bring
    # n is capped per request by what it may verify (remaining tokens)
    assert pol.choose([_Req(), _Req()], [15, 1])[1] <= 1


class _SrcCycle(_Cycle):
    def __init__(self, n, emitted, source):
        super().__init__(n, emitted)
        self.source = source


def test_hybrid_requests_are_priced_by_their_own_source():
    """A hybrid batch (2026-12-03): requests copying their prompt (source ``ngram``, whose
    copies were accepted whole) are priced by the copy policy's record and without drafter
    cost, so the batch verifies their copies, while the drafter's record (nothing accepted)
    alone would take plain steps (negative control: no ``sources``). Drafting requests
    still count their drafter forward in the prior."""
    curve = CostCurve([1.0 + 0.1 * n for n in range(16)], draft_s=1.5)  # drafting is dear
    draft = CostModelPolicy(curve, prior_accept=0.6, explore_every=0, source="draft")
    ngram = CostModelPolicy(curve, prior_accept=0.6, explore_every=0, source="ngram")
    hist = [_SrcCycle(8, 9, "ngram")] * 6 + [_SrcCycle(8, 1, "draft")] * 6
    reqs = [_Req(hist) for _ in range(2)]
    for r in reqs:
        r.source = "ngram"
    per_source = BatchCostPolicy(draft, max_batch=4, sources={"draft": draft, "ngram": ngram})
    assert per_source.drafts(_Req()) and not per_source.drafts(reqs[0])
    assert per_source.choose(reqs, [15, 15])[0] >= 4
    assert per_source.prior(2, 4, d=0) == pytest.approx(curve.verify_s[9])  # no drafter forward
    assert per_source.prior(2, 4) == pytest.approx(curve.verify_s[9] + 2 * (curve.cycle_s(4) - curve.verify_s[4]))
    ctrl = BatchCostPolicy(CostModelPolicy(curve, prior_accept=0.6, explore_every=0, source="draft"), max_batch=4)
    assert ctrl.choose(reqs, [15, 15]) == [0, 0]


def test_choice_is_the_argmax_of_the_batch_rate():
    """Brute force over n against the module's formula, on requests with different histories."""
    base = CostModelPolicy(_linear_curve(per_token=0.05), prior_accept=0.5, explore_every=0)
    pol = BatchCostPolicy(base, max_batch=4)
    reqs = [_Req([_Cycle(15, 16)] * 6), _Req([_Cycle(15, 1)] * 6), _Req([_Cycle(15, 3)] * 6)]
    n_maxes = [15, 15, 7]
    states = [base._state(r) for r in reqs]
    es = [base.expected_tokens(base.confidence(st.stats, m)) for st, m in zip(states, n_maxes)]
    rates = [sum(e[min(n, len(e) - 1)] for e in es) / pol.cycle_cost(3, n) for n in range(16)]
    want = max(range(16), key=lambda n: (rates[n], -n))
    assert pol.choose(reqs, n_maxes) == [min(want, m) for m in n_maxes]


def test_exploration_stays_within_twice_the_chosen_cost():
    """Exploration cycles verify the longest n costing at most 2x the chosen n; when
    even one more proposal costs more, they keep the chosen n."""
    steep = CostCurve([1.0 + 5.0 * n for n in range(16)], draft_s=0.05)
    pol = BatchCostPolicy(CostModelPolicy(steep, prior_accept=0.01, explore_every=2), max_batch=8)
    got = [pol.choose([_Req()] * 8, [15] * 8)[0] for _ in range(6)]
    assert got == [0] * 6  # n = 1 costs > 2x a plain step at 8 requests
    curve = _linear_curve(per_token=0.1)
    ref = BatchCostPolicy(CostModelPolicy(curve, prior_accept=0.01, explore_every=0), 8)
    best = ref.choose([_Req()] * 2, [15] * 2)[0]
    pol = BatchCostPolicy(CostModelPolicy(curve, prior_accept=0.01, explore_every=4), max_batch=8)
    got = [pol.choose([_Req()] * 2, [15] * 2)[0] for _ in range(4)]  # cycle 1: n = 0 probe, cycle 3: explore
    assert got[0] == got[2] == best and got[1] == 0
    limit = 2 * pol.cycle_cost(2, best)
    assert got[3] > best and pol.cycle_cost(2, got[3]) <= limit < pol.cycle_cost(2, got[3] + 1)


def test_observed_batch_times_correct_a_wrong_prior():
    """The prior says a batched forward is nearly free whatever its width (a flat curve);
    the observed cycles at 8 requests say each verified position costs as much as a plain
    step, while a request accepts its first proposal half the time. With
    observations the policy moves to plain steps; the prior alone (negative control)
    keeps verifying."""
    flat = CostCurve([1.0] * 16, draft_s=0.01)
    reqs = [_Req([_Cycle(15, 1), _Cycle(15, 2)] * 4) for _ in range(8)]  # c_1 ~ 0.5, c_2 ~ 0

    def run(observe: bool) -> list[int]:
        pol = BatchCostPolicy(CostModelPolicy(flat, prior_accept=0.3, explore_every=16), max_batch=8)
        got = []
        for _ in range(40):
            n = max(pol.choose(reqs, [15] * 8))
            if observe:
                pol.observe(8, n, 1.0 + 1.0 * n)
            got.append(n)
        return got

    late = run(True)[-12:]
    assert sum(n == 0 for n in late) >= 10, late
    ctrl = run(False)[-12:]
    assert sum(n == 0 for n in ctrl) <= 1, ctrl  # only the periodic probe of a plain step


def test_cost_table_edges():
    pol = BatchCostPolicy(CostModelPolicy(_linear_curve(n_max=3), explore_every=0), max_batch=2,
                          cost_half_life=float("inf"))
    pol.observe(2, 1, 4.0)
    pol.observe(3, 1, 4.0)  # beyond max_batch: ignored
    pol.observe(1, 9, 1.0)  # beyond n_max: ignored
    pol.observe(1, 0, float("nan"))
    assert pol.times.cells == {(2, 2, 1): [4.0, 1.0]}  # (b, drafting requests, n): all b by default
    assert pol.cycle_cost(2, 1) == 4.0
    ratio = 4.0 / pol.prior(2, 1)
    assert pol.cycle_cost(1, 2) == pytest.approx(pol.prior(1, 2) * ratio)  # nearest observed cell
    assert pol.choose([], []) == []
    with pytest.raises(ValueError, match="max_batch 2"):
        pol.choose([_Req()] * 3, [3] * 3)
    for bad in (dict(max_batch=0), dict(max_batch=2, cost_half_life=0.0)):
        with pytest.raises(ValueError):
            BatchCostPolicy(CostModelPolicy(_linear_curve()), **bad)
    with pytest.raises(ValueError, match="explore_every"):
        BatchCostPolicy(CostModelPolicy(_linear_curve()), 2, explore_every=-1)
    # the decay and the observe_costs switch come from the wrapped policy
    base = CostModelPolicy(_linear_curve(), cost_half_life=4.0, observe_costs=False)
    frozen = BatchCostPolicy(base, 2)
    assert frozen.times.decay == pytest.approx(base.times.decay) == pytest.approx(0.5 ** 0.25)
    frozen.observe(2, 1, 100.0)
    assert frozen.cycle_cost(2, 1) == pytest.approx(frozen.prior(2, 1))  # the prior alone
    pol.decisions.limit = 8  # bounded history
    for _ in range(20):
        pol.choose([_Req()], [3])
    assert 4 <= len(pol.decisions) <= 8


# -- the batched engine with the policy -------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return load_target("random:llama")


def test_greedy_batched_with_cost_policy_equals_ar(llama):
    prompts = [llama.encode_prompt(p) for p in ["hello world", "a", "The quick brown fox", "xyz" * 9, "12"]]
    lens = [20, 33, 5, 28, 17]
    ar = Engine(llama, None, "ar")
    ref = [ar.generate(p, max_new_tokens=m).token_ids for p, m in zip(prompts, lens)]
    base = CostModelPolicy(_linear_curve(per_token=0.02), prior_accept=0.5, explore_every=3)
    eng = Engine(llama, DrafterProposer(random_drafter(llama, "dspine", seed=1)), "dspine", verify_policy=base)
    be = BatchEngine(eng, 4)
    got = be.generate_many(prompts, max_new_tokens=lens)
    assert [g.token_ids for g in got] == ref
    assert be.batch_policy is not None and be.batch_policy.policy is base
    ns = {n for _, n in be.batch_policy.decisions}
    assert len(ns) >= 2 and {b for b, _ in be.batch_policy.decisions} >= {4, 1}  # n and b varied
    assert not base.decisions  # per-request choices were not used in batched cycles


@pytest.fixture(scope="module")
def tiny():
    t = load_target("random:llama", vocab_size=V, seed=0)
    t.eos_token_ids = frozenset()
    return t


@pytest.fixture(scope="module")
def exact(tiny):
    return exact_distribution(tiny, PROMPT, M, SamplingConfig(**SAMPLING))


def _batched_chi_square(engine: Engine, exact: dict, n_samples: int) -> tuple[float, int, BatchEngine]:
    be = BatchEngine(engine, 4)
    res = be.generate_many([PROMPT] * n_samples, [SamplingConfig(seed=s, **SAMPLING) for s in range(n_samples)],
                           max_new_tokens=M)
    counts = collections.Counter(tuple(r.token_ids) for r in res)
    impossible = sum(c for k, c in counts.items() if k not in exact)
    obs, exp, ro, re = [], [], 0, 0.0
    for k, pk in sorted(exact.items(), key=lambda kv: -kv[1]):
        if pk * n_samples >= 5:
            obs.append(counts[k])
            exp.append(pk * n_samples)
        else:
            ro, re = ro + counts[k], re + pk * n_samples
    return float(stats.chisquare(obs + [ro], exp + [re]).pvalue), impossible, be


def _varied() -> CostModelPolicy:
    return CostModelPolicy(CostCurve([1.0, 1.15, 1.3, 1.45]), prior_accept=0.5, explore_every=2)


def test_batched_distribution_with_cost_policy(tiny, exact):
    v = _likely_second_token(exact)
    eng = Engine(tiny, PeakedProposer(v), "dspine", verify_policy=_varied())
    p, impossible, be = _batched_chi_square(eng, exact, 600)
    assert impossible == 0
    assert len({n for _, n in be.batch_policy.decisions}) >= 2  # n really varied
    assert p > 1e-3, p


def test_batched_distribution_anticipating_truncation_fails(tiny, exact):
    """Negative control through the same batched path and policy: cutting the block at
    a proposal after seeing it biases the output and must be rejected."""
    v = _likely_second_token(exact)
    eng = Engine(tiny, CutAtToken(PeakedProposer(v), v, keep=False), "dspine", verify_policy=_varied())
    # 800 samples: exploration of n_max is rarer when it costs more than the chosen n
    # (CostModelPolicy.explore_period), so fewer cycles are cut than at its old fixed period
    p, _, _ = _batched_chi_square(eng, exact, 800)
    assert p < 1e-6, p
