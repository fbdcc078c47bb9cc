"""`dspine export`: the z-lab DFlash format vLLM and llama.cpp serve.

The format checks (names, shapes, config keys) follow what vLLM's ``qwen3_dflash.py``
loads and llama.cpp's ``conversion/qwen.py`` converts. Exactness: the exported folder,
run by an independent float64 implementation written from the engines' code
(:func:`reference_block_logits`), gives dspine's own block logits; the negative control
(a drafter with a per-row embedding and no q/k norm, exported by force) must not.
The engines themselves run in ``benchmarks/engines/`` (not here: vLLM's venv is ~3.5 GB,
llama.cpp's build ~21 min).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dspine.cli.main import main
from dspine.config import DSpineConfig, engine_compatible_flags
from dspine.drafter.checkpoint import random_drafter, save_drafter
from dspine.export.dflash import (ExportError, check_exportable, export_dflash, load_dflash,
                                  reference_block_logits, to_zlab_state_dict)


def _compat(target, seed=0, **over):
    d = random_drafter(target, mode="dflash", block_size=8, seed=seed, **engine_compatible_flags(), **over)
    with torch.no_grad():  # non-trivial norms, so a swapped q/k norm would show
        for layer in d.layers:
            layer.q_norm.weight.uniform_(0.5, 1.5)
            layer.k_norm.weight.uniform_(0.5, 1.5)
        d.mask_embed.normal_(0, 1)
    return d


def _dspine_block_logits(d, feats, tokens):
    """dspine's own DFlash-style block forward at the end of a context of T positions."""
    T = feats.shape[0]
    pos = torch.arange(T)[None]
    kv = d.context_kv(feats[None], pos)
    out = d.forward_blocks(tokens[:1][None], torch.tensor([[T]]), kv, pos, torch.ones(1, T, dtype=torch.bool))
    return d.logits(out.h)[0, 0].double()  # [B, V]


def test_refuses_what_is_not_the_dflash_architecture(tiny256):
    for over, word in ((dict(mode="dspine"), "bridge"), (dict(mode="dflash"), "per-row embedding"),
                       (dict(mode="dflash", row_embedding=False), "q/k RMSNorm")):
        cfg = DSpineConfig.for_target(tiny256, **over)
        with pytest.raises(ExportError, match=word) as e:
            check_exportable(cfg)
        assert "--engine-compatible" in str(e.value)
    check_exportable(DSpineConfig.for_target(tiny256, mode="dflash", qk_norm=True, row_embedding=False))


def test_folder_matches_the_engines_format(tiny256, tmp_path):
    d = _compat(tiny256)
    cfg = d.cfg
    export_dflash(d, tmp_path, mask_token_id=3, max_position_embeddings=4096, num_target_layers=tiny256.num_layers)
    c = json.loads((tmp_path / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": cfg.feature_layers,
                                  "block_size": cfg.block_size}
    for k, v in dict(hidden_size=cfg.target_hidden, intermediate_size=cfg.ffn, num_hidden_layers=cfg.num_layers,
                     num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_theta,
                     vocab_size=cfg.vocab_size, hidden_act="silu", attention_bias=False).items():
        assert c[k] == v, k
    sd = load_file(str(tmp_path / "model.safetensors"))
    d_, H, KV, hd, F = cfg.target_hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, len(cfg.feature_layers)
    want = {"fc.weight": (d_, F * d_), "hidden_norm.weight": (d_,), "norm.weight": (d_,)}
    for i in range(cfg.num_layers):
        want.update({f"layers.{i}.input_layernorm.weight": (d_,), f"layers.{i}.post_attention_layernorm.weight": (d_,),
                     f"layers.{i}.self_attn.q_proj.weight": (H * hd, d_), f"layers.{i}.self_attn.k_proj.weight": (KV * hd, d_),
                     f"layers.{i}.self_attn.v_proj.weight": (KV * hd, d_), f"layers.{i}.self_attn.o_proj.weight": (d_, H * hd),
                     f"layers.{i}.self_attn.q_norm.weight": (hd,), f"layers.{i}.self_attn.k_norm.weight": (hd,),
                     f"layers.{i}.mlp.gate_proj.weight": (cfg.ffn, d_), f"layers.{i}.mlp.up_proj.weight": (cfg.ffn, d_),
                     f"layers.{i}.mlp.down_proj.weight": (d_, cfg.ffn)})
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    assert all(v.dtype == torch.float32 for v in sd.values())
    m = torch.load(tmp_path / "mask_embedding.pt", weights_only=True)
    assert m["mask_token_id"] == 3 and torch.equal(m["embedding"], d.mask_embed.detach())


def test_round_trip_is_bit_exact(tiny256, tmp_path):
    d = _compat(tiny256, seed=1)
    export_dflash(d, tmp_path, mask_token_id=5, max_position_embeddings=4096, num_target_layers=tiny256.num_layers)
    back, mask_id = load_dflash(tmp_path)
    assert mask_id == 5 and back.cfg.feature_layers == d.cfg.feature_layers
    a, b = d.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_math_gives_dspines_block_logits(tiny256, tmp_path, seed):
    d = _compat(tiny256, seed=seed).double()
    emb, head = tiny256.input_embeddings().weight.detach().double(), tiny256.output_head().detach().double()
    d.bind_target(torch.nn.Embedding.from_pretrained(emb), head)
    export_dflash(d, tmp_path, mask_token_id=7, max_position_embeddings=4096,
                  num_target_layers=tiny256.num_layers, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    T, B = 11, d.cfg.block_size
    feats = torch.randn(T, len(d.cfg.feature_layers) * d.cfg.target_hidden, generator=g, dtype=torch.float64)
    tokens = torch.tensor([42] + [7] * (B - 1))  # anchor, then the mask id
    ours = _dspine_block_logits(d, feats, tokens)
    ref = reference_block_logits(tmp_path, emb, head, feats, tokens, start=T)
    # dspine's norms and RoPE angles round through float32 even in a float64 model
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-5), (ours - ref).abs().max()
    assert torch.equal(ours[1:].argmax(-1), ref[1:].argmax(-1))


def test_negative_control_row_embedding_and_no_qk_norm_differ(tiny256, tmp_path, monkeypatch):
    """The reference catches what the format cannot hold: forced exports of a drafter with a
    per-row embedding, or without q/k norm, give other logits than dspine's."""
    import dspine.export.dflash as ex

    monkeypatch.setattr(ex, "check_exportable", lambda cfg, where="": None)
    g = torch.Generator().manual_seed(3)
    for over in (dict(qk_norm=True, row_embedding=True), dict(qk_norm=False, row_embedding=False)):
        d = random_drafter(tiny256, mode="dflash", block_size=8, seed=2, **over).double()
        with torch.no_grad():
            if d.row_embed is not None:
                d.row_embed.normal_(0, 1)
        emb, head = tiny256.input_embeddings().weight.detach().double(), tiny256.output_head().detach().double()
        d.bind_target(torch.nn.Embedding.from_pretrained(emb), head)
        sd = {k: v for k, v in d.state_dict().items() if k != "row_embed"}
        if not d.cfg.qk_norm:  # the engines always apply q/k norm: give them unit weights
            for i in range(d.cfg.num_layers):
                sd[f"layers.{i}.q_norm.weight"] = torch.ones(d.cfg.head_dim, dtype=torch.float64)
                sd[f"layers.{i}.k_norm.weight"] = torch.ones(d.cfg.head_dim, dtype=torch.float64)
        out = tmp_path / str(over["qk_norm"])
        out.mkdir()
        from safetensors.torch import save_file

        save_file(to_zlab_state_dict(sd, d.cfg, torch.float64), str(out / "model.safetensors"))
        torch.save({"mask_token_id": 7, "embedding": d.mask_embed.detach().clone()}, out / "mask_embedding.pt")
        (out / "config.json").write_text(json.dumps(ex.zlab_config(d.cfg, 7, 4096, tiny256.num_layers, "float64")))
        T, B = 9, d.cfg.block_size
        feats = torch.randn(T, len(d.cfg.feature_layers) * d.cfg.target_hidden, generator=g, dtype=torch.float64)
        tokens = torch.tensor([42] + [7] * (B - 1))
        ours = _dspine_block_logits(d, feats, tokens)
        ref = reference_block_logits(out, emb, head, feats, tokens, start=T)
        assert (ours - ref).abs().max() > 1e-2, over  # >1000x the tolerance of the exact case


def test_cli_refuses_the_shipped_dflash_style_drafter_and_exports_a_compatible_one(tmp_path, capsys):
    assert main(["export", "--format", "dflash", "--drafter", "src/dspine/checkpoints/smollm2-135m-dflash",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "per-row embedding" in err and "--engine-compatible" in err
    assert main(["export", "--format", "dflash", "--drafter", "src/dspine/checkpoints/smollm2-135m-dspine",
                 "--out", str(tmp_path / "x")]) == 2
    assert "bridge and final stage" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # a compatible drafter for the real target's sizes, saved as `dspine train` saves it
    from dspine.drafter.model import DSpineDrafter

    shipped = DSpineConfig.load("src/dspine/checkpoints/smollm2-135m-dflash")
    cfg = DSpineConfig.from_dict({**json.loads(shipped.to_json()), "qk_norm": True, "row_embedding": False,
                                  "num_layers": 1})
    torch.manual_seed(0)
    save_drafter(DSpineDrafter(cfg), tmp_path / "ck")
    out = tmp_path / "dflash"
    assert main(["export", "--format", "dflash", "--drafter", str(tmp_path / "ck"), "--out", str(out)]) == 0
    res = json.loads(capsys.readouterr().out)
    c = json.loads((out / "config.json").read_text())
    assert c["dflash_config"]["mask_token_id"] == res["mask_token_id"]
    assert c["dflash_config"]["target_layer_ids"] == [1, 8, 14, 21, 28]
    # the default mask token is a special token the chat template never writes
    assert 2 < res["mask_token_id"] < 100
    # refusals name the setting
    assert main(["export", "--format", "dflash", "--drafter", str(tmp_path / "ck"), "--out", str(out)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert main(["export", "--format", "dflash", "--drafter", str(tmp_path / "ck"), "--out", str(tmp_path / "y"),
                 "--mask-token-id", "999999"]) == 2
    assert "--mask-token-id" in capsys.readouterr().err
    assert main(["export", "--format", "gguf", "--drafter", str(tmp_path / "ck"), "--out",
                 str(tmp_path / "d.gguf")]) == 2
    assert "--llama-cpp" in capsys.readouterr().err


def test_train_engine_compatible_needs_dflash_mode(tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path), "--mode", "dspine", "--engine-compatible",
                 "--out", str(tmp_path / "o")]) == 2
    assert "--engine-compatible" in capsys.readouterr().err


def test_engine_target_folder_has_the_weights_dspine_decodes_with(tmp_path):
    from dspine.export.engines import EngineExportError, write_engine_target
    from dspine.target.registry import resolve_target

    src = resolve_target("smollm2-135m")
    out = write_engine_target(src, tmp_path / "t")
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"] and c["tie_word_embeddings"] is True
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert torch.equal(b["model.embed_tokens.weight"], a["lm_head.weight"]) and "lm_head.weight" not in b
    assert all(torch.equal(a[k], b[k]) for k in a if k != "lm_head.weight")
    assert (out / "tokenizer.json").exists() and "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    with pytest.raises(EngineExportError, match="not empty"):
        write_engine_target(src, out)


def test_cli_refusals_leave_nothing_behind(tmp_path, capsys, monkeypatch):
    """Adversarial findings (2026-12-02): layers the target lacks, a mask token the target
    writes, an --out that is a file, a missing --target-dir; and a failed export leaves no
    partial output."""
    from dspine.drafter.model import DSpineDrafter

    shipped = DSpineConfig.load("src/dspine/checkpoints/smollm2-135m-dflash")
    base = {**json.loads(shipped.to_json()), "qk_norm": True, "row_embedding": False, "num_layers": 1}
    torch.manual_seed(0)
    save_drafter(DSpineDrafter(DSpineConfig.from_dict({**base, "feature_layers": [1, 8, 40]})), tmp_path / "fl")
    save_drafter(DSpineDrafter(DSpineConfig.from_dict(base)), tmp_path / "ok")
    assert main(["export", "--format", "dflash", "--drafter", str(tmp_path / "fl"), "--out", str(tmp_path / "a")]) == 2
    assert "feature layers [40]" in capsys.readouterr().err
    assert main(["export", "--format", "dflash", "--drafter", str(tmp_path / "ok"), "--out", str(tmp_path / "b"),
                 "--mask-token-id", "2"]) == 2
    assert "eos_token" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main(["export", "--format", "dflash", "--drafter", str(tmp_path / "ok"), "--out", str(tmp_path / "afile")]) == 2
    assert "--out" in capsys.readouterr().err and (tmp_path / "afile").read_text() == "x"
    assert main(["export", "--format", "gguf", "--drafter", str(tmp_path / "ok"), "--out", str(tmp_path / "d.gguf"),
                 "--llama-cpp", str(tmp_path)]) == 2
    capsys.readouterr()

    def boom(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr("dspine.export.dflash.torch.save", boom)  # dies after model.safetensors is written
    assert main(["export", "--format", "dflash", "--drafter", str(tmp_path / "ok"), "--out", str(tmp_path / "c")]) == 130
    assert not (tmp_path / "c").exists() and not [f for f in tmp_path.iterdir() if "partial" in f.name]
