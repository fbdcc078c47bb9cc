"""What the memory footprint needs to know about a target, read from its configuration.

:class:`TargetSpec` holds element counts (parameters, K/V per position, sliding-window
layers, linear-attention state) built from a transformers config, instantiating the
architecture on the ``meta`` device (no memory); :func:`target_spec` builds one for a
target name/path, a loaded target or ``random:<arch>``. Used by
:func:`dspine.drafter.memory.estimate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TargetSpec:
    """What the footprint needs to know about a target, from its HF config.

    Element counts (not bytes): ``params`` unique parameters; ``kv_per_position`` K+V
    elements per position over the full-attention layers; ``sliding`` a list of
    (window, K+V elements per position) for sliding-window layers; ``state_fp32`` and
    ``conv_state`` elements per request of linear-attention layers.
    """

    name: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    params: int
    kv_per_position: int
    sliding: list[tuple[int, int]] = field(default_factory=list)
    state_fp32: int = 0
    conv_state: int = 0
    max_positions: int = 1 << 30
    head_params: int = 0

    def default_feature_layers(self, n: int = 5) -> list[int]:
        from dspine.target.adapter import Target

        return Target.default_feature_layers(self, n)  # uses only num_layers

    def kv_elements(self, context: int) -> int:
        """K/V elements of one request holding ``context`` positions."""
        return self.kv_per_position * context + sum(min(w, context) * e for w, e in self.sliding)

    @classmethod
    def from_hf_config(cls, config, name: str = "", model: torch.nn.Module | None = None) -> "TargetSpec":
        """Build from a transformers config (text config of multimodal ones).

        ``model``: an already built module to count parameters from; by default the
        architecture is instantiated on the ``meta`` device (no memory).
        """
        cfg = getattr(config, "text_config", None) or config
        if model is None:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())  # shared (tied) tensors once
        head = model.get_output_embeddings()
        head_params = head.weight.numel() if head is not None else 0
        L = cfg.num_hidden_layers
        heads = cfg.num_attention_heads
        kvh = getattr(cfg, "num_key_value_heads", None) or heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * L)
        full = sliding_n = lin = 0
        for t in types:
            if t == "linear_attention":
                lin += 1
            elif t == "sliding_attention" and getattr(cfg, "sliding_window", None):
                sliding_n += 1
            else:
                full += 1
        per_layer = 2 * kvh * hd
        sliding = [(int(cfg.sliding_window), per_layer)] * sliding_n if sliding_n else []
        state = conv = 0
        if lin:
            nv = cfg.linear_num_value_heads
            nk = cfg.linear_num_key_heads
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            state = lin * nv * dk * dv
            conv = lin * (2 * nk * dk + nv * dv) * cfg.linear_conv_kernel_dim
        return cls(name=name or getattr(cfg, "model_type", "target"), hidden_size=cfg.hidden_size,
                   vocab_size=cfg.vocab_size, num_layers=L, params=params,
                   kv_per_position=full * per_layer, sliding=sliding, state_fp32=state,
                   conv_state=conv, max_positions=int(getattr(cfg, "max_position_embeddings", 1 << 30)),
                   head_params=head_params)


def target_spec(target) -> TargetSpec:
    """A :class:`TargetSpec` for a target name/path, a loaded :class:`dspine.target.adapter.Target`,
    or a spec (returned as is).

    Named and path targets are read from their ``config.json``; no weights are loaded into
    memory. A named target or a ``.gguf`` file is resolved as ``dspine generate`` resolves it
    (:func:`dspine.target.registry.resolve_target`): on its first use on a machine its pinned
    GGUF is fetched and converted once, with a note on stderr. ``random:<arch>`` targets are
    built (they are tiny).

    Raises:
        TargetError: the name is neither known nor an existing path.
        AssetError: the pinned download or its checksum failed.
    """
    if isinstance(target, TargetSpec):
        return target
    if isinstance(target, str):
        from dspine.target.adapter import build_random_model
        from dspine.target.registry import resolve_target

        resolved = resolve_target(target)
        if isinstance(resolved, str):  # random:<arch>
            model = build_random_model(resolved.split(":", 1)[1])
            return TargetSpec.from_hf_config(model.config, name=target, model=model)
        from transformers import AutoConfig

        return TargetSpec.from_hf_config(AutoConfig.from_pretrained(str(resolved)), name=target)
    # a loaded Target: estimate from its config (an independent check of its tensors)
    spec = TargetSpec.from_hf_config(target.model.config, name=target.name)
    spec.vocab_size = target.vocab_size
    return spec
