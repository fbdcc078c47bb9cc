"""Training pipeline: losses, resume, data-parallel equivalence, bad input."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from dspine.config import DSpineConfig
from dspine.drafter.checkpoint import DrafterError, load_drafter
from dspine.target.adapter import load_target
from dspine.train.loop import TrainConfig, Trainer
from dspine.train.losses import block_labels, collate, row_weights, sample_anchors

pytestmark = pytest.mark.usefixtures("one_thread")


def _seqs(n=8, length=48, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a learnable pattern: arithmetic progressions mod vocab with random starts
    out = []
    for i in range(n):
        start, step = int(torch.randint(1, vocab, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        out.append(([(start + step * k) % vocab for k in range(length)], 4))
    return out


def _tc(**kw):
    base = dict(steps=4, batch_size=4, anchors_per_seq=4, max_len=48, lr=3e-3, warmup=1, save_every=2,
                vocab_subset=0, feature_dtype="float32", memo_features=False)
    base.update(kw)
    return TrainConfig(**base)


def _cfg(tg, mode="dspine"):
    return DSpineConfig.for_target(tg, mode=mode, block_size=4, num_layers=1, head_topk=4, coarse_k=8)


def test_labels_and_weights():
    b = collate([([1, 2, 3, 4, 5, 6], 1)], 6)
    labels = block_labels(b, torch.tensor([[2]]), 4)
    assert labels.tolist() == [[[3, 4, 5, 6]]]
    labels = block_labels(b, torch.tensor([[4]]), 4)
    assert labels.tolist() == [[[5, 6, -100, -100]]]
    w = row_weights(16, 7.0)
    assert w[0] == 1.0 and abs(float(w[7]) - float(torch.exp(torch.tensor(-1.0)))) < 1e-6
    a = sample_anchors(b, 50, torch.Generator().manual_seed(0))
    assert int(a.min()) >= 1 and int(a.max()) <= 4  # in the response, leaving a next token


@pytest.mark.parametrize("mode", ["dspine", "dflash"])
def test_training_reduces_loss_and_resumes(tmp_path, mode):
    tg = load_target("random:llama", vocab_size=256)
    seqs = _seqs()
    tr = Trainer(tg, _cfg(tg, mode), seqs, tmp_path, _tc(steps=30, save_every=10, lr=1e-2))
    rec = tr.train_step()
    first = rec["loss"]
    assert (rec["fs"] > 0) == (mode == "dspine")  # the final-stage loss exists only for DSpine
    losses = [tr.train_step()["loss"] for _ in range(29)]
    last = sum(losses[-5:]) / 5
    assert last < first * 0.85, (first, last)
    tr.save()
    tr2 = Trainer(tg, _cfg(tg, mode), seqs, tmp_path, _tc(steps=30, lr=1e-2))
    assert tr2.resume() and tr2.step == 30
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, tr2.model.state_dict()[k])


def test_resume_refuses_other_config(tmp_path):
    tg = load_target("random:llama", vocab_size=256)
    tr = Trainer(tg, _cfg(tg, "dspine"), _seqs(), tmp_path, _tc())
    tr.train_step()
    tr.save()
    other = Trainer(tg, _cfg(tg, "dflash"), _seqs(), tmp_path, _tc())
    with pytest.raises(ValueError, match="another drafter config"):
        other.resume()


def test_resume_refuses_other_settings_and_data(tmp_path):
    """--resume continues only the same run: other training settings or other data are
    refused by name (steps and save cadence may change)."""
    tg = load_target("random:llama", vocab_size=256)
    tr = Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=4))
    tr.train_step()
    tr.save()
    for kw, flag in (({"lr": 5.0}, "--lr"), ({"batch_size": 2}, "--batch-size"),
                     ({"vocab_subset": 10}, "--vocab-subset"), ({"seed": 7}, "--seed")):
        with pytest.raises(ValueError, match=f"trained with {flag} "):
            Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=4, **kw)).resume()
    with pytest.raises(ValueError, match="other --data"):
        Trainer(tg, _cfg(tg), _seqs()[:-1], tmp_path, _tc(steps=4)).resume()
    ok = Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=9, save_every=3))
    assert ok.resume() and ok.step == 1
    with pytest.raises(ValueError, match="trained with --min-lr-ratio 0.1"):
        Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=4, min_lr_ratio=0.0)).resume()
    # a checkpoint written before --min-lr-ratio existed trained with the old floor, 0.1
    st = torch.load(tmp_path / "ckpt" / "trainer.pt", weights_only=False)
    del st["train_config"]["min_lr_ratio"]
    torch.save(st, tmp_path / "ckpt" / "trainer.pt")
    with pytest.raises(ValueError, match="trained with --min-lr-ratio 0.1"):
        Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=4, min_lr_ratio=0.0)).resume()
    assert Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=4)).resume()


def test_resume_survives_an_interrupted_save(tmp_path):
    """A crash inside save() leaves one complete state that --resume finds; an incomplete
    ckpt/ with nothing to replace it is refused instead of restarting from step 0."""
    tg = load_target("random:llama", vocab_size=256)
    tr = Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=4))
    tr.train_step()
    tr.save()
    ck = tmp_path / "ckpt"
    ck.rename(tmp_path / "ckpt.tmp")  # crash between removing ckpt/ and renaming ckpt.tmp/
    again = Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=4))
    assert again.resume() and again.step == 1 and (ck / "trainer.pt").exists()
    ck.rename(tmp_path / "ckpt.old")  # crash after ckpt/ -> ckpt.old/, with no ckpt.tmp/
    assert Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=4)).resume()
    saved = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(saved[:100])  # truncated weights
    with pytest.raises(ValueError, match="model.safetensors is damaged"):
        Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=4)).resume()
    (ck / "model.safetensors").write_bytes(saved)
    state = (ck / "trainer.pt").read_bytes()
    (ck / "trainer.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="trainer.pt is damaged"):
        Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=4)).resume()
    (ck / "trainer.pt").write_bytes(state)
    assert Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=4)).resume()
    (ck / "trainer.pt").unlink()  # ckpt/ without its trainer state
    with pytest.raises(ValueError, match="incomplete"):
        Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=4)).resume()
    assert not Trainer(tg, _cfg(tg), _seqs(), tmp_path / "fresh", _tc(steps=4)).resume()


def test_init_from_warm_starts_and_refuses_other_config(tmp_path):
    tg = load_target("random:llama", vocab_size=256)
    tr = Trainer(tg, _cfg(tg), _seqs(), tmp_path / "a", _tc(steps=3))
    tr.run()
    src = tmp_path / "a" / "ckpt"
    warm = Trainer(tg, _cfg(tg), _seqs(), tmp_path / "b", _tc(steps=1, lr=0.0, warmup=1))
    warm.run(init_from=src)  # lr 0: weights stay those of the source checkpoint
    ref = load_drafter(src, tg).state_dict()
    got = warm.model.state_dict()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert warm.step == 1  # a fresh optimizer and step count
    other = Trainer(tg, _cfg(tg, "dflash"), _seqs(), tmp_path / "c", _tc(steps=1))
    with pytest.raises(DrafterError, match="init-from .*differs.*bridge"):
        other.run(init_from=src)
    assert not (tmp_path / "c" / "ckpt").exists()  # nothing left behind as if trained
    with pytest.raises(DrafterError, match="^--init-from .*no config.json"):
        other.run(init_from=tmp_path / "nope")
    # the warm-start source survives --resume (the model card names the real parent)
    again = Trainer(tg, _cfg(tg), _seqs(), tmp_path / "b", _tc(steps=1, lr=0.0, warmup=1))
    assert again.resume() and again.init_source == str(src)
    fresh = Trainer(tg, _cfg(tg), _seqs(), tmp_path / "d", _tc(steps=1))
    fresh.run()
    assert fresh.init_source is None


def test_checkpoint_from_other_target_refused(tmp_path):
    tg = load_target("random:llama", vocab_size=256)
    tr = Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc())
    tr.save()
    other = load_target("random:llama", vocab_size=128)
    with pytest.raises(DrafterError, match="vocabulary"):
        load_drafter(tmp_path / "ckpt", other)


def test_empty_training_data_refused(tmp_path):
    tg = load_target("random:llama", vocab_size=256)
    with pytest.raises(ValueError, match="no sequences"):
        Trainer(tg, _cfg(tg), [], tmp_path, _tc())


def test_resolve_device(monkeypatch):
    """--device auto|cpu|cuda|cuda:N: CUDA only when visible, cuda:LOCAL_RANK under torchrun."""
    from dspine.guards import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu") == resolve_device("cpu:0")
    with pytest.raises(ValueError, match="'cpu:1': there is one CPU device"):
        resolve_device("cpu:1")
    with pytest.raises(ValueError, match="SpeculativeConfig.device cuda: CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="SpeculativeConfig.device 'tpu' is unknown"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="is not supported; accepted"):
        resolve_device("meta")
    with pytest.raises(ValueError, match="CUDA is not available"):
        TrainConfig(device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cuda", 1)  # one GPU per torchrun rank
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        resolve_device("cuda:3")


def test_drafter_follows_the_target_device_and_trainer_refuses_a_mismatch(tmp_path):
    """A checkpoint is loaded onto the target's device; training refuses a target on
    another device than --device (meta stands in for a GPU here)."""
    tg = load_target("random:llama", vocab_size=256)
    tr = Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc())
    tr.save()
    meta = load_target("random:llama", vocab_size=256, device="meta")
    model = load_drafter(tmp_path / "ckpt", meta)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    with pytest.raises(ValueError, match="--device cpu: the target is loaded on meta"):
        Trainer(meta, _cfg(meta), _seqs(), tmp_path / "b", _tc())
    b = collate(_seqs(n=2), 48).to("meta")
    assert b.ids.device.type == b.valid.device.type == b.resp_start.device.type == "meta"


def _ddp_worker(rank, world, tmp, result_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    torch.set_num_threads(1)
    tg = load_target("random:llama", vocab_size=256)
    tr = Trainer(tg, _cfg(tg), _seqs(length=40), Path(result_dir), _tc(steps=3, save_every=100))
    for _ in range(3):
        tr.train_step()
    if rank == 0:
        torch.save(tr.model.state_dict(), Path(result_dir) / "ddp.pt")
    tr.save()  # rank 0 writes; then a crash inside the next save is simulated
    torch.distributed.barrier()
    if rank == 0:
        (Path(result_dir) / "ckpt").rename(Path(result_dir) / "ckpt.tmp")
    torch.distributed.barrier()
    again = Trainer(tg, _cfg(tg), _seqs(length=40), Path(result_dir), _tc(steps=3, save_every=100))
    assert again.resume() and again.step == 3  # rank 0 recovers it, every rank then loads it
    torch.save(again.model.state_dict(), Path(result_dir) / f"resumed{rank}.pt")
    torch.distributed.barrier()  # no rank tears gloo down while the other still uses it
    torch.distributed.destroy_process_group()


def test_two_process_training_matches_one_process(tmp_path):
    """2 gloo processes x batch 2 == 1 process x batch 4 after a few steps."""
    mp.start_processes(_ddp_worker, args=(2, str(tmp_path), str(tmp_path)), nprocs=2, start_method="spawn")
    ddp = torch.load(tmp_path / "ddp.pt")
    for r in (0, 1):  # both ranks resumed the same state after the interrupted save
        resumed = torch.load(tmp_path / f"resumed{r}.pt")
        assert all(torch.equal(resumed[k], v) for k, v in ddp.items())
    tg = load_target("random:llama", vocab_size=256)
    tr = Trainer(tg, _cfg(tg), _seqs(length=40), tmp_path / "single", _tc(steps=3, save_every=100))
    for _ in range(3):
        tr.train_step()
    single = tr.model.state_dict()
    for k, v in single.items():
        torch.testing.assert_close(ddp[k], v, rtol=1e-4, atol=1e-5)
    # the step really changed the weights (the comparison is not vacuous)
    fresh = Trainer(tg, _cfg(tg), _seqs(length=40), tmp_path / "fresh", _tc(steps=3)).model.state_dict()
    assert any(not torch.allclose(fresh[k], single[k]) for k in single)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_training_runs_on_hybrid_targets(tmp_path, arch):
    """Smoke: features come from Gated-DeltaNet hybrids like from dense targets."""
    tg = load_target(f"random:{arch}", vocab_size=256)
    tr = Trainer(tg, _cfg(tg), _seqs(n=4, length=40), tmp_path, _tc(steps=2, batch_size=2, max_len=40))
    rec = [tr.train_step() for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["fs"] > 0 for r in rec)
    assert any(not torch.equal(p, q) for p, q in zip(
        tr.model.state_dict().values(),
        Trainer(tg, _cfg(tg), _seqs(n=4, length=40), tmp_path / "b", _tc()).model.state_dict().values()))


def test_feature_store_matches_online_features_and_refuses_other_data(tmp_path):
    from dspine.train.feature_store import FeatureStore, FeatureStoreError, build_feature_store

    tg = load_target("random:llama", vocab_size=256)
    seqs = _seqs(n=6)
    seqs = seqs + seqs[:2]  # a data directory listed twice is stored once
    cfg = _cfg(tg)
    for k in range(2):  # two shards, as two processes would write them
        build_feature_store(tg, cfg.feature_layers, seqs, 48, tmp_path / "fs", k, 2, batch_size=3, progress=False)
    store = FeatureStore(tmp_path / "fs", tg, cfg.feature_layers, seqs, 48)
    assert len(store) == 8 and len(store.index) == 6 and all(i in store for i in range(8))
    tc = _tc(feature_dtype="bfloat16")
    online = Trainer(tg, cfg, seqs, tmp_path / "a", tc)
    stored = Trainer(tg, cfg, seqs, tmp_path / "b", tc, feature_store=store)
    batch_seqs, idx = online.batch_for_step(0)
    b = collate(batch_seqs, 48)
    f_online, f_store = online.features(b, idx), stored.features(b, idx)
    assert f_online.shape == f_store.shape
    assert torch.allclose(f_online, f_store, atol=0.05, rtol=0.02)  # bf16 rows, batch-shape numerics
    assert torch.equal(store.get(6), store.get(0))
    with pytest.raises(FeatureStoreError, match="fingerprint"):
        FeatureStore(tmp_path / "fs", tg, cfg.feature_layers, _seqs(n=6, seed=1), 48)
    with pytest.raises(FeatureStoreError, match="feature_layers"):
        FeatureStore(tmp_path / "fs", tg, [0], seqs, 48)
    with pytest.raises(FeatureStoreError, match="no store.json"):
        FeatureStore(tmp_path / "nothing", tg, cfg.feature_layers, seqs, 48)


def test_feature_store_reuses_rows_of_an_older_store_after_the_data_grew(tmp_path, monkeypatch):
    import json as _json

    import dspine.train.feature_store as FS

    tg = load_target("random:llama", vocab_size=256)
    cfg = _cfg(tg)
    seqs = _seqs(n=8)
    old, grown = seqs[:5], seqs[:3] + seqs[5:] + seqs[3:5]  # grown data, another order
    FS.build_feature_store(tg, cfg.feature_layers, old, 48, tmp_path / "old", progress=False)
    calls = []
    import dspine.train.losses as L
    real = L.collate
    monkeypatch.setattr(L, "collate", lambda b, m: calls.append(len(b)) or real(b, m))
    for k in range(2):
        FS.build_feature_store(tg, cfg.feature_layers, grown, 48, tmp_path / "new", k, 2, progress=False,
                               reuse=[tmp_path / "old"])
    assert sum(calls) == 3  # only the 3 new sequences ran through the target
    new = FS.FeatureStore(tmp_path / "new", tg, cfg.feature_layers, grown, 48)
    ref = FS.FeatureStore(tmp_path / "old", tg, cfg.feature_layers, old, 48)
    fresh_dir = tmp_path / "fresh"
    FS.build_feature_store(tg, cfg.feature_layers, grown, 48, fresh_dir, progress=False)
    fresh = FS.FeatureStore(fresh_dir, tg, cfg.feature_layers, grown, 48)
    assert len(new) == 8
    assert torch.equal(new.get(0), ref.get(0)) and torch.equal(new.get(6), ref.get(3))  # copied rows
    for i in range(8):  # and they are what a fresh build computes (bf16, batch-shape numerics)
        assert torch.allclose(new.get(i).float(), fresh.get(i).float(), atol=0.05, rtol=0.02)
    # a store for other settings, or one without sequence hashes, is refused by name
    with pytest.raises(FS.FeatureStoreError, match=r"--reuse .*max_len"):
        FS.build_feature_store(tg, cfg.feature_layers, grown, 40, tmp_path / "x", progress=False,
                               reuse=[tmp_path / "old"])
    assert not (tmp_path / "x").exists()  # --reuse is checked before anything is written
    idx = tmp_path / "old" / "shard-0.idx.jsonl"
    recs = [_json.loads(l) for l in idx.read_text().splitlines()]
    idx.write_text("".join(_json.dumps({k: r[k] for k in ("i", "offset", "len")}) + "\n" for r in recs))
    with pytest.raises(FS.FeatureStoreError, match="no sequence hashes"):
        FS.build_feature_store(tg, cfg.feature_layers, grown, 48, tmp_path / "y", progress=False,
                               reuse=[tmp_path / "old"])


def test_feature_store_damage_is_detected_or_repaired(tmp_path):
    import json as _json

    from dspine.train.feature_store import FeatureStore, FeatureStoreError, build_feature_store

    tg = load_target("random:llama", vocab_size=256)
    seqs, cfg = _seqs(n=6), _cfg(tg)
    fs = tmp_path / "fs"
    build_feature_store(tg, cfg.feature_layers, seqs, 48, fs, progress=False)
    idx, binf = fs / "shard-0.idx.jsonl", fs / "shard-0.bin"
    good_idx, good_bin = idx.read_bytes(), binf.read_bytes()
    ref = FeatureStore(fs, tg, cfg.feature_layers, seqs, 48).get(5)
    # a torn last index line (crash while appending): ignored when reading, dropped and
    # recomputed on resume, with the rows it described
    lines = good_idx.splitlines(keepends=True)
    idx.write_bytes(b"".join(lines[:-1]) + lines[-1][:9])
    assert len(FeatureStore(fs, tg, cfg.feature_layers, seqs, 48)) == 5
    assert build_feature_store(tg, cfg.feature_layers, seqs, 48, fs, progress=False) == 1
    st = FeatureStore(fs, tg, cfg.feature_layers, seqs, 48)
    assert len(st) == 6 and torch.equal(st.get(5), ref)
    # a shard file shorter than its index: refused, never zero-filled
    idx.write_bytes(good_idx)
    binf.write_bytes(good_bin[: len(good_bin) // 2])
    with pytest.raises(FeatureStoreError, match="past the end"):
        FeatureStore(fs, tg, cfg.feature_layers, seqs, 48)
    with pytest.raises(FeatureStoreError, match="shorter"):
        build_feature_store(tg, cfg.feature_layers, seqs, 48, fs, progress=False)
    assert binf.stat().st_size == len(good_bin) // 2  # nothing was padded
    binf.write_bytes(good_bin)
    # index records that do not fit the data
    for bad in ({"i": 0, "offset": 0, "len": 5}, {"i": 55, "offset": 0, "len": 48}):
        idx.write_bytes(good_idx + (_json.dumps(bad) + "\n").encode())
        with pytest.raises(FeatureStoreError, match="corrupt store"):
            FeatureStore(fs, tg, cfg.feature_layers, seqs, 48)
    idx.write_bytes(good_idx)
    (fs / "shard-x.idx.jsonl").write_text("not ours\n")  # a look-alike file is not a shard: ignored
    assert len(FeatureStore(fs, tg, cfg.feature_layers, seqs, 48)) == 6
    meta = (fs / "store.json").read_text()
    (fs / "store.json").write_text("[1, 2]")
    with pytest.raises(FeatureStoreError, match="not a store description"):
        FeatureStore(fs, tg, cfg.feature_layers, seqs, 48)
    (fs / "store.json").write_text(meta)
    with pytest.raises(ValueError, match="max-len"):
        build_feature_store(tg, cfg.feature_layers, seqs, 0, tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


def test_train_command_end_to_end(tmp_path, capsys):
    """`dspine data text` -> `dspine train` -> final checkpoint with a card that loads;
    a second run into the same --out needs --resume, which continues the step count."""
    import json

    from dspine.cli.main import main

    data, run = tmp_path / "text", tmp_path / "run"
    assert main(["data", "text", "--target", "random:llama", "--sources", "stdlib", "--out", str(data),
                 "--max-tokens", "3000", "--seq-len", "64"]) == 0
    base = ["train", "--target", "random:llama", "--data", str(data), "--out", str(run), "--batch-size", "2",
            "--anchors", "2", "--max-len", "64", "--block-size", "4", "--eval-prompts", "1", "--threads", "1",
            "--device", "cpu", "--save-every", "1", "--vocab-subset", "64"]
    assert main(base + ["--steps", "2"]) == 0
    card = json.loads((run / "final" / "card.json").read_text())
    assert card["steps"] == 2 and card["train_config"]["device"] == "cpu"
    from dspine.drafter.vocab import load_draft_vocab  # the CE's subset is the candidate pass's draft vocabulary

    assert load_draft_vocab(run / "final", 256, 16).numel() == 64
    assert card["heldout_acceptance_greedy_fp32"]["n_code"] == 1
    assert card["train_config"]["eval_prompts"] == 1  # the card records the --eval-prompts used
    assert card["data_summary"] == "teacher-forcing text"  # only `data text` output: no regenerated claim
    assert "(teacher-forcing text; held-out sets excluded" in (run / "final" / "README.md").read_text()
    from dspine.train.card import write_model_card
    good = (run / "final" / "card.json").read_text()
    nulls = {**card, "train_config": None, "heldout_acceptance_greedy_fp32": None, "data": None,
             "data_commands": None, "lineage": None}
    (run / "final" / "card.json").write_text(json.dumps(nulls))
    assert "lr None" in write_model_card(run / "final").read_text()  # optional fields left out, no crash
    (run / "final" / "card.json").write_text(json.dumps({**card, "train_config": {"min_lr_ratio": "0"}}))
    assert "cosine down" not in write_model_card(run / "final").read_text()  # not a number: not stated
    grown = {**card, "train_config": {**card["train_config"], "lr_schedule": "constant"},
             "data_history": [{"step": 0, "sequences": 40}, {"step": 2, "sequences": 60}]}
    (run / "final" / "card.json").write_text(json.dumps(grown))
    text = write_model_card(run / "final").read_text()
    assert "(constant after warmup)" in text and "40 sequences from step 0, 60 sequences from step 2" in text
    (run / "final" / "card.json").write_text(json.dumps({k: v for k, v in card.items() if k != "target"}))
    with pytest.raises(ValueError, match="card.json lacks target"):
        write_model_card(run / "final")
    (run / "final" / "card.json").write_text(good)
    assert load_drafter(run / "final", load_target("random:llama")).cfg.block_size == 4
    capsys.readouterr()
    assert main(base + ["--steps", "3"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(base + ["--steps", "3", "--resume"]) == 0
    assert json.loads((run / "final" / "card.json").read_text())["steps"] == 3
    # the exported drafter carries its trainer state: another --out (another machine) continues it
    run2 = tmp_path / "run2"
    cont = [a if a != str(run) else str(run2) for a in base] + ["--steps", "4", "--continue-from", str(run / "final")]
    assert main(cont + ["--init-from", str(run / "final")]) == 2 and "give one of the two" in capsys.readouterr().err
    for bad, why in ((["--continue-from", ""], "names no directory"), (["--continue-from", str(tmp_path / "nope")],
                                                                         "no such directory"),
                     (["--continue-from", str(data)], "no trainer.json")):
        assert main(base + ["--steps", "4"] + bad) == 2 and why in capsys.readouterr().err
    assert main(base + ["--steps", "4", "--rebuild-moments", "5"]) == 2
    assert "applies to --continue-from only" in capsys.readouterr().err
    assert main(cont) == 0
    assert "continuing" in capsys.readouterr().err
    card2 = json.loads((run2 / "final" / "card.json").read_text())
    assert card2["steps"] == 4 and card2["continued_from"]["path"] == str(run / "final")
    assert card2["continued_from"]["step"] == 3 and card2["continued_from"]["moments_rebuilt_from_steps"] == 3
    state2 = json.loads((run2 / "final" / "trainer.json").read_text())
    assert state2["step"] == 4 and state2["continued_from"]["step"] == 3  # the lineage travels with it
    assert f"continued from step 3 of the run exported in {run / 'final'}" in (run2 / "final" / "README.md").read_text()


def test_diverging_training_stops_with_an_error_naming_lr(tmp_path, capsys):
    """NaN/inf loss or gradients stop training before the step is applied (no final
    checkpoint of NaN weights); --lr must be a finite number > 0."""
    from dspine.train.loop import TrainingDiverged

    tg = load_target("random:llama", vocab_size=256)
    tr = Trainer(tg, _cfg(tg), _seqs(n=4), tmp_path / "run",
                 TrainConfig(steps=3, batch_size=2, anchors_per_seq=2, max_len=48, save_every=1, warmup=0))
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.model.fc.weight.data[0, 0] = float("nan")  # poison: the loss becomes NaN
    with pytest.raises(TrainingDiverged, match="--lr"):
        tr.run()
    assert not (tmp_path / "run" / "final").exists()
    assert torch.isnan(tr.model.fc.weight[0, 0])
    assert all(torch.equal(v, before[k]) for k, v in tr.model.state_dict().items() if k != "fc.weight")
    for bad in (float("inf"), -1e-3, float("nan")):
        with pytest.raises(ValueError, match="--lr"):
            TrainConfig(lr=bad)
    from dspine.cli.main import main
    for bad in ("inf", "0", "-1e-3", "nan"):  # the command line wants a real step size
        capsys.readouterr()
        assert main(["train", "--data", "x", "--out", str(tmp_path / "o"), "--lr", bad]) == 2
        assert "--lr" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cosine_schedule_floor_and_min_lr_ratio_setting(tmp_path, capsys):
    """Warmup rises linearly to --lr; the cosine ends at --min-lr-ratio x --lr (0: at zero);
    a ratio outside [0, 1] is refused by the config and the command line."""
    from dspine.train.losses import cosine_lr

    assert cosine_lr(0, 100, 10, 1e-3) == pytest.approx(1e-4)  # warmup step 1 of 10
    assert cosine_lr(9, 100, 10, 1e-3) == pytest.approx(1e-3)
    assert cosine_lr(10, 100, 10, 1e-3) == pytest.approx(1e-3)  # cosine starts at the peak
    assert cosine_lr(55, 100, 10, 1e-3, floor=0.0) == pytest.approx(0.5e-3)  # half way
    assert cosine_lr(100, 100, 10, 1e-3) == pytest.approx(1e-4)  # default floor 0.1
    assert cosine_lr(100, 100, 10, 1e-3, floor=0.0) == pytest.approx(0.0, abs=1e-15)
    assert TrainConfig(min_lr_ratio=0.0).min_lr_ratio == 0.0
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="--min-lr-ratio"):
            TrainConfig(min_lr_ratio=bad)
    from dspine.cli.main import main
    for bad in ("-0.1", "2", "nan", "x"):
        capsys.readouterr()
        assert main(["train", "--data", "x", "--out", str(tmp_path / "o"), "--min-lr-ratio", bad]) == 2
        assert "--min-lr-ratio" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    # the trainer uses the floor: the last step of a 0-floor run has lr ~0
    tg = load_target("random:llama", vocab_size=256)
    tr = Trainer(tg, _cfg(tg), _seqs(n=4), tmp_path / "run",
                 TrainConfig(steps=4, batch_size=2, anchors_per_seq=2, max_len=48, save_every=4, warmup=0,
                             lr=1e-3, min_lr_ratio=0.0))
    tr.run()
    assert tr.opt.param_groups[0]["lr"] < 1e-3 * 0.2


def test_training_data_with_ids_outside_the_vocabulary_is_refused(tmp_path):
    import json as _json

    from dspine.cli.main import main
    from dspine.train.cli import _training_seqs

    data = tmp_path / "text"
    assert main(["data", "text", "--target", "random:llama", "--sources", "stdlib", "--out", str(data),
                 "--max-tokens", "300", "--seq-len", "64"]) == 0
    f = data / "data-00000.jsonl"
    rows = [_json.loads(l) for l in f.read_text().splitlines()]
    rows[1]["response_ids"][2] = 999999
    f.write_text("".join(_json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"row 1 holds token id 999999"):
        _training_seqs([str(data)], load_target("random:llama"), 64)


def test_rows_with_a_short_answer_are_named_not_dropped_silently(tmp_path, capsys):
    import json as _json

    from dspine.cli.main import main
    from dspine.train.cli import _training_seqs

    data = tmp_path / "text"
    assert main(["data", "text", "--target", "random:llama", "--sources", "stdlib", "--out", str(data),
                 "--max-tokens", "300", "--seq-len", "64"]) == 0
    f = data / "data-00000.jsonl"
    rows = [_json.loads(l) for l in f.read_text().splitlines()]
    rows[0]["response_ids"], rows[2]["response_ids"] = [], rows[2]["response_ids"][:1]
    f.write_text("".join(_json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    seqs = _training_seqs([str(data)], load_target("random:llama"), 64)
    assert len(seqs) == len(rows) - 2
    assert f"2 of {len(rows)} rows have an answer of fewer than 2 tokens" in capsys.readouterr().err


def test_train_names_a_bad_block_size_before_loading(capsys):
    from dspine.cli.main import main

    for bad, why in (("0", "must be 2..64"), ("1", "must be 2..64"), ("65", "must be 2..64"),
                     ("x", "expected an integer")):
        assert main(["train", "--data", "nowhere", "--out", "nowhere", "--block-size", bad]) == 2
        assert f"--block-size: {why}" in capsys.readouterr().err


@settings(max_examples=200, deadline=None)
@given(n_prompt=st.integers(0, 60), n_resp=st.integers(0, 60), max_len=st.integers(2, 50))
def test_fit_window_cuts_the_prompt_never_the_response(n_prompt, n_resp, max_len):
    from dspine.train.losses import fit_window

    ids = list(range(1000, 1000 + n_prompt + n_resp))
    r = n_prompt
    w, r2 = fit_window(ids, r, max_len)
    if len(ids) <= max_len:
        assert (w, r2) == (ids, r)
        return
    start = w[0] - 1000
    assert len(w) == max_len and w == ids[start:start + max_len]  # one contiguous slice, full width
    assert start + r2 == r  # the response start points at the same token
    assert r2 == min(r, 1) or start == 0 or len(w) - r2 == n_resp  # only prompt tokens are dropped...
    assert len(w) - r2 == min(n_resp, max_len - min(r, 1))  # ...and the response keeps all that fits


def test_fit_window_refuses_a_window_below_two():
    from dspine.train.losses import fit_window

    with pytest.raises(ValueError, match="--max-len 1"):
        fit_window([1, 2, 3], 1, 1)


def test_committed_training_data_keeps_every_response_token_in_the_window(smol):
    """On the committed data, the default window (384) now keeps every response token
    (the old right cut kept fewer); the training card counts what the window holds."""
    from pathlib import Path

    from dspine.train.cli import _training_seqs
    from dspine.train.losses import fit_window

    d = Path(__file__).resolve().parents[1] / "training-data" / "smollm2-135m-regen"
    seqs = _training_seqs([str(d)], smol)
    full = sum(len(s) - r for s, r in seqs)
    old = sum(max(0, min(len(s), 384) - r) for s, r in seqs)
    new = sum(len(w) - r2 for w, r2 in (fit_window(s, r, 384) for s, r in seqs))
    assert new == full > old


def test_fit_window_refuses_a_response_start_outside_the_row():
    from dspine.train.losses import fit_window

    for r in (-1, 11):
        with pytest.raises(ValueError, match=f"response start {r}"):
            fit_window(list(range(10)), r, 4)


def test_training_seqs_refuses_a_window_below_four(tmp_path):
    from dspine.cli.main import main
    from dspine.train.cli import _training_seqs

    data = tmp_path / "text"
    assert main(["data", "text", "--target", "random:llama", "--sources", "stdlib", "--out", str(data),
                 "--max-tokens", "300", "--seq-len", "64"]) == 0
    with pytest.raises(ValueError, match="--max-len 3 must be at least 4"):
        _training_seqs([str(data)], load_target("random:llama"), 3)
    seqs = _training_seqs([str(data)], load_target("random:llama"), 16)
    assert all(len(s) <= 16 for s, _ in seqs)


def test_feature_store_uses_the_training_windows(tmp_path):
    """A store built by ``train-features --max-len L`` holds the windows ``train --max-len L``
    trains on (prompts cut from the left), so a store of long rows stays usable."""
    from dspine.cli.main import main

    data, fs = tmp_path / "dt", tmp_path / "fs"
    assert main(["data", "text", "--target", "random:llama", "--sources", "stdlib", "--out", str(data),
                 "--max-tokens", "2000", "--seq-len", "64"]) == 0
    assert main(["train-features", "--target", "random:llama", "--data", str(data), "--out", str(fs),
                 "--max-len", "32", "--threads", "1", "--device", "cpu"]) == 0
    assert main(["train", "--target", "random:llama", "--data", str(data), "--out", str(tmp_path / "tf"),
                 "--steps", "2", "--batch-size", "2", "--anchors", "2", "--block-size", "4", "--max-len", "32",
                 "--threads", "1", "--eval-prompts", "0", "--device", "cpu", "--vocab-subset", "0",
                 "--feature-store", str(fs)]) == 0


def test_init_from_adapts_only_towards_engine_compatible(tmp_path):
    """Warm start across the engine-compatible change: a DFlash-style checkpoint
    into an --engine-compatible run copies the shared tensors and starts the q/k norms at
    one; the reverse (which would drop trained q/k norms) is refused."""
    from dataclasses import replace as dc_replace

    tg = load_target("random:llama", vocab_size=256)
    Trainer(tg, _cfg(tg, "dflash"), _seqs(), tmp_path / "a", _tc(steps=2)).run()
    src = tmp_path / "a" / "ckpt"
    compat = dc_replace(_cfg(tg, "dflash"), qk_norm=True, row_embedding=False)
    warm = Trainer(tg, compat, _seqs(), tmp_path / "b", _tc(steps=1, lr=0.0, warmup=1))
    warm.run(init_from=src)
    ref, got = load_drafter(src, tg).state_dict(), warm.model.state_dict()
    assert all(torch.equal(ref[k], got[k]) for k in got if k in ref)
    assert all(torch.equal(got[k], torch.ones_like(got[k])) for k in got if k.endswith(("q_norm.weight", "k_norm.weight")))
    assert warm.init_adapted["dropped"] == ["row_embed"]
    back = Trainer(tg, _cfg(tg, "dflash"), _seqs(), tmp_path / "c", _tc(steps=1))
    with pytest.raises(DrafterError, match="add --engine-compatible"):
        back.run(init_from=tmp_path / "b" / "ckpt")


def test_time_limit_saves_and_stops_and_resume_finishes_the_same_schedule(tmp_path):
    tg = load_target("random:llama", vocab_size=256)
    tr = Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=6, time_limit=1e-9))
    tr.run()
    assert tr.stopped_early and tr.step == 0 and (tmp_path / "ckpt" / "trainer.pt").exists()
    tr2 = Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=6))  # the limit may change on resume
    tr2.run(resume=True)
    assert not tr2.stopped_early and tr2.step == 6
    with pytest.raises(ValueError, match="--time-limit"):
        _tc(time_limit=float("inf"))


def test_a_resumed_run_continues_as_if_never_stopped(tmp_path):
    """Stop at step 6, resume in a new Trainer, run to 12: the losses of steps 7-12 and the
    final weights equal those of one uninterrupted run (weights and optimizer state kept)."""
    tg = load_target("random:llama", vocab_size=256)
    seqs = _seqs()
    whole = Trainer(tg, _cfg(tg, "dspine"), seqs, tmp_path / "whole", _tc(steps=12, save_every=100, lr=1e-2))
    want = [whole.train_step()["loss"] for _ in range(12)]
    a = Trainer(tg, _cfg(tg, "dspine"), seqs, tmp_path / "split", _tc(steps=12, save_every=100, lr=1e-2))
    got = [a.train_step()["loss"] for _ in range(6)]
    a.save()
    b = Trainer(tg, _cfg(tg, "dspine"), seqs, tmp_path / "split", _tc(steps=12, save_every=100, lr=1e-2))
    assert b.resume() and b.step == 6
    got += [b.train_step()["loss"] for _ in range(6)]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for k, v in whole.model.state_dict().items():
        assert torch.allclose(v, b.model.state_dict()[k], atol=1e-6), k


def test_a_run_resumes_on_grown_data_and_keeps_one_schedule(tmp_path, capsys):
    """Training that lasts across working periods: a run stopped at step 6 resumes on data
    grown by rows appended after the old ones (as `dspine data build --resume` adds a
    shard), draws from the new rows from then on, and a second stop on the grown data
    changes nothing (the losses of steps 7-12 equal one resume's); data that changed any
    earlier row is refused. With --lr-schedule constant, extending --steps changes no
    step's learning rate."""
    tg = load_target("random:llama", vocab_size=256)
    old, new = _seqs(), _seqs() + _seqs(n=8, seed=1)
    tc = dict(save_every=100, lr=1e-2, lr_schedule="constant", warmup=2)

    def first_six(out):
        a = Trainer(tg, _cfg(tg), old, out, _tc(steps=6, **tc))
        losses = [a.train_step()["loss"] for _ in range(6)]
        a.save()
        return losses

    first_six(tmp_path / "once")
    once = Trainer(tg, _cfg(tg), new, tmp_path / "once", _tc(steps=12, **tc))
    assert once.resume() and once.step == 6
    assert "grew from 8 to 16 sequences" in capsys.readouterr().err
    assert once.data_history == [{"step": 0, "sequences": 8}, {"step": 6, "sequences": 16}]
    want = [once.train_step() for _ in range(6)]
    assert any(i >= 8 for s in range(6, 12) for i in once.batch_for_step(s)[1])  # the new rows are drawn
    assert {r["lr"] for r in want} == {1e-2}  # constant after warmup, whatever --steps says

    first_six(tmp_path / "twice")
    b = Trainer(tg, _cfg(tg), new, tmp_path / "twice", _tc(steps=9, **tc))
    assert b.resume() and "grew from 8 to 16" in capsys.readouterr().err
    got = [b.train_step() for _ in range(3)]
    b.save()
    c = Trainer(tg, _cfg(tg), new, tmp_path / "twice", _tc(steps=12, **tc))
    assert c.resume() and c.step == 9
    assert "grew" not in capsys.readouterr().err
    assert c.data_history == once.data_history  # the growth is recorded once
    got += [c.train_step() for _ in range(3)]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5, abs=1e-6)
    assert [r["lr"] for r in got] == [r["lr"] for r in want]

    # a checkpoint written before data_history existed resumes on grown data the same way
    first_six(tmp_path / "legacy")
    st = torch.load(tmp_path / "legacy" / "ckpt" / "trainer.pt", weights_only=False)
    del st["data_history"], st["data_sequences"]
    torch.save(st, tmp_path / "legacy" / "ckpt" / "trainer.pt")
    assert Trainer(tg, _cfg(tg), new, tmp_path / "legacy", _tc(steps=12, **tc)).resume()

    # not grown but changed: an edited old row, old rows reordered, or fewer rows
    edited = [(list(old[0][0][:-1]) + [(old[0][0][-1] + 1) % 256], old[0][1])] + old[1:] + _seqs(n=8, seed=1)
    for bad in (edited, old[::-1] + _seqs(n=8, seed=1), old[:-2]):
        with pytest.raises(ValueError, match="other --data.*appended after the old ones"):
            Trainer(tg, _cfg(tg), bad, tmp_path / "legacy", _tc(steps=12, **tc)).resume()


def test_cosine_resume_with_other_steps_says_the_schedule_changes(tmp_path, capsys):
    from dspine.train.losses import cosine_lr

    assert cosine_lr(50, 100, 10, 1.0, schedule="constant") == cosine_lr(50, 10_000, 10, 1.0, schedule="constant") == 1.0
    assert cosine_lr(50, 100, 10, 1.0) != cosine_lr(50, 10_000, 10, 1.0)
    with pytest.raises(ValueError, match="--lr-schedule"):
        cosine_lr(5, 10, 1, 1.0, schedule="linear")
    with pytest.raises(ValueError, match="--lr-schedule"):
        _tc(lr_schedule="linear")
    tg = load_target("random:llama", vocab_size=256)
    tr = Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=4))
    tr.train_step()
    tr.save()
    assert Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=8)).resume()
    assert "the cosine schedule now ends at step 8" in capsys.readouterr().err
    with pytest.raises(ValueError, match="trained with --lr-schedule 'cosine'"):
        Trainer(tg, _cfg(tg), _seqs(), tmp_path, _tc(steps=8, lr_schedule="constant")).resume()


def test_an_exported_run_continues_on_another_machine_with_rebuilt_moments(tmp_path, capsys):
    """--continue-from: a run's exported drafter (bfloat16 weights) plus trainer.json is what
    travels in the repository; a new Trainer continues its step count, schedule and batch
    order from it, with AdamW's moments rebuilt from the gradients of the steps before (an
    approximation: closer to the uninterrupted run than a fresh optimizer, measured here)."""
    import statistics

    from dspine.drafter.checkpoint import save_drafter
    from dspine.train.portable import continue_from, read_state, write_state

    tg = load_target("random:llama", vocab_size=256)
    seqs = _seqs()
    kw = dict(save_every=1000, lr=3e-3, lr_schedule="constant", warmup=2, steps=56)
    whole = Trainer(tg, _cfg(tg), seqs, tmp_path / "whole", _tc(**kw))
    want = [whole.train_step() for _ in range(56)]
    a = Trainer(tg, _cfg(tg), seqs, tmp_path / "a", _tc(**kw))
    for _ in range(40):
        a.train_step()
    moments = {k: v["exp_avg_sq"].clone() for k, v in zip(a.model.state_dict(), a.opt.state.values())}
    save_drafter(a.model, tmp_path / "final", dtype=torch.bfloat16)
    write_state(a, tmp_path / "final")
    assert read_state(tmp_path / "final")["step"] == 40

    runs = {}
    for k in (0, 32):
        b = Trainer(tg, _cfg(tg), seqs, tmp_path / f"b{k}", _tc(**kw))
        continue_from(b, tmp_path / "final", k)
        assert b.step == 40 and b.subset is None  # (the CLI test continues a run with a subset)
        for name, w in b.model.state_dict().items():  # the weights are the exported ones, not moved
            assert torch.equal(w, a.model.state_dict()[name].to(torch.bfloat16).float()), name
        if k:
            rebuilt = torch.cat([s["exp_avg_sq"].flatten() for s in b.opt.state.values()])
            exact = torch.cat([m.flatten() for m in moments.values()])
            assert 0.5 < float(rebuilt.norm() / exact.norm()) < 2.0
        else:
            assert not b.opt.state  # nothing replayed: AdamW starts afresh
        runs[k] = [b.train_step() for _ in range(16)]
        assert [r["lr"] for r in runs[k]] == [r["lr"] for r in want[40:]]
        assert [b.batch_for_step(s)[1] for s in range(40, 56)] == [whole.batch_for_step(s)[1] for s in range(40, 56)]
    gap = {k: abs(statistics.mean(r["loss"] for r in runs[k]) - statistics.mean(r["loss"] for r in want[40:]))
           for k in runs}
    assert gap[32] < gap[0], gap

    # what --continue-from refuses: no trainer.json, other settings, other data, bad K
    with pytest.raises(ValueError, match="no trainer.json.*--init-from"):
        continue_from(Trainer(tg, _cfg(tg), seqs, tmp_path / "c", _tc(**kw)), tmp_path / "a")
    with pytest.raises(ValueError, match="trained with --lr 0.003"):
        continue_from(Trainer(tg, _cfg(tg), seqs, tmp_path / "c", _tc(**{**kw, "lr": 1e-3})), tmp_path / "final")
    with pytest.raises(ValueError, match="other --data"):
        continue_from(Trainer(tg, _cfg(tg), seqs[1:], tmp_path / "c", _tc(**kw)), tmp_path / "final")
    with pytest.raises(ValueError, match="--rebuild-moments"):
        continue_from(Trainer(tg, _cfg(tg), seqs, tmp_path / "c", _tc(**kw)), tmp_path / "final", -1)
    with pytest.raises(ValueError, match="at step 40; --steps 40 adds nothing"):
        continue_from(Trainer(tg, _cfg(tg), seqs, tmp_path / "c", _tc(**{**kw, "steps": 40})), tmp_path / "final")
    good = json.loads((tmp_path / "final" / "trainer.json").read_text())
    for damaged, why in (({"step": "x"}, "lacks a valid step"),
                         ({"data_history": "x"}, "damaged data_history"),
                         ({"data_history": [{"step": 0, "sequences": "8"}]}, "damaged data_history"),
                         ({"step": 10**12}, "step 1000000000000, beyond that run's own --steps"),
                         ({"data_history": [{"step": 41, "sequences": 8}]}, "data added after its own step 40"),
                         ({"train_config": {**good["train_config"], "lr": "0.003"}}, "train_config.lr = '0.003', not a float"),
                         ({"train_config": {**good["train_config"], "batch_size": 4.0}}, "batch_size = 4.0, not a int")):
        (tmp_path / "final" / "trainer.json").write_text(json.dumps({**good, **damaged}))
        with pytest.raises(ValueError, match=why):
            continue_from(Trainer(tg, _cfg(tg), seqs, tmp_path / "c", _tc(**kw)), tmp_path / "final")
