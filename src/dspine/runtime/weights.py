"""Opt-in weight formats of the target: ``--target-weights`` (2026-12-03).

``as-is`` (the default) keeps the target's weights. ``q8_0`` rounds every linear layer whose
input size is a multiple of 32 (attention, MLP and the output head; a head tied to the token
embeddings rounds them too) to GGUF's Q8_0 blocks in place: per 32 weights a float16 scale
``d = max|w| / 127`` and ``q = round(w / d)`` in -127..127, stored back as the float32 ``d * q``
(:func:`dspine.drafter.q8.q8_round`). The weights are then exact 8-bit blocks, so the
``blockq`` linear backend and the lean decode path (:mod:`dspine.runtime.blockq`,
:mod:`dspine.runtime.lean`) can read them at ~1.1 bytes per weight instead of 4, for targets
that were not converted from a GGUF. This changes the target: speculative decoding is then
lossless relative to the **quantized** target (greedy equal to ``--mode ar --target-weights
q8_0``, sampling exact for its distribution), not to the original weights. Targets converted
from a Q4_1/Q8_0 GGUF (the default) are block-exact already and gain nothing.
"""
from __future__ import annotations

import torch
from torch import nn

from dspine.config import ConfigError

TARGET_WEIGHTS = ("as-is", "q8_0")


def quantize_target(target, kind: str) -> int:
    """Round ``target``'s linear layers to ``kind`` in place (``as-is``: nothing) and mark the
    target's name (``<name>+q8_0``) so that per-target measurements are kept apart.

    Returns:
        the number of linear layers rounded (0 for ``as-is``).
    Raises:
        ConfigError: an unknown ``kind`` (naming ``SpeculativeConfig.target_weights``), or no
            linear layer with an input size that is a multiple of 32.
    """
    if kind not in TARGET_WEIGHTS:
        raise ConfigError(f"SpeculativeConfig.target_weights {kind!r} is unknown; accepted: {', '.join(TARGET_WEIGHTS)}",
                          field="target_weights")
    if kind == "as-is":
        return 0
    from dspine.drafter.q8 import q8_round

    done, seen = 0, set()
    with torch.no_grad():
        for mod in target.model.modules():
            if isinstance(mod, nn.Linear) and mod.in_features % 32 == 0 and id(mod.weight) not in seen:
                seen.add(id(mod.weight))  # a tied weight once
                mod.weight.copy_(q8_round(mod.weight).to(mod.weight.dtype))
                done += 1
    if not done:
        raise ConfigError(f"SpeculativeConfig.target_weights {kind}: target {target.name!r} has no linear layer "
                          f"whose input size is a multiple of 32", field="target_weights")
    target.name = f"{target.name}+{kind}"
    target.weights_format = kind
    return done
