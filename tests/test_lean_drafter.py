"""The lean drafter forward (dspine.runtime.lean_drafter): one C++ call per block forward.

It must compute what :meth:`DSpineDrafter.forward_blocks` computes (float32, another order of
the sums): compared here on a drafter with a ring-buffer context holding invalid slots,
positions after the anchor and positions outside the window, for every row count. The
drafter only proposes, so the output must stay the target's: greedy equality with ``ar`` on
the real target runs through it here, and the exact sampled distribution (chi-square, with a
broken verifier as the negative control) in ``tests/test_drafter_linears.py``, whose q8
drafter takes the lean forward.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_greedy_equals_ar
from dspine.config import SpeculativeConfig
from dspine.drafter.checkpoint import random_drafter
from dspine.proposers.drafter import DrafterProposer
from dspine.core.engine import Engine
from dspine.runtime import blockq as B
from dspine.runtime.lean_drafter import LeanDrafter, block_forward, lean_drafter_support
from dspine.drafter.q8 import quantize_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


def _kernels_or_skip():
    if B.kernels(progress=False) is None:
        pytest.skip(f"the blockq kernels cannot be built here: {B.unavailable_reason()}")


def _context(d, cap: int, anchor_pos: int, seed: int = 0):
    """Per-layer context K/V [1, kv, cap, hd] of random features, positions shuffled over the
    ring buffer, some slots invalid, some at or after the anchor."""
    g = torch.Generator().manual_seed(seed)
    cfg = d.cfg
    feats = torch.randn(1, cap, len(cfg.feature_layers) * cfg.target_hidden, generator=g)
    pos = torch.randperm(anchor_pos + 4, generator=g)[:cap][None]  # some >= anchor_pos: never read
    with torch.no_grad():
        kv = d.context_kv(feats, pos)
    valid = torch.rand(1, cap, generator=g) > 0.2
    return kv, pos, valid


@pytest.mark.parametrize("window", [2048, 9])
def test_lean_block_forward_equals_the_pytorch_forward(tiny256, window):
    _kernels_or_skip()
    d = random_drafter(tiny256, mode="dspine", block_size=8, seed=1, window=window, msg_dim=32)
    with torch.no_grad():  # a strong bridge, so the messages matter
        for w in d.write:
            w.weight.mul_(30)
    q = quantize_drafter(d)
    assert isinstance(q._lean, LeanDrafter) and block_forward(q) == q._lean.forward_blocks
    kv, pos, valid = _context(q, cap=24, anchor_pos=30)
    a, ap = torch.tensor([[7]]), torch.tensor([[30]])
    for rows in (1, 2, 5, 8):
        with torch.no_grad():
            want = q.forward_blocks(a, ap, kv, pos, valid, rows=rows)
            got = q._lean.forward_blocks(a, ap, kv, pos, valid, rows=rows)
        for f in ("h", "h_pre", "r", "c"):
            x, y = getattr(want, f), getattr(got, f)
            assert x.shape == y.shape, f
            torch.testing.assert_close(y, x, rtol=2e-4, atol=2e-4 * float(x.abs().max()))
    # negative control: another anchor position reads other context and positions
    with torch.no_grad():
        other = q._lean.forward_blocks(a, torch.tensor([[26]]), kv, pos, valid, rows=8)
    assert not torch.allclose(other.h, want.h, rtol=1e-3, atol=1e-3)


def test_where_the_lean_forward_does_not_run(tiny256, monkeypatch):
    _kernels_or_skip()
    d = random_drafter(tiny256, mode="dspine", block_size=8, seed=1, msg_dim=32)
    assert "Q8_0" in lean_drafter_support(d)  # float32 linears: the PyTorch forward
    assert block_forward(d) == d.forward_blocks
    assert "DSpine drafters" in lean_drafter_support(quantize_drafter(random_drafter(tiny256, mode="dflash",
                                                                                      block_size=8, seed=1)))
    monkeypatch.setenv("DSPINE_LEAN", "0")
    assert quantize_drafter(d)._lean is None
    monkeypatch.delenv("DSPINE_LEAN")
    q = quantize_drafter(d)
    with pytest.raises(ValueError, match="rows must be in 1..8"):
        q._lean.forward_blocks(torch.tensor([[1]]), torch.tensor([[3]]), *(_context(q, 4, 3)), rows=9)
    with pytest.raises(ValueError, match="one block"):
        q._lean.forward_blocks(torch.tensor([[1, 2]]), torch.tensor([[3, 4]]), *(_context(q, 4, 3)), rows=2)


def test_lean_drafter_greedy_equals_ar_on_the_real_target():
    _kernels_or_skip()
    from dspine.build import build_engine

    target, eng = build_engine(SpeculativeConfig(target="smollm2-135m", drafter=None, mode="dspine",
                                                 verify_policy="fixed", proposer="drafter",
                                                 drafter_linears="q8", linear_backend="aten", tree_budget=0))
    assert eng.proposer.drafter._lean is not None
    assert_greedy_equals_ar(target, eng)


def test_batched_proposals_on_the_lean_forward_keep_greedy_equal_to_ar(tiny256, monkeypatch):
    _kernels_or_skip()
    from dspine.core.batch import BatchEngine
    from dspine.runtime import lean_drafter

    calls = []
    real = lean_drafter.LeanDrafter.forward_blocks
    monkeypatch.setattr(lean_drafter.LeanDrafter, "forward_blocks",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    prop = DrafterProposer(random_drafter(tiny256, "dspine", seed=2, msg_dim=32), linears="q8")
    assert prop.drafter._lean is not None
    prompts = [tiny256.encode_prompt(p) for p in ("hello world", "a", "The quick brown fox", "xyz" * 9)]
    lens = [20, 9, 30, 14]
    ar = Engine(tiny256, None, "ar")
    want = [ar.generate(p, max_new_tokens=m).token_ids for p, m in zip(prompts, lens)]
    got = BatchEngine(Engine(tiny256, prop, "dspine"), 4).generate_many(prompts, max_new_tokens=lens)
    assert [g.token_ids for g in got] == want
    assert len(calls) > len(lens)  # the batched cycles ran the lean forward


def test_lean_context_projection_and_tables_equal_the_pytorch_ones(tiny256):
    """The context projection (W_fc, norm_ctx, each layer's k/v and rotary embedding) and the
    final stage's conditional tables in the lean drafter compute what the PyTorch modules do
    (float32, another order of the sums), for row 1 (the anchor in every slot) and later rows."""
    _kernels_or_skip()
    from dspine.drafter.final_stage import conditional_tables
    import dspine.runtime.lean_drafter as LD

    d = random_drafter(tiny256, mode="dspine", block_size=8, seed=2, msg_dim=32)
    with torch.no_grad():
        for w in d.write:
            w.weight.mul_(30)
    q = quantize_drafter(d)
    assert q._lean.has_context
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 5, len(q.cfg.feature_layers) * q.cfg.target_hidden, generator=g)
    pos = torch.tensor([[3, 4, 9, 10, 11]])
    with torch.no_grad():
        want = q.context_kv(feats, pos)
    got = q._lean.context_kv(feats, pos)
    assert len(got) == len(want) == q.cfg.num_layers
    for (kw, vw), (kg, vg) in zip(want, got):
        assert kg.shape == kw.shape and vg.shape == vw.shape
        assert torch.allclose(kg, kw, atol=1e-4, rtol=1e-4) and torch.allclose(vg, vw, atol=1e-4, rtol=1e-4)
    kv, cpos, valid = _context(q, cap=24, anchor_pos=30)
    with torch.no_grad():
        out = q.forward_blocks(torch.tensor([[7]]), torch.tensor([[30]]), kv, cpos, valid, rows=5)
    n, K = 4, 6
    cand = torch.randint(q.cfg.vocab_size, (1, n, K), generator=g)
    args = (out.h_pre[:, 0, :n + 1], out.r[:, 0, :n + 1], out.c[:, 0, :n + 1], torch.tensor([7]), cand)
    got_t = conditional_tables(q, *args)  # the lean path
    lean, q._lean = q._lean, None
    try:
        with torch.no_grad():
            want_t = conditional_tables(q, *args)  # the PyTorch modules
    finally:
        q._lean = lean
    assert got_t.shape == want_t.shape == (1, n, K, K)
    assert torch.allclose(got_t, want_t, atol=1e-3, rtol=1e-4), (got_t - want_t).abs().max()
    assert torch.equal(got_t[0, 0], got_t[0, 0, :1].expand(K, K))  # row 1: every slot holds the anchor
    assert not torch.allclose(got_t[0, 1, 0], got_t[0, 1, 1])  # later rows depend on the predecessor
    assert LD.lean_tables(q, args[0], cand.expand(2, n, K)) is None  # batched blocks keep the PyTorch path
    assert LD.lean_tables(q, args[0], cand.int()) is None  # int32 ids: the PyTorch path, which takes them
    assert torch.allclose(conditional_tables(q, *args[:4], cand.int()), want_t, atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="one request"):
        q._lean.context_kv(feats.expand(2, -1, -1), pos.expand(2, -1))
    with pytest.raises(RuntimeError, match="int64"):  # the C++ checks what it reads
        q._lean.impl.tables(args[0][0], args[1][0], args[2][0], 7, cand[0].int())
    with pytest.raises(RuntimeError, match="out of range"):
        q._lean.impl.tables(args[0][0], args[1][0], args[2][0], 7, torch.full((n, K), q.cfg.vocab_size))
    strided = torch.arange(3, 13)[::2]  # a non-contiguous pos: the same K as its contiguous copy
    a_, b_ = q._lean.impl.project(feats[0], strided), q._lean.impl.project(feats[0], strided.contiguous())
    assert all(torch.equal(x, y) for x, y in zip(a_, b_))
