"""Candidate pass of the final stage and the DFlash-style parallel proposals.

The optimized path (int8 coarse head, exact rescoring, sparse q) is checked against
the reference (exact head over the full vocabulary) on a 256-token target where the
coarse pool (64) and K (16) are real truncations.
"""
from __future__ import annotations

import pytest
import torch

from dspine.config import SamplingConfig
from dspine.drafter.checkpoint import random_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.drafter.final_stage import QuantizedHead, candidates, parallel_argmax


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


def test_parallel_argmax_is_exact_argmax(drafter, rows):
    toks = parallel_argmax(drafter, rows, QuantizedHead(drafter.head))
    assert toks.dtype == torch.int64
    assert torch.equal(toks, torch.argmax(rows @ drafter.head.T, dim=-1))
    assert torch.equal(parallel_argmax(drafter, rows, None), toks)  # reference path
    assert parallel_argmax(drafter, rows[:0], None).shape == (0,)


def test_dflash_greedy_proposals_match_reference_and_sampled_q_is_dense(tiny256):
    """Greedy: the candidate-pass argmax equals the full-vocabulary argmax of the reference
    proposer, block by block; sampled: dense q over all V tokens (spec section 10)."""
    from dspine.core.engine import Engine
    d = random_drafter(tiny256, mode="dflash", block_size=8, seed=5, head_topk=16, coarse_k=64)
    prompt = list(range(10, 40))
    fast, ref = DrafterProposer(d), DrafterProposer(d, use_quantized_head=False)
    blocks = []
    for prop in (fast, ref):
        eng = Engine(tiny256, prop, "dflash")
        req = eng.start(prompt, SamplingConfig(), 24)
        seen, orig = [], prop.propose
        prop.propose = lambda *a, **k: seen.append(orig(*a, **k)) or seen[-1]
        while not req.finished:
            eng.step(req)
        blocks.append([p.tokens.tolist() for p in seen])
    assert blocks[0] == blocks[1] and len(blocks[0]) > 2
    state = fast.new_state(prompt)
    fast.commit(state, torch.randn(len(prompt) - 1, d.fc.in_features), 0)
    p = fast.propose(state, prompt[-1], len(prompt) - 1, 7, SamplingConfig(temperature=0.8, seed=1),
                     torch.Generator().manual_seed(1))
    assert p.q_ids is None and p.q_probs.shape == (7, tiny256.vocab_size)


def test_dflash_proposer_uses_shared_candidate_pass(tiny256):
    """Both modes build the quantized head; the reference proposer has none."""
    for mode in ("dspine", "dflash"):
        d = random_drafter(tiny256, mode=mode, block_size=4, seed=1)
        assert DrafterProposer(d).qhead is not None
        assert DrafterProposer(d, use_quantized_head=False).qhead is None


# -- block-causal truncation: a short verification drafts only the rows it needs --------------
def _ctx(d, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, T, d.fc.in_features, generator=g)  # [1, T, F*d]
    pos = torch.arange(T)[None]  # [1, T]
    return d.context_kv(feats, pos), pos, torch.ones(1, T, dtype=torch.bool)


def test_block_causal_rows_equal_the_first_rows_of_the_full_block(tiny256):
    """DSpine (causal block, bridge from row i-1 to i, row embedding on): running R rows
    gives the first R rows of the full block for h, h_pre, r and c; the DFlash-style
    bidirectional block refuses to run fewer rows than B."""
    d = random_drafter(tiny256, mode="dspine", block_size=8, seed=3, row_embedding=True)
    kv, pos, valid = _ctx(d, 20)
    a, ap = torch.tensor([[65, 66]]), torch.tensor([[20, 23]])  # two blocks per sequence
    with torch.no_grad():
        full = d.forward_blocks(a, ap, kv, pos, valid)  # [1, 2, 8, ...]
        for R in (1, 2, 5, 8):
            part = d.forward_blocks(a, ap, kv, pos, valid, rows=R)
            assert part.h.shape[2] == R
            for name in ("h", "h_pre", "r", "c"):
                torch.testing.assert_close(getattr(part, name), getattr(full, name)[:, :, :R],
                                           rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="rows must be in 1..8"):
        d.forward_blocks(a, ap, kv, pos, valid, rows=9)
    df = random_drafter(tiny256, mode="dflash", block_size=8, seed=3)
    kv, pos, valid = _ctx(df, 20)
    with pytest.raises(ValueError, match="bidirectional"):
        df.forward_blocks(a, ap, kv, pos, valid, rows=4)
    assert df.forward_blocks(a, ap, kv, pos, valid, rows=8).h.shape[2] == 8


@pytest.mark.parametrize("greedy", [True, False])
def test_dspine_short_proposals_equal_full_block_proposals(tiny256, greedy):
    """For every verification length n, the DSpine proposer (n + 1 rows) proposes the same
    tokens and the same sparse q as the same proposer forced to run the full block."""
    d = random_drafter(tiny256, mode="dspine", block_size=8, seed=4, head_topk=16, coarse_k=64)
    prop = DrafterProposer(d)
    state = prop.new_state([])
    prop.commit(state, torch.randn(30, d.fc.in_features, generator=torch.Generator().manual_seed(2)), 0)
    sampling = SamplingConfig() if greedy else SamplingConfig(temperature=0.9, top_p=0.95, seed=7)
    orig = d.forward_blocks
    ran = []

    def full_block(*args, rows=None):
        return orig(*args)

    def spy(*args, rows=None):
        ran.append(rows)
        return orig(*args, rows=rows)

    for n in range(1, 8):
        outs = []
        for fb in (spy, full_block):
            d.forward_blocks = fb
            try:
                outs.append(prop.propose(state, 70, 30, n, sampling, torch.Generator().manual_seed(n)))
            finally:
                del d.forward_blocks
        short, ref = outs
        assert ran[-1] == n + 1
        assert short.tokens.tolist() == ref.tokens.tolist() and len(short.tokens) == n
        if not greedy:
            assert torch.equal(short.q_ids, ref.q_ids)
            torch.testing.assert_close(short.q_probs, ref.q_probs, rtol=1e-5, atol=1e-7)  # fp32 tables, other shapes
