"""The drafter's own linear layers: float32, or rounded to Q8_0 blocks (measured, 2026-12-02).

On the lean target path a drafting cycle cost ~11 ms beside a ~7 ms plain target step, ~5
ms of it in the drafter's float32 linears (~8.7M weights, 35 MB read per forward). The
drafter only proposes: the target verifies every token, so its numerics never change the
output (greedy equality and exact sampling hold for any proposer). ``q8`` therefore rounds
a copy of the drafter's linear weights to Q8_0 blocks (float16 scale per 32 weights, q in
-127..127, as GGUF's Q8_0) and runs them on the blockq kernels
(:mod:`dspine.runtime.blockq`): ~1.1 bytes per weight instead of 4. Measured on a 2-core
AVX-512 EPYC: a 3-token proposal 8.9-11.8 -> 4.9-5.1 ms, τ unchanged on the prompts tried
(docs/decisions.md, 2026-12-02). ``auto`` times one drafter forward of each on this machine
(cached per machine and drafter shape) and takes the faster.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from dspine.tune.choose import Choice, choose_fastest

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
        raise ValueError(f"--drafter-linears q8 cannot run here: {why}")
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


def _forward(drafter, rows: int = 4, context: int = 64):
    """A zero-argument callable: one block forward of ``rows`` rows over ``context`` positions.

    ``rows`` is capped at the drafter's block size: a block-2 drafter is timed on the 2 rows
    it can draft, never on a shape it cannot run.
    """
    cfg = drafter.cfg
    rows = max(1, min(int(rows), int(cfg.block_size)))
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, context, len(cfg.feature_layers) * cfg.target_hidden, generator=g)
    pos = torch.arange(context)[None]
    with torch.no_grad():
        kv = drafter.context_kv(feats, pos)
    anchor = torch.tensor([[1]])
    apos = torch.tensor([[context]])
    valid = torch.ones(1, context, dtype=torch.bool)

    from dspine.runtime.lean_drafter import block_forward

    forward = block_forward(drafter)

    def run():
        with torch.no_grad():
            forward(anchor, apos, kv, pos, valid, rows=rows if cfg.block_causal else None)
    return run


def plan_drafter_linears(drafter, kind: str = "auto", *, redo: bool = False, timer=None,
                         progress: bool = True) -> tuple[object, Choice | None]:
    """(the drafter to propose with, the measured :class:`Choice` or None when forced).

    ``kind``: ``auto`` (``q8`` where it runs and measures faster here, cached per machine and
    drafter shape), ``float32`` (the drafter as trained) or ``q8`` (forced).

    Raises:
        ValueError: unknown ``kind`` or a forced ``q8`` that cannot run (naming ``--drafter-linears``).
    """
    if kind not in ("auto", *DRAFTER_LINEARS):
        raise ValueError(f"--drafter-linears {kind!r} is unknown; accepted: auto, {', '.join(DRAFTER_LINEARS)}")
    if kind == "float32":
        return drafter, None
    if kind == "q8":
        return quantize_drafter(drafter), None
    if q8_unavailable(drafter) is not None:
        return drafter, None
    from dspine.runtime.blockq import source_version

    q8 = quantize_drafter(drafter)
    cfg = drafter.cfg
    key = (f"drafter-linears:lean={getattr(q8, '_lean', None) is not None},d={cfg.target_hidden},L={cfg.num_layers},ffn={cfg.ffn},F={len(cfg.feature_layers)},"
           f"bridge={cfg.bridge},rows={min(4, cfg.block_size)},blockq={source_version()}")
    choice = choose_fastest(key, {"float32": _forward(drafter), "q8": _forward(q8)}, timer=timer, redo=redo,
                            progress=progress, rounds=3, what="the drafter's linear layers (float32 vs q8 blocks)")
    return (q8 if choice.chosen == "q8" else drafter), choice
