"""Soft labels (``dspine train --soft-labels K``): the target's own top-K
next-token distribution from the feature forward, mixed into each row's CE."""
from __future__ import annotations

import pytest
import torch

from dspine.drafter.model import DSpineDrafter
from dspine.target.adapter import load_target
from dspine.train.loop import Trainer
from dspine.train.losses import collate, drafter_losses, sample_anchors, soft_block_targets, target_topk
from test_train import _cfg, _seqs
from test_train import _tc as _train_tc

pytestmark = pytest.mark.usefixtures("one_thread")


def _tc(**kw):
    return _train_tc(**{"batch_size": 3, "max_len": 40, "memo_features": True, **kw})


def _setup(vocab_subset=None):
    tg = load_target("random:llama", vocab_size=256)
    cfg = _cfg(tg)
    torch.manual_seed(0)
    d = DSpineDrafter(cfg)
    d.bind_target(tg.input_embeddings(), tg.output_head())
    batch = collate(_seqs(3), 40)
    anchors = sample_anchors(batch, 5, torch.Generator().manual_seed(1))
    feats = torch.randn(3, batch.ids.shape[1], len(cfg.feature_layers) * cfg.target_hidden)
    return tg, d, batch, anchors, feats


def _one_hot_soft(batch, shift: int, K: int = 3):
    """Soft targets whose top-1 is the token ``shift`` positions after each position, prob 1."""
    ids = torch.zeros(*batch.ids.shape, K, dtype=torch.int32)
    nxt = torch.roll(batch.ids, -shift, dims=1)
    ids[..., 0] = nxt.to(torch.int32)
    ids[..., 1] = (nxt + 1) % 256
    ids[..., 2] = (nxt + 2) % 256
    p = torch.zeros(*batch.ids.shape, K, dtype=torch.float16)
    p[..., 0] = 1.0
    return ids, p


@pytest.mark.parametrize("subset", [False, True])
def test_one_hot_soft_labels_equal_the_hard_loss_and_a_shifted_one_does_not(subset):
    """Row k of a block is the token after position anchor + k - 1: soft targets built from
    the next token (a one-hot target distribution) give exactly the hard-label CE; built
    one position off (negative control) they do not."""
    tg, d, batch, anchors, feats = _setup()
    vs = torch.arange(0, 256, 1) if subset else None  # a subset containing every id: remap path
    hard = drafter_losses(d, feats, batch, anchors, 7.0, vs)
    soft = drafter_losses(d, feats, batch, anchors, 7.0, vs, soft=_one_hot_soft(batch, 1), soft_weight=1.0)
    assert torch.allclose(hard["loss"], soft["loss"], rtol=1e-5, atol=1e-6)
    half = drafter_losses(d, feats, batch, anchors, 7.0, vs, soft=_one_hot_soft(batch, 1), soft_weight=0.5)
    assert torch.allclose(hard["loss"], half["loss"], rtol=1e-5, atol=1e-6)
    for shift in (0, 2):
        off = drafter_losses(d, feats, batch, anchors, 7.0, vs, soft=_one_hot_soft(batch, shift), soft_weight=1.0)
        assert abs(float(off["loss"].detach()) - float(hard["loss"].detach())) > 1e-2


def test_rows_whose_soft_ids_all_lie_outside_the_subset_keep_the_whole_hard_loss():
    tg, d, batch, anchors, feats = _setup()
    vs = torch.arange(0, 255)  # id 255 is outside the subset
    ids = torch.full((*batch.ids.shape, 2), 255, dtype=torch.int32)
    p = torch.full((*batch.ids.shape, 2), 0.5, dtype=torch.float16)
    hard = drafter_losses(d, feats, batch, anchors, 7.0, vs)
    soft = drafter_losses(d, feats, batch, anchors, 7.0, vs, soft=(ids, p), soft_weight=0.7)
    assert torch.allclose(hard["loss"], soft["loss"], rtol=1e-6)  # not (1 - 0.7) x the hard loss


def test_soft_targets_renormalize_and_drop_ids_outside_the_subset():
    ids = torch.tensor([[[5, 6, 7], [1, 2, 3]]], dtype=torch.int32)  # [b=1, T=2, K=3]
    p = torch.tensor([[[0.5, 0.3, 0.1], [0.2, 0.2, 0.2]]], dtype=torch.float16)
    remap = torch.full((10,), -100, dtype=torch.long)
    remap[torch.tensor([5, 7, 1])] = torch.tensor([0, 1, 2])  # 6, 2, 3 are outside the subset
    g, w = soft_block_targets((ids, p), torch.tensor([[0]]), 3, remap)  # rows 1, 2 <- positions 0, 1
    assert g.tolist() == [[[[0, 0, 1], [2, 0, 0]]]]
    assert torch.allclose(w, torch.tensor([[[[0.5 / 0.6, 0.0, 0.1 / 0.6], [1.0, 0.0, 0.0]]]]), atol=1e-3)
    g, w = soft_block_targets((ids, p), torch.tensor([[0]]), 3, None)
    assert torch.allclose(w.sum(-1), torch.ones(1, 1, 2))


def test_trainer_soft_labels_are_the_target_top_k_at_each_position(tmp_path):
    tg = load_target("random:llama", vocab_size=256)
    seqs = _seqs()
    tr = Trainer(tg, _cfg(tg), seqs, tmp_path, _tc(soft_topk=5))
    batch_seqs, idx = tr.batch_for_step(0)
    batch = collate(batch_seqs, 40)
    tr.features(batch, idx)
    ids, p = tr.last_soft
    with torch.no_grad():
        logits = tg.model(input_ids=batch.ids, attention_mask=batch.valid.long()).logits
    want_ids, want_p = target_topk(logits, 5)
    v = batch.valid
    assert torch.equal(ids[v], want_ids[v]) and torch.allclose(p[v].float(), want_p[v].float(), atol=1e-3)
    assert float(p[v].float().sum(-1).max()) <= 1.001
    tr.features(batch, idx)  # the second time from the memo: the same values
    assert torch.equal(tr.last_soft[0][v], ids[v]) and torch.equal(tr.last_soft[1][v], p[v])


def test_soft_label_training_learns_and_resume_refuses_a_changed_setting(tmp_path):
    tg = load_target("random:llama", vocab_size=256)
    seqs = _seqs()
    tr = Trainer(tg, _cfg(tg), seqs, tmp_path, _tc(steps=30, lr=1e-2, soft_topk=4))
    first = tr.train_step()["loss"]
    losses = [tr.train_step()["loss"] for _ in range(29)]
    assert sum(losses[-5:]) / 5 < first * 0.9
    tr.save()
    for kw, flag in (({"soft_topk": 0}, "--soft-labels"), ({"soft_topk": 4, "soft_weight": 0.2}, "--soft-weight")):
        with pytest.raises(ValueError, match=f"trained with {flag} "):
            Trainer(tg, _cfg(tg), seqs, tmp_path, _tc(steps=30, lr=1e-2, **kw)).resume()
    assert Trainer(tg, _cfg(tg), seqs, tmp_path, _tc(steps=31, lr=1e-2, soft_topk=4)).resume()
    # a checkpoint written before --soft-labels existed trained with hard labels
    st = torch.load(tmp_path / "ckpt" / "trainer.pt", weights_only=False)
    for k in ("soft_topk", "soft_weight"):
        del st["train_config"][k]
    torch.save(st, tmp_path / "ckpt" / "trainer.pt")
    with pytest.raises(ValueError, match="trained with --soft-labels 0"):
        Trainer(tg, _cfg(tg), seqs, tmp_path, _tc(steps=31, lr=1e-2, soft_topk=4)).resume()


def test_soft_labels_refuse_a_feature_store_and_bad_settings(tmp_path):
    tg = load_target("random:llama", vocab_size=256)
    with pytest.raises(ValueError, match="--soft-labels needs the target's logits"):
        Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(soft_topk=4), feature_store=object())
    with pytest.raises(ValueError, match="--soft-weight"):
        _tc(soft_topk=4, soft_weight=1.5)
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(soft_topk=300))


def test_soft_weight_without_soft_labels_is_refused_by_name(tmp_path, capsys):
    from dspine.cli.main import main
    rc = main(["train", "--target", "random:llama", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "r"),
               "--soft-weight", "0.3", "--threads", "1"])
    assert rc == 2 and "--soft-weight applies to soft labels only" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_vocab_subset_smaller_than_the_final_stage_candidates_is_refused(tmp_path):
    tg = load_target("random:llama", vocab_size=256)
    with pytest.raises(ValueError, match="--vocab-subset 3 is smaller than the final stage's 4 candidates"):
        Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(vocab_subset=3))
    Trainer(tg, _cfg(tg, "dflash"), _seqs(), tmp_path, _tc(vocab_subset=3))  # no final stage: fine
