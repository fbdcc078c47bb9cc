"""Copies fused into the DSpine final stage (``--copy-bonus``).

- :func:`inject_copy` / :func:`copy_bonus` place the copied tokens among the candidates
  (own slot when present, else the last-ranked one) and raise exactly the scores of
  following the copy;
- greedy: the hybrid with fused copies emits exactly the ``ar`` ids of the real default
  target, single-request and batched (one drafter forward for several requests);
- sampling: exact-distribution test on a tiny random target with fewer candidates than
  tokens (so injection really replaces candidates), and a negative control that must fail:
  the chain sampled from the fused tables but verified with the q of the unfused ones.
"""
from __future__ import annotations

import collections

import pytest
import torch

from conftest import ar_continuation
from dspine.core.batch import BatchEngine
from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import load_drafter, random_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.drafter.final_stage import copy_bonus, inject_copy
from dspine.proposers import HybridProposer, NgramProposer, make_proposer
from dspine.core.sampling import filter_probs
from test_policy import SAMPLING, exact_distribution, sources_chi_square

pytestmark = pytest.mark.usefixtures("one_thread")


def test_inject_and_bonus():
    cand = torch.tensor([[5, 6, 7], [1, 2, 3], [9, 8, 4]])
    c2, slot = inject_copy(cand, torch.tensor([6, 4, 4, 0]))  # longer than the rows: cut
    assert c2.tolist() == [[5, 6, 7], [1, 2, 4], [9, 8, 4]] and slot.tolist() == [1, 2, 2]
    assert cand.tolist()[1] == [1, 2, 3]  # the input is not modified
    T = torch.zeros(3, 3, 3)
    T2 = copy_bonus(T, slot, 2.5)
    want = torch.zeros(3, 3, 3)
    want[0, :, 1] = 2.5  # row 1: every predecessor slot is the anchor
    want[1, 1, 2] = 2.5  # row 2: only after c_1 (slot 1)
    want[2, 2, 2] = 2.5
    assert torch.equal(T2, want) and not T.any()
    for bad in (-1.0, 1e39, float("nan"), "2"):  # float32 scores overflow near 3.4e38 (NaN q)
        with pytest.raises(ValueError, match="SpeculativeConfig.copy_bonus"):
            HybridProposer(DrafterProposer.__new__(DrafterProposer), NgramProposer(), fuse_bonus=bad)
    with pytest.raises(ValueError, match="copy_bonus needs SpeculativeConfig.proposer hybrid"):
        make_proposer("ngram", None, copy_bonus=1.0)


# -- greedy equality on the real target ------------------------------------------------------------
COPY_PROMPT = ("Repeat this function exactly, then explain it in one sentence:\n"
               "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
               "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
               "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n")


@pytest.fixture(scope="module")
def shipped_dspine(smol):
    from dspine.build import default_drafter_path

    return load_drafter(default_drafter_path("smollm2-135m", "dspine"), smol)


def equal_ar_single_and_batched(smol, prompts: list[list[int]], single_proposer, batch_proposer, n: int = 24):
    """Greedy runs of ``prompts`` (EOS off) by an engine of ``single_proposer`` one at a time and
    by a batched engine of ``batch_proposer``: asserts both emit exactly ``ar``'s ids; returns
    (single results, batched results)."""
    saved = smol.eos_token_ids
    smol.eos_token_ids = frozenset()
    try:
        eng = Engine(smol, single_proposer, "dspine")
        single = [eng.generate(ids, SamplingConfig(), n) for ids in prompts]
        batched = BatchEngine(Engine(smol, batch_proposer, "dspine"), max_running=2).generate_many(
            prompts, SamplingConfig(), n)
    finally:
        smol.eos_token_ids = saved
    for ids, r, b in zip(prompts, single, batched):
        ref = ar_continuation(smol, ids, n)
        assert r.token_ids == ref and b.token_ids == ref
    return single, batched


def test_greedy_fused_equals_ar_single_and_batched(smol, shipped_dspine):
    prompts = [smol.encode_prompt(t, chat=True) for t in (COPY_PROMPT, "List three colors and their hex codes.")]
    single, batched = equal_ar_single_and_batched(
        smol, prompts, make_proposer("hybrid", DrafterProposer(shipped_dspine), copy_bonus=4.0),
        make_proposer("hybrid", DrafterProposer(shipped_dspine), copy_bonus=4.0))
    used = collections.Counter()
    for r in single + batched:
        used.update({k: v["cycles"] for k, v in r.stats.sources.items()})
    assert used["fused"] > 0 and used["ngram"] > 0, used  # the fused chain really ran


# -- exact distribution (tiny random target) ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny8():
    from dspine.target.adapter import load_target

    t = load_target("random:llama", vocab_size=8, seed=0)
    t.eos_token_ids = frozenset()
    return t


PROMPT = [0, 1, 2, 3, 4, 0, 1, 2, 3]
M = 5


@pytest.fixture(scope="module")
def exact(tiny8):
    return exact_distribution(tiny8, PROMPT, M, SamplingConfig(**SAMPLING))


def _drafter(tiny8):
    # 3 candidates of 8 tokens: a copied token is often not among them and gets injected
    return random_drafter(tiny8, block_size=4, head_topk=3, coarse_k=3)


def chi_square(engine: Engine, exact: dict, n_samples: int):
    """``test_policy.sources_chi_square`` of PROMPT, M tokens."""
    return sources_chi_square(engine, PROMPT, M, exact, n_samples)


class CountingDrafter(DrafterProposer):
    """Counts proposals whose copy was injected in place of a candidate."""

    injected = 0

    def _tables(self, out, a, n, copy=None, bonus=0.0):
        cand, T = super()._tables(out, a, n, copy, bonus)
        if copy:
            plain, _ = super()._tables(out, a, n)
            CountingDrafter.injected += int((plain != cand).any())
        return cand, T


@pytest.mark.slow  # --copy-bonus is opt-in; the default suite stays under ~15 min on 2 cores
def test_distribution_fused(tiny8, exact):
    # min_match 1, strong_match 3 (> max_ngram 2): every copy on offer is fused into the chain
    prop = HybridProposer(CountingDrafter(_drafter(tiny8)), NgramProposer(4, 2, 1), strong_match=3, fuse_bonus=3.0)
    eng = Engine(tiny8, prop, "dspine")
    CountingDrafter.injected = 0
    p, impossible, used = chi_square(eng, exact, 400)
    assert impossible == 0
    assert p > 1e-3, p
    assert used["fused"] > 200, used
    assert CountingDrafter.injected > 50, CountingDrafter.injected  # injection really happened


class ForgetsBonusDrafter(DrafterProposer):
    """BROKEN: samples the chain from the fused tables but reports the q of the same
    candidates without the bonus (the verifier then divides by the wrong q)."""

    def _tables(self, out, a, n, copy=None, bonus=0.0):
        self._plain = super()._tables(out, a, n, copy, 0.0)
        return super()._tables(out, a, n, copy, bonus)

    def propose(self, state, anchor, anchor_pos, n, sampling, gen, copy=None, bonus=0.0):
        p = super().propose(state, anchor, anchor_pos, n, sampling, gen, copy=copy, bonus=bonus)
        if not copy or p.q_probs is None:
            return p
        cand, T0 = self._plain
        p.q_probs = q_along(cand, T0, p.tokens, sampling)
        return p


def q_along(cand: torch.Tensor, T: torch.Tensor, tokens: torch.Tensor, sampling) -> torch.Tensor:
    """The q a chain over tables ``T`` [n, K, K] (candidates ``cand`` [n, K]) would report
    for the path ``tokens``: row i's filtered softmax given the predecessor's slot."""
    qs, j = [], 0
    for i in range(len(tokens)):
        qs.append(filter_probs(T[i, j], sampling))
        j = int((cand[i] == tokens[i]).nonzero()[0, 0])
    return torch.stack(qs)


@pytest.mark.slow  # --copy-bonus is opt-in; the default suite stays under ~15 min on 2 cores
def test_distribution_fused_wrong_q_fails(tiny8, exact):
    """Negative control: the chi-square test must reject the fused chain verified with the
    unfused q."""
    prop = HybridProposer(ForgetsBonusDrafter(_drafter(tiny8)), NgramProposer(4, 2, 1), strong_match=3,
                          fuse_bonus=3.0)
    p, _, used = chi_square(Engine(tiny8, prop, "dspine"), exact, 600)
    assert used["fused"] > 300, used
    assert p < 1e-6, p
