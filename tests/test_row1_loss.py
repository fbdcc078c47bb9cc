"""The dense row-1 term (``drafter_losses(row1_anchors=...)``): extra anchors trained on
row 1 only, in two-row blocks over the same context."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn

from dspine.train.losses import block_labels, drafter_losses, final_stage_loss, row1_loss
from test_soft_labels import _setup

pytestmark = pytest.mark.usefixtures("one_thread")


def _full_block_row1(d, batch, anchors, feats, vs, shift: int = 0):
    """Row 1's continuous + final-stage CE from the *full* B-row block at ``anchors``,
    labels taken ``shift`` positions off (0: the right ones)."""
    b, T = batch.ids.shape
    pos = torch.arange(T)[None].expand(b, T)
    ctx = d.context_kv(feats, pos)
    x0 = torch.gather(batch.ids, 1, anchors)
    out = d.forward_blocks(x0, anchors, ctx, pos, batch.valid)
    lab = block_labels(batch, (anchors + shift).clamp(max=T - 1), 2)[:, :, 1:]
    Hs = d.head[vs]
    remap = torch.full((d.head.shape[0],), -100, dtype=torch.long)
    remap[vs] = torch.arange(vs.shape[0])
    tgt = torch.where(lab >= 0, remap[lab.clamp_min(0)], lab)
    z = d.norm_f(out.h[:, :, 1:2]) @ Hs.T
    ok = tgt >= 0
    n = ok.sum().clamp_min(1)
    ce = (Fn.cross_entropy(z.reshape(-1, z.shape[-1]), tgt.reshape(-1), ignore_index=-100,
                           reduction="none").view_as(tgt) * ok).sum() / n
    sub = type(out)(h=out.h[:, :, :2], h_pre=out.h_pre[:, :, :2], r=out.r[:, :, :2], c=out.c[:, :, :2])
    fs = final_stage_loss(d, sub, z.detach(), tgt, lab, x0, Hs, torch.ones_like(tgt, dtype=torch.float32), ok,
                          d.cfg.head_topk, n.float())
    return ce + fs, remap, Hs, ctx, pos


def test_row1_term_is_row_1_of_the_full_block_and_a_shifted_label_is_not():
    """Two-row blocks give exactly row 1 of the full block (the block is causal), so the
    dense term is the full block's row-1 loss at those anchors; labels one position off
    (negative control) give a different loss."""
    _, d, batch, anchors, feats = _setup()
    vs = torch.arange(0, 256, 2)
    want, remap, Hs, ctx, pos = _full_block_row1(d, batch, anchors, feats, vs)
    got = row1_loss(d, ctx, pos, batch, anchors, Hs, remap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    off, *_ = _full_block_row1(d, batch, anchors, feats, vs, shift=1)
    assert not torch.allclose(got, off, rtol=1e-3)


def test_row1_term_adds_to_the_loss_with_its_weight_and_trains_row_1():
    _, d, batch, anchors, feats = _setup()
    vs = torch.arange(0, 256, 2)
    base = drafter_losses(d, feats, batch, anchors, 7.0, vs)
    a1 = anchors.flip(1)
    both = drafter_losses(d, feats, batch, anchors, 7.0, vs, row1_anchors=a1, row1_weight=0.5)
    assert float(both["r1"]) > 0
    torch.testing.assert_close(both["loss"], base["loss"] + 0.5 * both["r1"], rtol=1e-5, atol=1e-6)
    assert float(base["r1"]) == 0.0


def test_a_bidirectional_drafter_has_no_two_row_block():
    tg, d, batch, anchors, feats = _setup()
    d.cfg.block_causal = False
    with pytest.raises(ValueError, match="bidirectional"):
        drafter_losses(d, feats, batch, anchors, 7.0, torch.arange(0, 256, 2), row1_anchors=anchors)


def test_dspine_train_takes_the_dense_row1_term_and_resumes_it_exactly(tmp_path):
    """``TrainConfig.row1_anchors`` (``dspine train --row1-anchors``): the step's loss gains
    the term (reported as ``r1``), and a run stopped at step 3 and resumed continues it as if
    never stopped (its anchors are drawn from the step's own seed). A DFlash-style drafter
    is refused when the trainer is built."""
    from dspine.target.adapter import load_target
    from dspine.train.loop import Trainer
    from test_train import _cfg, _seqs, _tc

    tg = load_target("random:llama", vocab_size=256)
    seqs = _seqs()
    plain = Trainer(tg, _cfg(tg), seqs, tmp_path / "plain", _tc(steps=6, save_every=100, lr=1e-2))
    dense = Trainer(tg, _cfg(tg), seqs, tmp_path / "dense", _tc(steps=6, save_every=100, lr=1e-2, row1_anchors=8))
    p0, d0 = plain.train_step(), dense.train_step()
    assert "r1" not in p0 and d0["r1"] > 0
    assert d0["ce"] == pytest.approx(p0["ce"], rel=1e-5)  # the same weights and block anchors at step 1
    assert d0["loss"] == pytest.approx(p0["loss"] + d0["r1"], rel=1e-5)
    want = [d0["loss"]] + [dense.train_step()["loss"] for _ in range(5)]
    a = Trainer(tg, _cfg(tg), seqs, tmp_path / "split", _tc(steps=6, save_every=100, lr=1e-2, row1_anchors=8))
    got = [a.train_step()["loss"] for _ in range(3)]
    a.save()
    b = Trainer(tg, _cfg(tg), seqs, tmp_path / "split", _tc(steps=6, save_every=100, lr=1e-2, row1_anchors=8))
    assert b.resume() and b.step == 3
    got += [b.train_step()["loss"] for _ in range(3)]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    with pytest.raises(ValueError, match="row1-anchors"):
        Trainer(tg, _cfg(tg, "dflash"), seqs, tmp_path / "df", _tc(row1_anchors=8))
    with pytest.raises(ValueError, match="row1_weight"):
        _tc(row1_anchors=8, row1_weight=float("nan"))
