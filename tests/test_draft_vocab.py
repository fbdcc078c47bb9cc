"""The drafter's draft vocabulary (dspine.drafter.vocab, ``--draft-vocab``).

The candidate pass then scores only the subset's rows of the head and maps its columns back
to target ids. The drafter only proposes, so the output must stay the target's: greedy
equality with ``ar`` on the real target with the shipped checkpoint's subset, and the exact
sampled distribution on a tiny target (chi-square) with a broken verifier as the negative
control that must fail. Proposals must be subset ids (a pass that forgot to map its columns
back would propose ids below the subset's size, which this test's subset excludes).
"""
from __future__ import annotations

import json

import pytest
import torch

from dspine.config import SpeculativeConfig
from dspine.drafter.checkpoint import random_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.drafter.vocab import (FILE, DraftVocabError, coverage, frequent_tokens, load_draft_vocab, resolve,
                                save_draft_vocab)
from dspine.drafter.final_stage import candidates
from conftest import assert_greedy_equals_ar
from test_distribution import assert_exact_and_broken_verifier_fails, strong_bridge_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


def test_frequent_tokens_and_coverage():
    seqs = [([5, 5, 1, 2, 2, 2], 2), ([9, 1, 2, 7], 1)]  # responses: 1 2 2 2 | 1 2 7
    ids = frequent_tokens(seqs, 2, 10)
    assert ids.tolist() == [1, 2]
    assert coverage(ids, seqs) == pytest.approx(6 / 7)
    assert coverage(torch.tensor([7]), seqs) == pytest.approx(1 / 7)


def test_files_round_trip_and_bad_ones_are_refused(tmp_path):
    save_draft_vocab(tmp_path, torch.tensor([9, 3, 4, 1]), {"source": "test"})
    assert load_draft_vocab(tmp_path, 10, 2).tolist() == [1, 3, 4, 9]
    assert json.loads((tmp_path / FILE).read_text())["size"] == 4
    assert load_draft_vocab(tmp_path / "nothing", 10, 2) is None and load_draft_vocab(None, 10, 2) is None
    assert resolve("full", tmp_path, 10, 2) is None
    assert resolve("auto", tmp_path, 10, 2).tolist() == [1, 3, 4, 9]
    with pytest.raises(DraftVocabError, match="fewer than the final stage's 5"):
        load_draft_vocab(tmp_path, 10, 5)
    with pytest.raises(DraftVocabError, match="outside the drafter's vocabulary"):
        load_draft_vocab(tmp_path, 9, 2)
    with pytest.raises(DraftVocabError, match="SpeculativeConfig.draft_vocab 'half' is unknown"):
        resolve("half", tmp_path, 10, 2)
    with pytest.raises(DraftVocabError, match="SpeculativeConfig.draft_vocab subset: .* has no draft_vocab.json"):
        resolve("subset", tmp_path / "nothing", 10, 2)
    assert resolve("auto", tmp_path / "nothing", 10, 2) is None
    for body, why in (("{", "damaged"), ('{"ids": [1, 1, 2]}', "repeated ids"), ('{"ids": "12"}', "damaged"),
                      ('{"size": 3}', "damaged")):
        (tmp_path / FILE).write_text(body)
        with pytest.raises(DraftVocabError, match=why):
            load_draft_vocab(tmp_path, 10, 2)


def test_candidates_come_from_the_subset_and_map_back_to_target_ids(tiny256):
    d = random_drafter(tiny256, mode="dspine", block_size=8, seed=1)
    x = d.norm_f(torch.randn(5, tiny256.hidden_size))
    full = DrafterProposer(d, head_kernel="exact")
    everything = DrafterProposer(d, head_kernel="exact", vocab=torch.arange(256))
    assert torch.equal(candidates(d, x, 16, 128, full.qhead), candidates(d, x, 16, 128, everything.qhead))
    upper = torch.arange(128, 256)  # a pass that forgot to map back would return ids < 128
    sub = DrafterProposer(d, head_kernel="exact", vocab=upper)
    got = candidates(d, x, 16, 128, sub.qhead)
    assert bool((got >= 128).all()) and sub.kernel_info()["draft_vocab"] == 128
    # the subset's top candidates are the full pass's top candidates restricted to the subset
    exact_scores = x @ d.head.T
    masked = exact_scores.clone()
    masked[:, :128] = -float("inf")
    assert torch.equal(got.sort(dim=1).values, torch.topk(masked, 16, dim=1).indices.sort(dim=1).values)
    with pytest.raises(ValueError, match="SpeculativeConfig.draft_vocab"):
        DrafterProposer(d, use_quantized_head=False, vocab=upper)


def test_subset_sampling_matches_target_and_a_broken_verifier_fails(tiny, monkeypatch):
    # the distribution tests' strong-bridge DSpine drafter (seed 3) over 5 of the 8 ids
    assert_exact_and_broken_verifier_fails(
        tiny, lambda: strong_bridge_drafter(tiny, 3, vocab=torch.tensor([1, 3, 4, 6, 7])), monkeypatch)


def test_shipped_subset_greedy_equals_ar_on_the_real_target():
    from dspine.build import build_engine

    target, eng = build_engine(SpeculativeConfig(target="smollm2-135m", drafter=None, mode="dspine",
                                                 verify_policy="fixed", proposer="drafter",
                                                 draft_vocab="subset", linear_backend="aten", tree_budget=0))
    sub = eng.proposer.qhead.ids
    assert eng.proposer.kernel_info()["draft_vocab"] == sub.numel() < target.vocab_size
    assert_greedy_equals_ar(target, eng)


def test_memory_counts_the_draft_vocabulary_rows():
    from dspine.config import DSpineConfig
    from dspine.drafter.memory import estimate

    cfg = DSpineConfig.small()
    full = {r.key: r.bytes for r in estimate(cfg, head_kernels=("int8", "exact")).rows}
    sub = {r.key: r.bytes for r in estimate(cfg, head_kernels=("int8", "exact"), draft_vocab=1024).rows}
    assert full["quantized_head"] == cfg.vocab_size * cfg.target_hidden and "draft_vocab_head" not in full
    assert sub["quantized_head"] == 1024 * cfg.target_hidden and sub["draft_vocab_head"] > 0
