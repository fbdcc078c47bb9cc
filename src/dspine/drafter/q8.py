"""The drafter's linear layers on Q8_0 blocks (a copy; the drafter only proposes).

``q8`` rounds a copy of the drafter's linear weights to Q8_0 blocks (float16 scale per 32
weights, q in -127..127, as GGUF's Q8_0) and runs them on the blockq kernels
(:mod:`dspine.runtime.blockq`): ~1.1 bytes per weight instead of 4. The target verifies
every token, so the drafter's numerics never change the output. Whether ``q8`` is faster
here is measured where an engine is built (:func:`dspine.tune.drafter.plan_drafter_linears`).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from dspine.config import ConfigError

#: the drafter linears a user may force (``auto`` measures, :mod:`dspine.tune.drafter`)
DRAFTER_LINEARS = ("float32", "q8")


def q8_round(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] (K a multiple of 32) rounded to Q8_0 blocks, as float32 of the same shape."""
    g = w.detach().float().reshape(w.shape[0], -1, 32)
    scale = (g.abs().amax(-1, keepdim=True) / 127).half().float().clamp_min(2 ** -14)
    return (torch.round(g / scale).clamp(-127, 127) * scale).reshape(w.shape).contiguous()


def q8_unavailable(drafter) -> str | None:
    """None when :func:`quantize_drafter` can run ``drafter`` here, else why not."""
    from dspine.runtime import blockq

    p = drafter.fc.weight
    if p.dtype != torch.float32 or p.device.type != "cpu":
        return "a float32 CPU drafter only"
    if blockq.kernels(progress=False) is None:
        return f"the blockq kernels are not built here ({blockq.unavailable_reason()})"
    return None


def quantize_drafter(drafter):
    """A copy of ``drafter`` whose linear layers (input size a multiple of 32) hold Q8_0-rounded
    weights and run on the blockq kernels for up to their row limit (longer inputs, e.g. a
    long context projection, use the same rounded weights in PyTorch). The original drafter
    is left untouched (it may be trained or saved).

    Raises:
        ValueError: :func:`q8_unavailable` found a reason (naming ``--drafter-linears q8``).
    """
    from dspine.runtime import blockq

    why = q8_unavailable(drafter)
    if why is not None:
        raise ConfigError(f"SpeculativeConfig.drafter_linears 'q8' cannot run here: {why}", field="drafter_linears")
    out = copy.deepcopy(drafter)
    object.__setattr__(out, "_target_embed", drafter._target_embed)  # shared, frozen, not copied
    object.__setattr__(out, "_target_head", drafter._target_head)
    for mod in list(out.modules()):
        for name, ch in list(mod.named_children()):
            if type(ch) is nn.Linear and ch.in_features % blockq.QK == 0:
                with torch.no_grad():
                    ch.weight.copy_(q8_round(ch.weight))
                blocks = blockq.pack_q8(ch.weight.data)
                if blocks is not None:
                    setattr(mod, name, blockq.BlockQLinear(ch, blocks, rows=blockq.MAX_ROWS))
    from dspine.runtime.lean_drafter import LeanDrafter, lean_drafter_support

    # one request's block forward in one C++ call where it runs (dspine.runtime.lean_drafter)
    object.__setattr__(out, "_lean", LeanDrafter(out) if lean_drafter_support(out) is None else None)
    return out.eval()


def forced_linears(drafter, kind: str):
    """``drafter`` (``float32``) or its Q8_0 copy (``q8``), nothing measured.

    Raises:
        ValueError: another ``kind`` (naming ``--drafter-linears``; ``auto`` is measured where
            the engine is built, :func:`dspine.tune.drafter.plan_drafter_linears`), or a
            ``q8`` that cannot run here.
    """
    if kind == "float32":
        return drafter
    if kind == "q8":
        return quantize_drafter(drafter)
    raise ConfigError(f"SpeculativeConfig.drafter_linears {kind!r} is not a forced choice here; accepted: "
                      f"{', '.join(DRAFTER_LINEARS)} "
                     f"(auto is measured where the engine is built: dspine.tune.drafter.measured_proposer)",
                      field="drafter_linears")
