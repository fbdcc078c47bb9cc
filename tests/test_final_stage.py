"""Candidate pass of the final stage and the DFlash-style parallel proposals.

The optimized path (int8 coarse head, exact rescoring, sparse q) is checked against
the reference (exact head over the full vocabulary) on a 256-token target where the
coarse pool (64) and K (16) are real truncations.
"""
from __future__ import annotations

import pytest
import torch

from dspine.config import SamplingConfig
from dspine.draft import DrafterProposer, random_drafter
from dspine.final_stage import QuantizedHead, candidates, parallel_chain
from dspine.sampling import filter_probs


@pytest.fixture(scope="module")
def drafter(tiny256):
    return random_drafter(tiny256, mode="dflash", block_size=8, seed=5, head_topk=16, coarse_k=64)


@pytest.fixture(scope="module")
def rows(drafter):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, drafter.cfg.target_hidden, generator=g)  # [300, d]
    return drafter.norm_f(x).detach()


def test_quantized_candidates_match_exact_topk(drafter, rows):
    """Coarse int8 pool + exact rescoring returns the exact top-K (as sets) on every row."""
    q = QuantizedHead(drafter.head)
    fast = candidates(drafter, rows, 16, 64, q)  # [300, 16]
    ref = torch.topk(rows @ drafter.head.T, 16, dim=-1).indices  # [300, 16]
    assert all(set(a.tolist()) == set(b.tolist()) for a, b in zip(fast, ref))
    # and the order is by exact score: first candidate == exact argmax
    assert torch.equal(fast[:, 0], ref[:, 0])


def test_parallel_chain_greedy_is_exact_argmax(drafter, rows):
    q = QuantizedHead(drafter.head)
    ch = parallel_chain(drafter, rows, SamplingConfig(), None, q)
    assert ch.q_ids is None and ch.tokens.dtype == torch.int64
    assert torch.equal(ch.tokens, torch.argmax(rows @ drafter.head.T, dim=-1))
    # the reference path (no quantized head) gives the same tokens
    assert torch.equal(parallel_chain(drafter, rows, SamplingConfig(), None, None).tokens, ch.tokens)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.7, seed=1),
                                      SamplingConfig(temperature=1.0, top_p=0.9, seed=1),
                                      SamplingConfig(temperature=1.3, top_k=5, min_p=0.05, seed=1)])
def test_parallel_chain_sparse_q(drafter, rows, sampling):
    """q_i = filter_probs(exact scores of the K candidates); y_i is one of them with q > 0."""
    x = rows[:40]
    gen = torch.Generator().manual_seed(3)
    ch = parallel_chain(drafter, x, sampling, gen, QuantizedHead(drafter.head))
    assert ch.q_ids.shape == (40, 16) and ch.q_probs.dtype == torch.float64
    z = torch.gather(x @ drafter.head.T, 1, ch.q_ids).float()  # [40, 16] exact scores
    ref = torch.stack([filter_probs(z[i], sampling) for i in range(40)])
    assert torch.allclose(ch.q_probs, ref, atol=1e-6)
    assert torch.allclose(ch.q_probs.sum(-1), torch.ones(40, dtype=torch.float64))
    for i in range(40):
        j = (ch.q_ids[i] == ch.tokens[i]).nonzero()
        assert j.numel() == 1 and ch.q_probs[i, j[0, 0]] > 0


def test_dflash_proposer_uses_shared_candidate_pass(tiny256):
    """Both modes build the quantized head; the reference proposer has none."""
    for mode in ("dspine", "dflash"):
        d = random_drafter(tiny256, mode=mode, block_size=4, seed=1)
        assert DrafterProposer(d).qhead is not None
        assert DrafterProposer(d, use_quantized_head=False).qhead is None
