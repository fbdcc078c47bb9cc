"""Tiny seeded random-weight hybrid targets (``qwen3_5``, ``qwen3_next``) for tests and debugging."""
from __future__ import annotations

import math

import torch
from torch import nn

from dspine.target.registry import TargetError


_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
_RANDOM_HYBRIDS = {
    "qwen3_5": ("qwen3_5_text", dict(_COMMON)),
    "qwen3_next": ("qwen3_next", dict(_COMMON, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, shared_expert_intermediate_size=32)),
}


def default_layer_types(n: int) -> list[str]:
    """Linear attention everywhere except every 4th layer from layer 2 (4 layers: L L F L)."""
    return ["full_attention" if i % 4 == 2 else "linear_attention" for i in range(n)]


def build_random_hybrid(arch: str, vocab_size: int = 256, seed: int = 0, **overrides) -> nn.Module:
    """A tiny seeded random-weight hybrid causal LM (``qwen3_5`` text model or ``qwen3_next``).

    Default: hidden 64, 4 layers ``linear, linear, full, linear``, 2 key / 4 value heads of
    16 in the linear layers, conv kernel 4. The output head is sharpened (x8) as for
    dense random targets, and the Gated-DeltaNet decays are drawn slow (A in
    [0.02, 0.5] instead of [0.01, 16]) so the recurrent state carries information over
    many tokens and a wrong state shows up in the output.

    Raises:
        TargetError: ``arch`` is not one of ``qwen3_5``, ``qwen3_next``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in _RANDOM_HYBRIDS:
        raise TargetError(f"unknown random hybrid architecture {arch!r}; known: {sorted(_RANDOM_HYBRIDS)}")
    model_type, kw = _RANDOM_HYBRIDS[arch]
    kw = dict(kw)
    kw.update(overrides)
    kw.setdefault("layer_types", default_layer_types(kw["num_hidden_layers"]))
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab_size, max_position_embeddings=4096,
                               tie_word_embeddings=False, bos_token_id=1, eos_token_id=0,
                               pad_token_id=0, **kw)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(8.0)
            for mod in model.modules():
                if hasattr(mod, "A_log") and hasattr(mod, "dt_bias"):
                    mod.A_log.copy_(torch.empty_like(mod.A_log).uniform_(math.log(0.02), math.log(0.5)))
    return model

