"""Proposals past the end of a request are not verified (``Engine.cut_at_finish``).

- the cut keeps the proposals up to and including the first EOS token, or the token after
  which the text holds a stop string, and drops the rest (with their q);
- greedy on the real target: copies that run into a stop string are cut, and the output
  is token for token ``ar``'s with the same stop strings;
- sampling: exact-distribution test on a tiny random target whose EOS is a token the
  drafter proposes often (enumeration vs chi-square); negative control: a cut that drops
  the EOS proposal itself (decided after seeing it) must fail.
"""
from __future__ import annotations

import collections

import pytest
import torch

from dspine.config import SamplingConfig
from dspine.core.engine import Engine
from dspine.proposers import NgramProposer
from dspine.proposers.base import Proposal
from dspine.target.adapter import load_target
from test_policy import PROMPT, SAMPLING, V, PeakedProposer, exact_distribution, pooled_chi_square

pytestmark = pytest.mark.usefixtures("one_thread")

M = 4  # at most this many new tokens per sampled sequence


@pytest.fixture(scope="module")
def tiny_eos():
    t = load_target("random:llama", vocab_size=V, seed=0)
    t.eos_token_ids = frozenset()
    probs = exact_distribution(t, PROMPT, M, SamplingConfig(**SAMPLING))
    second = collections.Counter()
    for k, p in probs.items():
        second[k[1]] += p
    # EOS: the second token closest to 20% likely, so requests often end early but not nearly always
    t.eos_token_ids = frozenset({min(second, key=lambda v: abs(second[v] - 0.2))})
    return t


class DropEos(Engine):
    """BROKEN: cuts the chain *before* its first EOS proposal (dropping it): whether that
    drawn token is verified depends on its own value, so it is verified as if drawn from q
    while it was drawn from q conditioned on not being EOS."""

    def cut_at_finish(self, req, prop):
        toks = prop.tokens.tolist()
        k = next((i for i, t in enumerate(toks) if t in self.target.eos_token_ids), len(toks))
        return Proposal(prop.tokens[:k], None if prop.q_ids is None else prop.q_ids[:k],
                        None if prop.q_probs is None else prop.q_probs[:k], prop.draft_s, prop.final_s)


def _chi_square(engine: Engine, exact: dict, n: int):
    counts, cut = collections.Counter(), 0
    orig = engine.cut_at_finish

    def counting(req, prop):
        nonlocal cut
        before = int(prop.tokens.shape[0])
        out = orig(req, prop)
        cut += int(out.tokens.shape[0] < before)
        return out

    engine.cut_at_finish = counting
    for s in range(n):
        r = engine.generate(PROMPT, SamplingConfig(seed=s, **SAMPLING), max_new_tokens=M)
        counts[tuple(r.token_ids)] += 1
    return (*pooled_chi_square(counts, exact, n), cut)


def test_cut_keeps_the_first_eos_and_drops_the_rest(tiny_eos):
    (e,) = tiny_eos.eos_token_ids
    eng = Engine(tiny_eos, PeakedProposer(e), "dspine")
    req = eng.start(PROMPT, SamplingConfig(), 8)
    other = (e + 1) % V
    toks = torch.tensor([other, e, other, e])
    q_ids, q_probs = torch.arange(V).expand(4, V).clone(), torch.full((4, V), 1.0 / V, dtype=torch.float64)
    p = eng.cut_at_finish(req, Proposal(toks.clone(), q_ids, q_probs))
    assert p.tokens.tolist() == [other, e] and p.q_ids.shape == (2, V) and p.q_probs.shape == (2, V)
    p = eng.cut_at_finish(req, Proposal(torch.tensor([other, other])))  # no EOS, no stop: unchanged
    assert p.tokens.tolist() == [other, other] and p.q_probs is None


def test_distribution_with_eos_cut(tiny_eos):
    (e,) = tiny_eos.eos_token_ids
    exact = exact_distribution(tiny_eos, PROMPT, M, SamplingConfig(**SAMPLING), tiny_eos.eos_token_ids)
    p, impossible, cut = _chi_square(Engine(tiny_eos, PeakedProposer(e), "dspine"), exact, 600)
    assert impossible == 0
    assert cut > 50, cut  # the cut really ran
    assert p > 1e-3, p


def test_distribution_dropping_the_eos_proposal_fails(tiny_eos):
    """Negative control: the chi-square test must reject a cut that drops the EOS proposal."""
    (e,) = tiny_eos.eos_token_ids
    exact = exact_distribution(tiny_eos, PROMPT, M, SamplingConfig(**SAMPLING), tiny_eos.eos_token_ids)
    p, _, cut = _chi_square(DropEos(tiny_eos, PeakedProposer(e), "dspine"), exact, 2500)
    assert cut > 50, cut
    assert p < 1e-6, p


REPEAT_PROMPT = ("Repeat this code exactly, nothing else:\n\ndef area(w, h):\n    return w * h\n\n\n"
                 "def perimeter(w, h):\n    return 2 * (w + h)\n")


def test_greedy_copies_cut_at_a_stop_equal_ar(smol):
    """A copy of the prompt runs through the stop string; the cut keeps only the proposals
    up to it, and the output is ``ar``'s with the same stop."""
    ids = smol.encode_prompt(REPEAT_PROMPT, chat=True)
    ar = Engine(smol, None, "ar")
    eng = Engine(smol, NgramProposer(16, 4, 1), "dspine")  # copies of up to 15 tokens every cycle
    cuts = []
    orig = eng.cut_at_finish

    def recording(req, prop):
        before = int(prop.tokens.shape[0])
        out = orig(req, prop)
        if int(out.tokens.shape[0]) < before:
            cuts.append((before, int(out.tokens.shape[0])))
        return out

    eng.cut_at_finish = recording
    for stop in (["perimeter"], ["w + h"], ["\n\n\n"]):
        want = ar.generate(ids, SamplingConfig(), 64, stop=stop)
        got = eng.generate(ids, SamplingConfig(), 64, stop=stop)
        assert got.token_ids == want.token_ids and got.text == want.text, stop
        assert got.finish_reason == want.finish_reason == "stop", (stop, want.text)
    assert cuts, "no copy ran into a stop string: the test proves nothing"


def test_batched_copies_cut_at_a_stop_equal_ar(smol):
    """The batched engine (``serve``) cuts its chains the same way: three requests with
    different stop strings, continuous batching, token for token ``ar``'s."""
    from dspine.core.batch import BatchEngine

    ids = smol.encode_prompt(REPEAT_PROMPT, chat=True)
    stops = [["perimeter"], ["w + h"], ["\n\n\n"]]
    ar = Engine(smol, None, "ar")
    want = [ar.generate(ids, SamplingConfig(), 48, stop=s).token_ids for s in stops]
    eng = Engine(smol, NgramProposer(16, 4, 1), "dspine")
    cuts = []
    orig = eng.cut_at_finish

    def recording(req, prop):
        before = int(prop.tokens.shape[0])  # the cut shortens the proposal in place
        out = orig(req, prop)
        cuts.append(int(out.tokens.shape[0]) < before)
        return out

    eng.cut_at_finish = recording
    got = BatchEngine(eng, max_running=3).generate_many([ids] * 3, SamplingConfig(), 48, stop=stops)
    assert [r.token_ids for r in got] == want
    assert any(cuts), "no batched chain was cut: the test proves nothing"
