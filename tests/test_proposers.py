"""Tests of dspine.proposers: the n-gram (copy) proposer and the hybrid.

- the n-gram index equals a brute-force search (longest suffix match, most recent
  earlier occurrence, its continuation), incrementally and after a rollback;
- greedy: ``ngram`` and ``hybrid`` (shipped DSpine drafter) emit exactly the ``ar``
  token ids of the real default target, with the fixed and the per-source cost policy,
  single-request and batched;
- sampling: exact-distribution tests on a tiny random target (enumeration vs chi-square)
  for the copy proposer alone (point-mass q) and for the hybrid switch; negative
  controls that must fail: a copy verified with a wrong q, and a hybrid that decides
  whether to verify the drafter's block after looking at its first token.
"""
from __future__ import annotations

import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ar_continuation
from dspine.core.batch import BatchEngine
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import load_drafter, random_drafter
from dspine.proposers.base import Proposal
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.control.base import FixedPolicy
from dspine.control.cost_curve import CostCurve
from dspine.control.policy import CostModelPolicy
from dspine.tune.controller import make_policy
from dspine.control.per_source import PerSourcePolicy
from dspine.proposers import HybridProposer, NgramIndex, NgramProposer, Plan, make_proposer
from dspine.proposers.ngram import point_mass
from test_policy import SAMPLING, PeakedProposer, _likely_second_token, exact_distribution, sources_chi_square

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the index -------------------------------------------------------------------------------
def brute_lookup(tokens: list[int], anchor: int, n: int, max_ngram: int, min_match: int):
    """Reference: longest k (max_ngram .. min_match) whose suffix of tokens + [anchor]
    occurred earlier ending at j <= len(tokens) - 1 (most recent j); its continuation."""
    seq = tokens + [anchor]
    L = len(tokens)
    for k in range(min(max_ngram, L + 1), max(min_match, 1) - 1, -1):
        suf = seq[L + 1 - k:]
        for j in range(L - 1, k - 1, -1):  # j: where the continuation starts
            if seq[j - k:j] == suf:
                return k, seq[j:j + n]
    return 0, []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(0, 3), st.integers(1, 6),
       st.integers(1, 4), st.integers(1, 4))
def test_ngram_index_equals_brute_force(tokens, anchor, n, max_ngram, min_match):
    min_match = min(min_match, max_ngram)
    idx = NgramIndex(max_ngram)
    cut = len(tokens) // 2
    idx.observe(tokens[:cut], 0)  # incremental, as the engine commits
    idx.observe(tokens[cut:], cut)
    assert idx.lookup(anchor, n, min_match) == brute_lookup(tokens, anchor, n, max_ngram, min_match)


def brute_contested(tokens: list[int], anchor: int, k: int) -> bool:
    """Reference: the last k tokens of tokens + [anchor] occurred at least twice earlier and
    their two most recent earlier occurrences were followed by different tokens."""
    seq = tokens + [anchor]
    L = len(tokens)
    suf = seq[L + 1 - k:]
    follow = [seq[j] for j in range(L - 1, k - 1, -1) if seq[j - k:j] == suf]  # most recent first
    return len(follow) >= 2 and follow[0] != follow[1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(0, 3), st.integers(1, 4))
def test_contested_equals_brute_force(tokens, anchor, max_ngram):
    idx = NgramIndex(max_ngram, contested=True)
    cut = len(tokens) // 3
    idx.observe(tokens[:cut], 0)
    idx.observe(tokens[cut:] + [0, 1], cut)
    idx.observe(tokens[cut:], cut)  # a rollback rebuilds the index: nothing of [0, 1] may remain
    for k in range(1, min(max_ngram, len(tokens) + 1) + 1):
        assert idx.contested(anchor, k) == brute_contested(tokens, anchor, k), k


def test_contested_examples():
    with pytest.raises(ValueError, match="contested=True"):
        NgramIndex(2).contested(5, 1)  # the default index does not keep what it reads
    idx = NgramIndex(2, contested=True)
    idx.observe([5, 1, 5, 2, 7, 3], 0)
    assert idx.contested(5, 1)  # 5 was followed by 1, then by 2
    assert not idx.contested(7, 1)  # 7 occurred once
    idx.observe([7, 3], 6)
    assert not idx.contested(7, 1)  # 7 was followed by 3 both times
    assert idx.lookup(5, 2, 1) == (1, [2, 7])  # the copy itself is still the most recent continuation


def test_ngram_index_rollback_and_gap():
    idx = NgramIndex(3)
    idx.observe([1, 2, 3, 1, 2], 0)
    assert idx.lookup(3, 4, 2) == (3, [1, 2, 3])  # suffix (1, 2, 3) seen at 0..2 -> continuation 1, 2, then the anchor
    idx.observe([9, 9], 3)  # a commit from an earlier position rebuilds from the kept prefix
    assert idx.tokens == [1, 2, 3, 9, 9]
    assert idx.lookup(2, 4, 2) == (0, [])  # (9, 2) never occurred
    with pytest.raises(ValueError, match="position 7"):
        idx.observe([1], 7)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="SpeculativeConfig.ngram_min"):
        NgramProposer(16, max_ngram=2, min_match=3)
    with pytest.raises(ValueError, match="SpeculativeConfig.ngram_max"):
        NgramIndex(0)
    with pytest.raises(ValueError, match="SpeculativeConfig.proposer 'suffix'"):
        make_proposer("suffix", None)
    with pytest.raises(ValueError, match="needs a drafter"):
        make_proposer("hybrid", None)


def test_point_mass_proposal():
    p = point_mass([5, 7], 0.0, "ngram")
    assert p.tokens.tolist() == [5, 7] and p.q_ids.tolist() == [[5], [7]]
    assert p.q_probs.dtype == torch.float64 and p.q_probs.tolist() == [[1.0], [1.0]]


def test_hybrid_plans_from_the_context_only(tiny256):
    d = DrafterProposer(random_drafter(tiny256, block_size=8))
    h = HybridProposer(d, NgramProposer(8, 3, 1))
    state = h.new_state([1, 2, 3, 4, 1, 2])
    h.observe(state, [1, 2, 3, 4, 1, 2], 0)
    assert h.plan(state, 3, 7) == Plan("ngram", 4, 3)  # (1, 2, 3) occurred: copy 4, 1, 2 and the anchor 3
    assert h.plan(state, 9, 7) == Plan("draft", 7)
    assert h.alternatives(state, 4, 7)[0] == Plan("ngram1", 3, 1)  # one-token match: offered ...
    assert h.plan(state, 4, 7) == Plan("draft", 7)  # ... but without a cost policy the drafter runs
    assert h.plan(state, 4, 7, pick=lambda alts: alts[0]) == Plan("ngram1", 3, 1)
    assert h.propose(state, 3, 6, 2, SamplingConfig(), None).tokens.tolist() == [4, 1]
    h.observe(state, [9, 1], 6)  # now (1, 2) was followed by 3, then by 9: contested
    assert h.alternatives(state, 2, 7)[0] == Plan("ngram", 3, 2) and "ngram-contested" not in h.sources  # default
    split = HybridProposer(d, NgramProposer(8, 3, 1), split_contested=True)  # opt-in: priced apart
    sstate = split.new_state([1, 2, 3, 4, 1, 2])  # its index keeps what `contested` reads
    split.observe(sstate, [1, 2, 3, 4, 1, 2, 9, 1], 0)
    assert split.alternatives(sstate, 2, 7)[0] == Plan("ngram-contested", 3, 2)
    assert split.plan(sstate, 2, 7) == Plan("draft", 7)  # a contested copy is not taken without a cost policy
    assert "ngram-contested" in split.sources


# -- greedy equality on the real target ---------------------------------------------------------
COPY_PROMPT = ("Add type hints to this function and keep everything else identical:\n\n"
               "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
               "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
               "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n")
M_REAL = 40


@pytest.fixture(scope="module")
def shipped_dspine(smol):
    from dspine.build import default_drafter_path

    return load_drafter(default_drafter_path("smollm2-135m", "dspine"), smol)


# ngram alone on the real target is slow-only (suite time); the hybrid's copies run on it
# in the default suite here, in test_output_cache and test_fused_copies
@pytest.mark.parametrize("name,policy", [pytest.param("ngram", "fixed", marks=pytest.mark.slow),
                                         pytest.param("ngram", "cost", marks=pytest.mark.slow),
                                         ("hybrid", "cost"),  # cost: the default
                                         pytest.param("hybrid", "fixed", marks=pytest.mark.slow)])
def test_greedy_equals_ar_real_target(smol, shipped_dspine, name, policy):
    prop = make_proposer(name, DrafterProposer(shipped_dspine))
    pol = None if policy == "fixed" else make_policy("cost", smol, prop)
    eng = Engine(smol, prop, "dspine", verify_policy=pol)
    for text, chat in ((COPY_PROMPT, True), ("Write a Python function that reverses a string.", True)):
        ids = smol.encode_prompt(text, chat=chat)
        ref = ar_continuation(smol, ids, M_REAL)
        saved = smol.eos_token_ids
        smol.eos_token_ids = frozenset()
        try:
            r = eng.generate(ids, SamplingConfig(), M_REAL)
        finally:
            smol.eos_token_ids = saved
        assert r.token_ids == ref
        if text is COPY_PROMPT and policy == "fixed":  # the copy source really proposed, and was accepted
            assert r.stats.sources["ngram"]["accepted"] > 0, r.stats.sources
        elif text is COPY_PROMPT and name == "ngram":  # the cost policy may take plain steps on a slow
            assert r.stats.sources["ngram"]["cycles"] > 0, r.stats.sources  # machine; the copy was planned
    if policy == "cost" and name == "hybrid":
        assert isinstance(pol, PerSourcePolicy) and set(pol.policies) == {"draft", "ngram", "ngram1"}


@pytest.mark.parametrize("policy", [pytest.param("fixed", marks=pytest.mark.slow), "cost"])
def test_batched_hybrid_equals_ar(smol, shipped_dspine, policy):
    prop = make_proposer("hybrid", DrafterProposer(shipped_dspine))
    pol = None if policy == "fixed" else make_policy("cost", smol, prop)
    be = BatchEngine(Engine(smol, prop, "dspine", verify_policy=pol), max_running=3)
    prompts = [smol.encode_prompt(t, chat=True) for t in
               (COPY_PROMPT, "Write a Python function that reverses a string.", "List three colors.")]
    saved = smol.eos_token_ids
    smol.eos_token_ids = frozenset()
    try:
        res = be.generate_many(prompts, SamplingConfig(), 24)
    finally:
        smol.eos_token_ids = saved
    for ids, r in zip(prompts, res):
        assert r.token_ids == ar_continuation(smol, ids, 24)
    assert any("ngram" in r.stats.sources for r in res) and any("draft" in r.stats.sources for r in res)
    if policy == "cost":  # one verification length per batched cycle, priced by the drafter's policy
        assert be.batch_policy is not None and be.batch_policy.policy is pol.policies["draft"]


# -- exact distribution (tiny random target) ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny8():
    from dspine.target.adapter import load_target

    t = load_target("random:llama", vocab_size=8, seed=0)
    t.eos_token_ids = frozenset()
    return t


PROMPT = [0, 1, 2, 3, 4, 0, 1, 2, 3]  # an anchor among 0..4 has a match: a copy (min_match 1)
M = 5  # tokens per sampled sequence: the first from the prefill, then cycles of n <= 3


@pytest.fixture(scope="module")
def exact(tiny8):
    return exact_distribution(tiny8, PROMPT, M, SamplingConfig(**SAMPLING))


def chi_square(engine: Engine, exact: dict, n_samples: int):
    """``test_policy.sources_chi_square`` of PROMPT, M tokens."""
    return sources_chi_square(engine, PROMPT, M, exact, n_samples)


def test_distribution_ngram_alone(tiny8, exact):
    eng = Engine(tiny8, NgramProposer(4, max_ngram=2, min_match=1), "dspine")
    p, impossible, used = chi_square(eng, exact, 600)
    assert impossible == 0
    assert p > 1e-3, p
    assert used["ngram"] > 300, used  # the copy path really ran


class WrongQNgram(NgramProposer):
    """BROKEN: reports q = 0.2 for the copied token, although the copy is deterministic
    (q = 1): the verifier then accepts a copy with probability min(1, 5 p(y))."""

    def propose(self, state, anchor, anchor_pos, n, sampling, gen):
        p = super().propose(state, anchor, anchor_pos, n, sampling, gen)
        p.q_probs = p.q_probs * 0.2
        return p


def test_distribution_ngram_wrong_q_fails(tiny8, exact):
    """Negative control: the chi-square test must reject a copy verified with a wrong q."""
    eng = Engine(tiny8, WrongQNgram(4, max_ngram=2, min_match=1), "dspine")
    p, _, _ = chi_square(eng, exact, 600)
    assert p < 1e-6, p


def _per_source_policy() -> PerSourcePolicy:
    """Per-source policy: the copy source's n from a cost policy on a synthetic curve
    (exploring often, so n varies with the history); the untrained drafter always
    verifies its whole block (a cost policy would learn to skip it)."""
    curve = CostCurve([1.0, 1.15, 1.3, 1.45])
    return PerSourcePolicy({"draft": FixedPolicy(),
                            **{s: CostModelPolicy(curve, prior_accept=0.5, explore_every=2, source=s)
                               for s in ("ngram", "ngram1", "ngram-contested")}}, "ngram")


@pytest.mark.parametrize("split", [False, True])  # True: contested copies are their own source
def test_distribution_hybrid(tiny8, exact, split):
    drafter = DrafterProposer(random_drafter(tiny8, block_size=4))
    pol = _per_source_policy()
    eng = Engine(tiny8, HybridProposer(drafter, NgramProposer(4, 2, 1), split_contested=split), "dspine",
                 verify_policy=pol)
    p, impossible, used = chi_square(eng, exact, 600)
    assert impossible == 0
    assert p > 1e-3, p
    copies = ("ngram", "ngram1") + (("ngram-contested",) if split else ())
    assert sum(used[s] for s in copies) > 50 and used["draft"] > 50, used  # both really proposed
    assert min(used[s] for s in copies) >= 5, used  # every kind of copy (contested ones too when split)
    assert split or used["ngram-contested"] == 0, used
    assert len(set(pol.policies["ngram1"].decisions)) >= 2  # the copy's n really varied


class PeekingHybrid(HybridProposer):
    """BROKEN: draws the drafter's block first and, when its first token is ``v``, throws
    it away and verifies the copy instead (or nothing): whether the drafter's block is
    verified depends on the value drawn, so its y_1 is verified as if drawn from q while
    it was drawn from q conditioned on y_1 != v."""

    def __init__(self, drafter, ngram, v: int):
        super().__init__(drafter, ngram)
        self.v = v

    def plan(self, state, anchor, n_max, pick=None):
        return Plan("draft", n_max)

    def propose(self, state, anchor, anchor_pos, n, sampling, gen):
        p = self.drafter_proposer.propose(state.draft, anchor, anchor_pos, n, sampling, gen)
        if int(p.tokens[0]) != self.v:
            return p
        _, cont = state.index.lookup(anchor, n, self.ngram.min_match)
        return point_mass(cont, 0.0, "ngram") if cont else Proposal(torch.zeros(0, dtype=torch.long))


def test_distribution_peeking_hybrid_fails(tiny8, exact):
    """Negative control: choosing the source after looking at the drafter's sample biases
    the output; the chi-square test must reject it."""
    v = _likely_second_token(exact)
    eng = Engine(tiny8, PeekingHybrid(PeakedProposer(v), NgramProposer(4, 2, 1), v), "dspine")
    p, _, _ = chi_square(eng, exact, 1000)
    assert p < 1e-6, p


# -- command line -----------------------------------------------------------------------------------
def test_cli_generate_proposer(capsys):
    import json

    from dspine.cli.main import main

    assert main(["generate", "a b c a b c a b", "--target", "random:llama", "--drafter", "random",
                 "--max-new-tokens", "12", "--json", "--no-progress", "--proposer", "hybrid",
                 "--verify-policy", "fixed"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["stats"]["kernels"]["proposer"] == "hybrid"
    assert sum(v["cycles"] for v in out["stats"]["sources"].values()) == out["stats"]["cycles"]
    assert main(["generate", "x", "--target", "random:llama", "--proposer", "suffix"]) == 2
    assert "--proposer" in capsys.readouterr().err
    assert main(["generate", "x", "--target", "random:llama", "--drafter", "random", "--ngram-max", "2",
                 "--ngram-min", "3"]) == 2
    assert "--ngram-min 3" in capsys.readouterr().err


def test_per_source_policy_picks_the_better_source():
    """pick(): the source with the higher expected tokens per second from its own record;
    an untried copy (no drafter cost) wins over a drafter at the same prior."""
    curve = CostCurve([1.0, 1.1, 1.2, 1.3], propose_s=[0.0, 0.5, 0.5, 0.5])  # drafting costs 0.5
    pol = make_policy("cost", proposer=HybridProposer(PeakedProposer(0), NgramProposer(4)), cost=curve)
    assert isinstance(pol, PerSourcePolicy)

    class R:  # the engine request fields the policy reads
        cycles: list = []
        source = ""
        control_state = weakref.WeakKeyDictionary()  # where a controller keeps its per-request state

    req = R()
    copy, draft = Plan("ngram1", 3, 1), Plan("draft", 3)
    assert pol.pick(req, [copy, draft]) is copy
    from dspine.core.request import CycleRecord

    # one-token copies always rejected, drafts always fully accepted: the drafter wins
    req.cycles = [CycleRecord(3, 1, 0.0, 0.0, 1.3, 1.3, source="ngram1"),
                  CycleRecord(3, 4, 0.5, 0.0, 1.3, 1.8, source="draft")] * 20
    assert pol.pick(req, [copy, draft]) is draft
    # the one-token copies' record does not count against longer copies (priced apart)
    assert pol.pick(req, [Plan("ngram", 3, 3), copy]).source == "ngram"


def test_cli_proposer_settings_refused_or_noted(capsys):
    from dspine.cli.main import main

    assert main(["generate", "x", "--target", "random:llama", "--proposer", "ngram", "--ngram-max", "100"]) == 2
    assert "--ngram-max 100 must be in 1..16" in capsys.readouterr().err
    assert main(["generate", "x", "--target", "random:llama", "--proposer", "ngram", "--block-size", "0"]) == 2
    assert "--block-size 0" in capsys.readouterr().err
    assert main(["generate", "x", "--target", "random:llama", "--proposer", "ngram", "--drafter", "/nonexistent",
                 "--max-new-tokens", "2", "--no-progress"]) == 0
    assert "--drafter /nonexistent ignored" in capsys.readouterr().err
    assert main(["bench", "--target", "random:llama", "--modes", "ar,dspine", "--proposer", "ngram",
                 "--workloads", "short", "--limit", "1", "--out", "/tmp/dspine-never-written"]) == 2
    assert "use --modes ngram" in capsys.readouterr().err
