"""The z-lab DFlash checkpoint format that vLLM and llama.cpp serve.

A DFlash-style dspine drafter trained with ``--engine-compatible`` (per-head q/k RMSNorm,
no per-row embedding; :func:`dspine.config.engine_compatible_flags`) *is* the z-lab DFlash
architecture; this module writes and reads it in that format:

- ``config.json``: a Qwen3-style config, ``architectures: ["DFlashDraftModel"]``,
  ``dflash_config: {mask_token_id, target_layer_ids, block_size}``. ``target_layer_ids``
  are decoder-layer ids, the same numbers as dspine's ``feature_layers`` (both engines
  and dspine read the hidden state after that layer, index id + 1).
- ``model.safetensors``: ``layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
  self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight``,
  ``fc.weight`` (context fusion), ``hidden_norm.weight`` (its norm), ``norm.weight``
  (final norm). The target's embedding and output head are shared at run time, as in
  dspine, and are not written.
- ``mask_embedding.pt``: ``{"mask_token_id": int, "embedding": float [d]}``: dspine's
  learned mask embedding, which both engines substitute for the embedding of
  ``mask_token_id`` in the block's masked rows.

The math is the same op for op (pre-norm layers, RoPE half-split, bidirectional block
attention over [context ; block]); see :func:`reference_block_logits` for an independent
implementation written from the engines' code, used by the tests. What differs from
dspine's own runtime: dspine's drafter attends to the last ``window`` (2048) context
positions, the engines to all of them, so beyond 2048 tokens of context proposals may
differ (the output never does: the target verifies).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from dspine.config import DSpineConfig

FORMAT = "dflash"
ARCHITECTURE = "DFlashDraftModel"
MASK_FILE = "mask_embedding.pt"

# dspine parameter name (per layer, without "layers.N.") -> z-lab name
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "q_norm.weight": "self_attn.q_norm.weight",
    "k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "gate.weight": "mlp.gate_proj.weight",
    "up.weight": "mlp.up_proj.weight",
    "down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"fc.weight": "fc.weight", "norm_ctx.weight": "hidden_norm.weight", "norm_f.weight": "norm.weight"}


class ExportError(ValueError):
    """A drafter cannot be written exactly in the requested format (names the reason)."""


def check_exportable(cfg: DSpineConfig, where: str = "--drafter") -> None:
    """Raise ExportError unless ``cfg`` is exactly the z-lab DFlash architecture.

    Raises:
        ExportError: a DSpine drafter (bridge / final stage / causal block), a per-row
            embedding, or no q/k norm, each naming how to train an exportable drafter.
    """
    how = ("train one with `dspine train --mode dflash --engine-compatible` (or warm-start it: "
           "`--init-from` a DFlash-style drafter)")
    if cfg.bridge or cfg.final_stage:
        raise ExportError(f"{where}: a DSpine drafter's bridge and final stage have no counterpart in the "
                          f"z-lab DFlash format that vLLM and llama.cpp run, so it cannot be exported "
                          f"exactly; export a DFlash-style drafter instead ({how})")
    if cfg.block_causal:
        raise ExportError(f"{where}: a block-causal drafter is not the DFlash architecture "
                          f"(bidirectional block); {how}")
    if cfg.row_embedding:
        raise ExportError(f"{where}: the drafter has a learned per-row embedding, which the engines' "
                          f"DFlash models do not have (the export would not be exact); {how}")
    if not cfg.qk_norm:
        raise ExportError(f"{where}: the drafter has no per-head q/k RMSNorm, which the engines' DFlash "
                          f"models always apply (the export would not be exact); {how}")


def zlab_config(cfg: DSpineConfig, mask_token_id: int, max_position_embeddings: int,
                num_target_layers: int, dtype: str, source: dict | None = None) -> dict:
    """The ``config.json`` dict of the exported folder (Qwen3-style, as z-lab ships it)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.target_hidden,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": int(max_position_embeddings),
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "torch_dtype": dtype,
        "block_size": cfg.block_size,
        "num_target_layers": int(num_target_layers),
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": list(cfg.feature_layers),
                          "block_size": cfg.block_size},
        "dspine": dict(source or {}),
    }


def _rename(sd: dict, top: dict[str, str], per_layer: dict[str, str], error: str) -> dict:
    """Rename ``sd``'s keys: ``top`` maps whole names, ``per_layer`` the part after
    ``layers.N.``; any other key raises ExportError with ``error.format(key)``."""
    out = {}
    for k, v in sd.items():
        parts = k.split(".", 2)
        if k in top:
            out[top[k]] = v
        elif len(parts) == 3 and parts[0] == "layers" and parts[2] in per_layer:
            out[f"layers.{parts[1]}.{per_layer[parts[2]]}"] = v
        else:
            raise ExportError(error.format(k))
    return out


def to_zlab_state_dict(drafter_sd: dict[str, torch.Tensor], cfg: DSpineConfig,
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Rename a drafter's state dict to z-lab names (the mask embedding is not included).

    Raises:
        ExportError: a tensor the format has no place for, or a missing one.
    """
    left = dict(drafter_sd)
    left.pop("mask_embed", None)
    out = _rename(left, _TOP_NAMES, _LAYER_NAMES, "drafter tensor {} has no place in the DFlash format")
    want = set(_TOP_NAMES.values()) | {f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in _LAYER_NAMES.values()}
    missing = sorted(want - set(out))
    if missing:
        raise ExportError(f"drafter is missing tensors {missing[:4]} for the DFlash format")
    return {k: v.detach().to(dtype).contiguous().cpu() for k, v in out.items()}


def from_zlab_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_zlab_state_dict` (z-lab names -> dspine names)."""
    return _rename(sd, {v: k for k, v in _TOP_NAMES.items()}, {v: k for k, v in _LAYER_NAMES.items()},
                   "DFlash tensor {} is not part of the architecture dspine runs")


def export_dflash(drafter, out: str | Path, mask_token_id: int, max_position_embeddings: int,
                  num_target_layers: int, dtype: torch.dtype = torch.float32,
                  source: dict | None = None) -> Path:
    """Write ``drafter`` (a :class:`dspine.drafter.model.DSpineDrafter`) as a z-lab DFlash folder.

    ``mask_token_id``: the token id whose embedding the engines replace with the drafter's
    mask embedding (choose one the target never emits; :func:`default_mask_token_id`).

    Raises:
        ExportError: the drafter is not exactly the DFlash architecture, or the mask token
            id is outside the vocabulary.
    """
    from safetensors.torch import save_file

    cfg = drafter.cfg
    check_exportable(cfg)
    if not 0 <= int(mask_token_id) < cfg.vocab_size:
        raise ExportError(f"--mask-token-id {mask_token_id} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = to_zlab_state_dict(drafter.state_dict(), cfg, dtype)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    torch.save({"mask_token_id": int(mask_token_id),
                "embedding": drafter.mask_embed.detach().to(dtype).cpu().clone()}, out / MASK_FILE)
    dtype_name = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(
        zlab_config(cfg, mask_token_id, max_position_embeddings, num_target_layers, dtype_name, source),
        indent=2) + "\n")
    return out


def load_dflash(path: str | Path, window: int = 2048, target_name: str = "") -> "tuple[object, int]":
    """Read a z-lab DFlash folder back as a dspine DFlash-style drafter.

    Returns ``(drafter, mask_token_id)``; the drafter is unbound (call ``bind_target``).
    Without ``mask_embedding.pt`` the mask embedding is left at zero and must be set to
    the target's embedding row ``mask_token_id`` by the caller (:func:`bind_mask_row`).

    Raises:
        ExportError: not a DFlash folder, or a config dspine cannot run exactly
            (sliding-window or causal layers, attention bias, another activation).
    """
    from safetensors.torch import load_file

    from dspine.config import dflash_flags, engine_compatible_flags
    from dspine.drafter.model import DSpineDrafter

    p = Path(path)
    try:
        c = json.loads((p / "config.json").read_text())
    except FileNotFoundError:
        raise ExportError(f"{p}: no config.json (expected a DFlash folder)") from None
    if ARCHITECTURE not in (c.get("architectures") or []):
        raise ExportError(f"{p}: architectures {c.get('architectures')} is not [{ARCHITECTURE!r}]")
    dc = c.get("dflash_config") or {}
    for key, bad in (("use_sliding_window", True), ("attention_bias", True)):
        if c.get(key) == bad:
            raise ExportError(f"{p}: {key}={bad} is not supported by dspine's DFlash-style drafter")
    if dc.get("causal") or c.get("is_causal") or c.get("hidden_act", "silu") != "silu":
        raise ExportError(f"{p}: causal blocks or activation {c.get('hidden_act')!r} are not supported")
    rope = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta")
    cfg = DSpineConfig(target_hidden=c["hidden_size"], vocab_size=c["vocab_size"],
                       feature_layers=list(dc["target_layer_ids"]),
                       block_size=int(dc.get("block_size", c.get("block_size", 16))),
                       num_layers=c["num_hidden_layers"], ffn=c["intermediate_size"],
                       num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
                       head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                       window=window, rope_theta=float(rope), rms_eps=float(c["rms_norm_eps"]),
                       coarse_k=min(128, c["vocab_size"]), head_topk=min(16, c["vocab_size"]),
                       target_name=target_name, **dflash_flags(), **engine_compatible_flags())
    model = DSpineDrafter(cfg)
    sd = from_zlab_state_dict(load_file(str(p / "model.safetensors")))
    mask_id = int(dc["mask_token_id"])
    if (p / MASK_FILE).exists():
        m = torch.load(p / MASK_FILE, weights_only=True)
        if isinstance(m, dict):
            if int(m.get("mask_token_id", mask_id)) != mask_id:
                raise ExportError(f"{p}: {MASK_FILE} mask_token_id {m.get('mask_token_id')} != "
                                  f"dflash_config.mask_token_id {mask_id}")
            m = m["embedding"]
        sd["mask_embed"] = m.reshape(-1)
    else:
        sd["mask_embed"] = torch.zeros(cfg.target_hidden)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    if missing or unexpected:
        raise ExportError(f"{p}: tensors missing {missing[:4]} / unexpected {unexpected[:4]}")
    return model.eval(), mask_id


def default_mask_token_id(tokenizer_dir: str | Path) -> int:
    """A special token of the target that generation never produces, for the mask slot.

    Picks the highest-id added special token that is not the BOS/EOS/PAD/UNK token and
    does not appear in the chat template (the engines substitute the mask embedding for
    every occurrence of this id among the drafter's inputs, so it must not be a token
    the target writes).

    Raises:
        ExportError: no such token; pass ``--mask-token-id`` explicitly.
    """
    d = Path(tokenizer_dir)
    try:
        tok = json.loads((d / "tokenizer.json").read_text())
    except FileNotFoundError:
        raise ExportError(f"{d}: no tokenizer.json to choose a mask token from; pass --mask-token-id") from None
    tc = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").exists() else {}
    template = (d / "chat_template.jinja").read_text() if (d / "chat_template.jinja").exists() else \
        str(tc.get("chat_template") or "")
    reserved = {tc.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    best = None
    for t in tok.get("added_tokens", []):
        if t.get("special") and t["content"] not in reserved and t["content"] not in template:
            best = t["id"] if best is None else max(best, t["id"])
    if best is None:
        raise ExportError(f"{d}: the tokenizer has no unused special token for the mask slot; "
                          f"pass --mask-token-id")
    return int(best)


# -- an independent implementation of the engines' DFlash forward, for tests -------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _rope_neox(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX (half-split) rotary embedding as vLLM's ``get_rope(is_neox_style=True)`` and
    llama.cpp's ``LLAMA_ROPE_TYPE_NEOX``: x [n, heads, hd], pos [n]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = pos.double()[:, None, None] * inv  # [n, 1, hd/2]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], dim=-1)


def reference_block_logits(folder: str | Path, embed: torch.Tensor, head: torch.Tensor,
                           feats: torch.Tensor, block_tokens: torch.Tensor, start: int) -> torch.Tensor:
    """The DFlash block forward of an exported folder, written from the engines' code
    (vLLM ``qwen3_dflash.py``, llama.cpp ``models/dflash.cpp``), in float64.

    embed [V, d] and head [V, d]: the target's; feats [T, F*d]: target features of
    context positions 0..T-1; block_tokens [B] int64 (anchor, then mask ids) at positions
    ``start .. start+B-1`` (start = T). Returns logits [B, V] float64.
    """
    from safetensors.torch import load_file

    p = Path(folder)
    c = json.loads((p / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(str(p / "model.safetensors")).items()}
    eps, theta = c["rms_norm_eps"], c["rope_theta"]
    H, KV, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    mask_id = c["dflash_config"]["mask_token_id"]
    emb = embed.double()[block_tokens]
    if (p / MASK_FILE).exists():
        m = torch.load(p / MASK_FILE, weights_only=True)["embedding"].double()
        emb = torch.where((block_tokens == mask_id)[:, None], m, emb)
    ctx = _rms(feats.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [T, d]
    T, B = ctx.shape[0], block_tokens.shape[0]
    pos_ctx, pos_blk = torch.arange(T), torch.arange(start, start + B)
    h = emb
    for i in range(c["num_hidden_layers"]):
        L = lambda n: w[f"layers.{i}.{n}"]  # noqa: E731
        x = _rms(h, L("input_layernorm.weight"), eps)
        q = _rms((x @ L("self_attn.q_proj.weight").T).view(B, H, hd), L("self_attn.q_norm.weight"), eps)
        k_b = _rms((x @ L("self_attn.k_proj.weight").T).view(B, KV, hd), L("self_attn.k_norm.weight"), eps)
        k_c = _rms((ctx @ L("self_attn.k_proj.weight").T).view(T, KV, hd), L("self_attn.k_norm.weight"), eps)
        v = torch.cat([(ctx @ L("self_attn.v_proj.weight").T).view(T, KV, hd),
                       (x @ L("self_attn.v_proj.weight").T).view(B, KV, hd)])
        q = _rope_neox(q, pos_blk, theta)
        k = torch.cat([_rope_neox(k_c, pos_ctx, theta), _rope_neox(k_b, pos_blk, theta)])
        rep = H // KV
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [T+B, H, hd]
        att = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)  # non-causal over [context ; block]
        a = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(B, H * hd)
        h = h + a @ L("self_attn.o_proj.weight").T
        y = _rms(h, L("post_attention_layernorm.weight"), eps)
        g = y @ L("mlp.gate_proj.weight").T
        h = h + (torch.nn.functional.silu(g) * (y @ L("mlp.up_proj.weight").T)) @ L("mlp.down_proj.weight").T
    return _rms(h, w["norm.weight"], eps) @ head.double().T
