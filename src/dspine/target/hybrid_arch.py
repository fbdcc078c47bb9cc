"""Recognising hybrid targets (Gated-DeltaNet + full attention) and refusing the others.

:func:`hybrid_family` names the adapter family of a supported hybrid (``qwen3_5``,
``qwen3_next``; None for a dense target) and :func:`linear_layer_ids` its linear-attention
layers. Guards (spec s.8): the recurrent state must be float32 (a config asking for
another dtype via one of :data:`STATE_DTYPE_FIELDS` is refused); a recurrent or hybrid
architecture other than :data:`KNOWN_HYBRIDS` is refused. Both raise
:class:`HybridTargetError` (a ``ValueError``) naming the setting. The rollback of these
targets is :mod:`dspine.target.replay_ssm`.
"""
from __future__ import annotations

from dspine.target.registry import TargetError

#: model_type -> adapter family. Only these hybrid architectures are validated.
KNOWN_HYBRIDS = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_next": "qwen3_next"}

#: config fields that would ask for a non-float32 recurrent state.
STATE_DTYPE_FIELDS = ("recurrent_state_dtype", "mamba_ssm_dtype", "mamba_ssm_cache_dtype", "ssm_state_dtype")

#: model types with recurrent / linear-attention state (refused unless in KNOWN_HYBRIDS).
_RECURRENT_MODEL_TYPES = {
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "bamba", "zamba", "zamba2",
    "granitemoehybrid", "lfm2", "lfm2_moe", "lfm2_vl", "lfm3", "nemotron_h", "olmo_hybrid",
    "qwen3_5_moe", "qwen3_5_moe_text", "bailing_hybrid", "rwkv", "recurrent_gemma", "xlstm",
    "minimax", "plamo2",
}
_LINEAR_LAYER_TYPES = {"linear_attention", "conv", "mamba", "hybrid", "hybrid_sliding"}


class HybridTargetError(TargetError):
    """A hybrid/recurrent target (or one of its settings) the adapter has not validated."""


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    try:
        return get(decoder=True) if get is not None else config
    except TypeError:
        return get()


def hybrid_family(config) -> str | None:
    """``"qwen3_5"`` / ``"qwen3_next"`` for a supported hybrid, None for a dense target.

    Raises:
        HybridTargetError: a recurrent/hybrid architecture the adapter does not know, or a
            recurrent state dtype other than float32 (the message names the setting).
    """
    tc = _text_config(config)
    types = {getattr(config, "model_type", None), getattr(tc, "model_type", None)} - {None}
    layer_types = set(getattr(tc, "layer_types", None) or [])
    known = [KNOWN_HYBRIDS[t] for t in types if t in KNOWN_HYBRIDS]
    recurrent = bool(types & _RECURRENT_MODEL_TYPES) or bool(layer_types & _LINEAR_LAYER_TYPES)
    if not known and not recurrent:
        return None
    name = getattr(tc, "model_type", None) or getattr(config, "model_type", "?")
    if not known:
        raise HybridTargetError(
            f"target architecture {name!r} has recurrent/linear-attention state that the ReplaySSM "
            f"adapter does not know; supported hybrid architectures: {sorted(KNOWN_HYBRIDS)}")
    for cfg in (tc, config):
        for f in STATE_DTYPE_FIELDS:
            v = getattr(cfg, f, None)
            if v is not None and str(v).replace("torch.", "") not in ("float32", "fp32"):
                raise HybridTargetError(
                    f"target config sets {f}={str(v).replace('torch.', '')!r}: ReplaySSM needs the "
                    f"recurrent state in float32 (spec sections 6 and 8); set {f} to float32")
    bad = layer_types - {"linear_attention", "full_attention"}
    if bad:
        raise HybridTargetError(f"{name} target: layer types {sorted(bad)} are not supported by the "
                                f"ReplaySSM adapter (only linear_attention and full_attention)")
    return known[0]


def linear_layer_ids(config) -> list[int]:
    """Indices of the Gated-DeltaNet (linear-attention) layers."""
    lt = getattr(_text_config(config), "layer_types", None) or []
    return [i for i, t in enumerate(lt) if t == "linear_attention"]
